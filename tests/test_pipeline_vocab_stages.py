"""The LM head split by vocabulary rows over the pipeline stages: its pricing, AutoPipe's cuts and the balance."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_merak.parallel.pipeline import (
    BlockCost,
    build_partition,
    estimate_stage_memory_bytes,
    partition_autopipe,
    partition_min_max,
    simulate_schedule,
    split_vocabulary_head,
)
from lightning_merak.planning.flops import TransformerShape

BENCHMARK_HIDDEN, BENCHMARK_SEQ, BENCHMARK_MICRO_BATCH = 128, 64, 2
"""benchmarks.merak3d's heavy-head Llama: hidden 128, sequence 64, 2 samples per micro-batch."""


def causal_lm_costs(layers: int, vocab: int, hidden: int = BENCHMARK_HIDDEN, seq: int = BENCHMARK_SEQ,
                    micro_batch: int = BENCHMARK_MICRO_BATCH, flops_per_s: float = 1e10) -> list[BlockCost]:
    """Analytic node costs of the benchmark's Llama (matmul FLOPs, backward twice the forward), as traced:
    prefix (embedding, no matmul), the blocks, suffix (final norm and head)."""
    tokens = micro_batch * seq
    heads = max(2, hidden // 32)
    block = TransformerShape(layers=1, hidden=hidden, heads=heads, kv_heads=heads, head_dim=hidden // heads,
                             vocab=0, intermediate=hidden * 8 // 3 // 8 * 8)
    block_s = tokens * block.forward_flops_per_token(seq) / flops_per_s
    head_s = tokens * 2.0 * hidden * vocab / flops_per_s
    hidden_bytes = tokens * hidden * 4
    return [
        BlockCost("prefix", 0.0, 0.0, vocab * hidden * 4, hidden_bytes, 0, is_embedding=True),
        *(BlockCost(f"model.layers.{index}", block_s, 2 * block_s, 12 * hidden * hidden * 4, hidden_bytes,
                    16 * hidden_bytes) for index in range(layers)),
        BlockCost("suffix", head_s, 2 * head_s, vocab * hidden * 4, hidden_bytes, tokens * vocab * 4),
    ]


def max_over_mean(forward_s: tuple[float, ...], backward_s: tuple[float, ...]) -> float:
    stage_s = [f + b for f, b in zip(forward_s, backward_s)]
    return max(stage_s) / (sum(stage_s) / len(stage_s))


def test_the_split_head_costs_each_stage_its_share_and_the_exchange():
    blocks = [BlockCost("prefix", 1.0, 2.0, 40, 8, 4), BlockCost("layers.0", 3.0, 6.0, 10, 8, 20),
              BlockCost("suffix", 8.0, 0.0, 400, 8, 80)]
    kept, share = split_vocabulary_head(blocks, 4, exchange_s=0.5, exchange_s_per_byte=0.25, split_embedding=False)
    assert kept[:2] == blocks[:2]
    assert (kept[2].forward_s, kept[2].resolved_backward_s(), kept[2].param_bytes) == (0.0, 0.0, 0)
    assert kept[2].output_bytes == 8
    # 8/4 forward, (2 x 8)/4 backward (the backward ratio), each plus 0.5 + 0.25 x 8 bytes of hidden state
    assert (share.forward_s, share.backward_s) == (4.5, 6.5)
    assert (share.param_bytes, share.saved_bytes, share.exchange_bytes) == (100, 20, 8)
    _, alone = split_vocabulary_head(blocks, 1, exchange_s=0.5)
    assert (alone.forward_s, alone.backward_s, alone.exchange_bytes) == (8.0, 16.0, 0)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        split_vocabulary_head(blocks, 0)


def test_the_split_embedding_spreads_its_parameters_and_table_gradient_over_the_stages():
    blocks = [BlockCost("prefix", 1.0, 2.0, 40, 8, 4), BlockCost("layers.0", 3.0, 6.0, 10, 8, 20),
              BlockCost("suffix", 8.0, 0.0, 400, 8, 80)]
    kept, share = split_vocabulary_head(blocks, 4, exchange_s=0.5, exchange_s_per_byte=0.25)
    # the first stage keeps the lookup's forward; its backward (the table's gradient) and rows spread, and the
    # lookup is not priced a second time by the backward ratio
    assert (kept[0].forward_s, kept[0].resolved_backward_s(), kept[0].param_bytes) == (1.0, 0.0, 0)
    assert kept[1] == blocks[1]
    # the head's share plus the looked-up rows' exchange each way (0.5 + 0.25 x 8), and 2/4 of the table's gradient
    assert (share.forward_s, share.backward_s) == (7.0, 9.5)
    assert share.param_bytes == 100 + 10
    whole = build_partition(blocks, (0, 1, 2), "test")
    split = build_partition(kept, (0, 1, 2), "test", vocabulary=share)
    assert split.stage_param_bytes == (110, 120, 110) and whole.stage_param_bytes == (40, 10, 400)
    assert split.stage_forward_s[0] + split.stage_backward_s[0] == 1.0 + share.forward_s + share.backward_s


def test_autopipe_gives_the_lookup_stage_a_block_when_the_split_leaves_it_light():
    """One stage per block but one: the first stage's lookup is light once its table gradient is shared, so it
    takes a block rather than leaving a stage with two."""
    blocks = [BlockCost("prefix", 4.0, 2.0, 40, 8, 4, is_embedding=True),
              *(BlockCost(f"layers.{index}", 3.0, 6.0, 10, 8, 20) for index in range(4)),
              BlockCost("suffix", 8.0, 16.0, 400, 8, 80)]
    partition = partition_autopipe(blocks, 4, 8, vocab_stages=True)
    assert partition.boundaries == (0, 2, 3, 4)


def test_partition_totals_carry_the_share_on_every_stage():
    blocks = causal_lm_costs(4, 1000)
    kept, share = split_vocabulary_head(blocks, 2)
    split = build_partition(kept, (0, 3), "test", vocabulary=share)
    whole = build_partition(blocks, (0, 3), "test")
    assert split.vocab_stages and not whole.vocab_stages
    assert split.stage_forward_s[0] == pytest.approx(whole.stage_forward_s[0] + blocks[-1].forward_s / 2)
    assert split.stage_forward_s[1] == pytest.approx(whole.stage_forward_s[1] - blocks[-1].forward_s / 2)
    assert sum(split.stage_param_bytes) == sum(whole.stage_param_bytes)
    memory = estimate_stage_memory_bytes(kept, (0, 3), 4, vocabulary=share)
    assert memory[0] > estimate_stage_memory_bytes(kept, (0, 3), 4)[0]


def test_the_last_stage_takes_layers_again():
    blocks = causal_lm_costs(8, 32000)
    whole = partition_autopipe(blocks, 4, 8)
    split = partition_autopipe(blocks, 4, 8, vocab_stages=True)
    assert whole.boundaries[-1] == len(blocks) - 1  # the head alone
    assert split.boundaries == (0, 3, 5, 7)  # two blocks per stage, the embedding with the first
    assert split.method == "autopipe" and split.vocab_stages
    assert partition_min_max(blocks, 4, vocab_stages=True).boundaries == split.boundaries


@pytest.mark.parametrize("vocab", [32000, 128000])
@pytest.mark.parametrize("layers", [8, 16])
@pytest.mark.parametrize("stages", [2, 4, 8])
def test_sim_heavy_head_max_over_mean(vocab: int, layers: int, stages: int):
    """[sim] ``heavy_head_max_over_mean``: the worst stage over the mean under AutoPipe drops to <= 1.10."""
    blocks = causal_lm_costs(layers, vocab)
    micro_batches = 2 * stages
    whole = partition_autopipe(blocks, stages, micro_batches)
    split = partition_autopipe(blocks, stages, micro_batches, vocab_stages=True)
    before = max_over_mean(whole.stage_forward_s, whole.stage_backward_s)
    after = max_over_mean(split.stage_forward_s, split.stage_backward_s)
    assert after <= 1.10, (vocab, layers, stages, split.boundaries, after)
    if stages >= 4:
        assert before >= 1.9, before  # the head outweighs the mean stage, whichever cut
    iteration = [simulate_schedule(p.stage_forward_s, p.stage_backward_s, micro_batches).iteration_s
                 for p in (whole, split)]
    assert iteration[1] < iteration[0]


def test_benchmark_leg_scales_the_measured_costs_and_reports_the_worst_case():
    from benchmarks import _vocab_stages

    measured = causal_lm_costs(8, 32000)
    scaled = _vocab_stages.scaled_costs(measured, 16, 128000)
    assert len(scaled) == 18
    assert scaled[-1].forward_s == pytest.approx(4 * measured[-1].forward_s)
    assert scaled[-1].param_bytes == 4 * measured[-1].param_bytes
    rows = _vocab_stages.simulated_rows(measured)
    assert len(rows) == 14  # 2 vocabularies x (3 stage counts for 8 blocks + 4 for 16)
    assert all(row["simulated_speedup"] >= 1.0 - 1e-9 for row in rows if row["stages"] >= 4)
    assert _vocab_stages.heavy_head_max_over_mean(rows) == max(row["vocab_stages_max_over_mean"] for row in rows)
    assert _vocab_stages.heavy_head_max_over_mean(rows) <= 1.10  # the analytic embedding costs nothing


def test_auto_splits_where_the_simulation_predicts_a_shorter_step():
    from types import SimpleNamespace

    from lightning_merak.strategies.merak3d.vocab_stages_build import vocab_split_autopipe

    layout = SimpleNamespace(num_stages=2, micro_batches=4)
    heavy = SimpleNamespace(costs=causal_lm_costs(8, 32000))
    # the head balances the embedding: splitting it would leave stage 0 with the embedding and half the head
    light = SimpleNamespace(costs=[BlockCost("prefix", 0.2, 0.0, 0, 8, 0), BlockCost("layers.0", 1.0, 0.0, 0, 8, 0),
                                   BlockCost("layers.1", 1.0, 0.0, 0, 8, 0), BlockCost("suffix", 0.2, 0.0, 0, 8, 0)])
    assert vocab_split_autopipe(heavy, layout, "auto").vocab_stages
    assert not vocab_split_autopipe(light, layout, "auto").vocab_stages
    assert vocab_split_autopipe(light, layout, "on").vocab_stages
    assert not vocab_split_autopipe(heavy, layout, "off").vocab_stages


def test_the_planner_prices_the_split_head_on_every_stage():
    """A head as slow as four blocks: at pp=4 the split's predicted step is shorter, the head's parameters spread
    over the stages, and a search allowed both ranks the split first at pp=4; a layout that cannot split is
    refused."""
    from lightning_merak.planning import planner

    samples = (1, 2, 4, 8)
    profile = planner.ModelProfile(
        num_blocks=8, hidden_bytes_per_sample=1024,
        block_times={(1, n): planner.BlockTimes((1e-3 * n,), (2e-3 * n,)) for n in samples},
        prefix_times={n: (1e-5 * n, 2e-5 * n) for n in samples},
        suffix_times={n: (4e-3 * n, 8e-3 * n) for n in samples},
        block_parameter_bytes={1: 1000}, prefix_parameter_bytes=4000, suffix_parameter_bytes=4000,
        block_activation_bytes_per_sample={1: 100}, optimizer_s_per_parameter_byte=0.0)
    link = planner.CollectiveCost(1e-6, 1e12)
    network = planner.NetworkProfile(all_reduce={2: link, 4: link}, p2p=link)
    space = planner.SearchSpace(world_size=4, global_batch_size=16, tp_degrees_allowed=(1,), max_pipeline_stages=4,
                                micro_batch_choices=(8,), recompute_ratios=(0.0,), vocab_stages_choices=(False, True))
    whole, split = (planner.predict(planner.Layout(1, 4, 1, 8, 1, 0.0, vocab_stages=flag), profile, network, space)
                    for flag in (False, True))
    # the busiest stage runs 3 blocks' worth instead of the head's 4; the bubble stays (pp - 1) stages
    assert split.components["compute"] == pytest.approx(0.75 * whole.components["compute"], rel=0.01)
    assert split.step_time_s < 0.85 * whole.step_time_s
    # every rank holds two blocks and a quarter of the embedding and of the head
    assert split.memory_components["parameters"] == 4000 / 4 + 2 * 1000 + 4000 / 4
    ranked = planner.plan(space, profile, network).ranked
    assert [p.layout.vocab_stages for p in ranked if p.layout.pp == 4] == [True, False]
    # an embedding the split leaves whole (a subclass, a hooked one, a schedule that keeps it) stays priced on the
    # first stage, with one exchange (the head's) instead of two
    kept = dataclasses.replace(space, embedding_splits_with_head=False)
    head_only = planner.predict(planner.Layout(1, 4, 1, 8, 1, 0.0, vocab_stages=True), profile, network, kept)
    assert head_only.memory_components["parameters"] == 4000 + 2 * 1000 + 4000 / 4  # the first stage's
    assert head_only.components["compute"] == pytest.approx(split.components["compute"], rel=0.01)
    # the exchanges are their own part of the step (the head's and the embedding's: two all-reduces' worth per
    # micro-batch, forward and backward), not tensor-parallel communication
    exchange = 2 * 8 * network.all_reduce_s(1024 * 2, 4)
    assert split.components["vocab_exchange"] == pytest.approx(2 * exchange)
    assert head_only.components["vocab_exchange"] == pytest.approx(exchange)
    assert whole.components["vocab_exchange"] == split.components["exposed_tp_comm"] == 0.0
    assert sum(split.components.values()) == pytest.approx(split.step_time_s)
    with pytest.raises(ValueError, match=r"vocab_stages splits the LM head over pipeline stages \(pp > 1\)"):
        planner.Layout(4, 1, 1, 1, 1, 0.0, vocab_stages=True)
    assert planner.Layout(1, 2, 1, 8, 1, 0.0, cp=2, vocab_stages=True).vocab_stages  # each context rank's shard


def test_the_planner_is_told_when_the_embedding_stays_whole():
    """The planner's pricing follows the build: a plain or tied embedding splits with the head; a subclass, a
    hooked one, or one under a schedule that computes weight gradients for parameters only stays whole."""
    import torch
    from torch import nn

    from lightning_merak.strategies.merak3d.vocab_stages_build import embedding_splits_with_head

    class LanguageModel(nn.Module):
        def __init__(self, embedding: nn.Embedding, tied: bool = False) -> None:
            super().__init__()
            self.embed, self.head = embedding, nn.Linear(4, 8, bias=False)
            if tied:
                self.head.weight = self.embed.weight

        def get_input_embeddings(self) -> nn.Module:
            return self.embed

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    class ScaledEmbedding(nn.Embedding):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return super().forward(input_ids) * 2.0

    assert embedding_splits_with_head(LanguageModel(nn.Embedding(8, 4)), "1f1b")
    assert not embedding_splits_with_head(LanguageModel(nn.Embedding(8, 4)), "interleaved_zero_bubble")
    assert embedding_splits_with_head(LanguageModel(nn.Embedding(8, 4), tied=True), "interleaved_zero_bubble")
    assert not embedding_splits_with_head(LanguageModel(ScaledEmbedding(8, 4)), "1f1b")
    watched = LanguageModel(nn.Embedding(8, 4))
    watched.embed.register_forward_hook(lambda module, args, output: None)
    assert not embedding_splits_with_head(watched, "1f1b")


def test_measured_legs_pair_each_split_with_its_autopipe_run_and_feed_the_goals():
    """The benchmark's measured rows: each leg's split run against AutoPipe alone (speed and loss), and the
    issue's four goals over one run, the speedup from the pp=4 leg only."""
    from benchmarks import _vocab_stages

    calls = []

    def outcome(tokens_per_s: float, losses: list[float]) -> dict:
        return {"ranks": [{"boundaries": [0, 5]}], "step_s": 1.0, "tokens_per_s": tokens_per_s, "losses": losses}

    def run(label: str, workload: dict, stages: int, merak: dict) -> dict:
        calls.append((label, workload["vocab"], stages, merak.get("vocab_stages", "off")))
        return outcome(300.0 if merak.get("vocab_stages") == "on" else 200.0, [2.0, 1.0 + 1e-6])

    heavy = {"hidden": 128, "layers": 8, "vocab": 32000, "seq": 64, "global_batch": 16}
    rows = _vocab_stages.measured_rows(run, outcome(100.0, [2.0, 1.0]), heavy, 4)
    assert calls == [("pp=2 autopipe vocab_stages=on", 32000, 2, "on"), ("pp=4 autopipe", 128000, 4, "off"),
                     ("pp=4 autopipe vocab_stages=on", 128000, 4, "on")]
    split = [row for row in rows if row["vocab_stages"] == "on"]
    assert [row["vs_autopipe"] for row in split] == [3.0, 1.5]
    assert split[0]["loss_max_rel_diff"] == pytest.approx(1e-6)
    assert split[1]["loss_max_rel_diff"] == 0.0
    simulated = _vocab_stages.simulated_rows(causal_lm_costs(8, 32000))
    goals = {goal["key"]: goal for goal in _vocab_stages.goal_figures(simulated, rows)}
    assert goals["vocab_stages_speedup"]["value"] == 1.5 and goals["vocab_stages_speedup"]["met"]
    assert list(goals["vocab_stages_speedup"]["by_config"]) == ["vocab128000/pp4"]
    assert goals["vocab_stages_loss_max_rel_diff"]["value"] == pytest.approx(1e-6)
    assert goals["heavy_head_max_over_mean"]["value"] == _vocab_stages.heavy_head_max_over_mean(simulated)


def test_the_planner_searches_the_split_at_tensor_parallel_degrees():
    from lightning_merak.planning import planner

    space = planner.SearchSpace(world_size=4, global_batch_size=16, tp_degrees_allowed=(1, 2), max_pipeline_stages=2,
                                micro_batch_choices=(4,), recompute_ratios=(0.0,), vocab_stages_choices=(False, True))
    split = {(layout.pp, layout.tp) for layout in planner.candidate_layouts(space) if layout.vocab_stages}
    assert split == {(2, 1), (2, 2)}
    sequence_split = dataclasses.replace(space, sequence_parallel=True)
    assert {(layout.pp, layout.tp) for layout in planner.candidate_layouts(sequence_split)
            if layout.vocab_stages} == {(2, 1), (2, 2)}


def test_an_embedding_something_watches_is_not_replaced():
    """A callback reading the embedding's lookups (SparseCommunication's forward hook) or its gradient would lose
    them if the split replaced the module: such an embedding stays on the first stage."""
    import torch

    from lightning_merak.parallel.pipeline.embedding_stages import embedding_split_problem

    plain = torch.nn.Embedding(8, 4)
    assert embedding_split_problem(plain) is None
    watched = torch.nn.Embedding(8, 4)
    watched.register_forward_hook(lambda module, args, output: None)
    assert "watches the input embedding" in embedding_split_problem(watched)
    reduced = torch.nn.Embedding(8, 4)
    reduced.weight.register_post_accumulate_grad_hook(lambda param: None)
    assert "watches the input embedding" in embedding_split_problem(reduced)
    assert "max_norm" in embedding_split_problem(torch.nn.Embedding(8, 4, max_norm=1.0))
