"""Variable-length micro-batches: the planner, the length mix, micro-batch tensors, packed masks and the data."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import DataConfig, ModelConfig
from lightning_merak.modules.data import LanguageModelingData
from lightning_merak.parallel.micro_batching import (
    CostModel,
    MicroBatching,
    VariableBatch,
    multi_task_lengths,
    plan_dynamic,
    plan_packed,
    plan_padded,
)
from lightning_merak.parallel.micro_batching.plan import MicroBatch, karmarkar_karp
from lightning_merak.parallel.micro_batching.samples import (
    check_consumer,
    micro_batch_tensors,
    summed_token_loss,
    target_count,
)

LENGTHS = multi_task_lengths(96, seed=3)[0].tolist()
COST = CostModel.from_shape(64, 128)


def _covers_once(plan, count: int) -> None:
    seen = sorted(index for replica in plan.replicas for micro in replica for index in micro.samples)
    assert seen == list(range(count))


def test_length_mix_is_long_tailed_and_bounded():
    lengths, tasks = multi_task_lengths(4000, seed=0)
    assert lengths.min() >= 16 and lengths.max() <= 2048
    assert lengths.max() / lengths.min() >= 100
    assert np.median(lengths) < lengths.mean() / 1.5  # the tail pulls the mean up
    assert len(set(tasks.tolist())) == 5
    assert (multi_task_lengths(50, seed=1)[0] == multi_task_lengths(50, seed=1)[0]).all()


@pytest.mark.parametrize("replicas, stages", [(1, 2), (2, 2), (3, 4)])
def test_every_plan_covers_each_sample_once_and_fills_the_pipeline(replicas, stages):
    plans = [plan_padded(LENGTHS, replicas, 4, stages), plan_packed(LENGTHS, replicas, 4, 2048, stages),
             plan_dynamic(LENGTHS, replicas, stages, COST, 4096)]
    for plan in plans:
        assert len(plan.replicas) == replicas
        assert all(len(replica) == len(plan.replicas[0]) >= stages for replica in plan.replicas)
        _covers_once(plan, len(LENGTHS))
        for micro in (micro for replica in plan.replicas for micro in replica):
            assert micro.length % 8 == 0
            assert all(sum(LENGTHS[i] for i in row) <= micro.length for row in micro.rows)


def test_padded_plan_keeps_loader_order_and_equal_counts():
    plan = plan_padded(list(range(2, 26)), 2, 3)
    assert [micro.samples for micro in plan.replicas[0]] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert plan.replicas[1][2].length == 32  # 25 tokens, rounded up to 8


def test_packed_micro_batches_are_as_long_as_their_fullest_row():
    """The row length is a capacity: short samples packed together do not pay for a whole row of padding."""
    plan = plan_packed([30, 20, 40, 50, 60, 5], 1, 2, 100)
    # rows of 95, 50 and 60 tokens (capacity 104, aligned): micro-batches of the first two rows, and the third
    assert [(micro.rows, micro.length) for micro in plan.replicas[0]] == [(((0, 1, 2, 5), (3,)), 96), (((4,),), 64)]
    assert plan_packed([64] * 4, 1, 1, 4096).replicas[0][0].length == 256


def test_dynamic_plan_respects_the_token_limit_and_beats_padding_and_packing():
    dynamic = plan_dynamic(LENGTHS, 2, 2, COST, 4096)
    assert all(micro.padded_tokens <= 4096 for replica in dynamic.replicas for micro in replica)
    assert dynamic.padding_fraction(LENGTHS) < 0.1 < plan_padded(LENGTHS, 2, 4, 2).padding_fraction(LENGTHS)

    def objective(plan) -> float:  # what the planner minimises: bubble plus the slowest replica's work
        slowest = max(max(micro.time(COST) for micro in replica) for replica in plan.replicas)
        return slowest + max(plan.replica_times(COST))

    assert objective(dynamic) < objective(plan_packed(LENGTHS, 2, 4, 2048, 2))
    assert objective(dynamic) < objective(plan_padded(LENGTHS, 2, 4, 2))
    times = dynamic.replica_times(COST)
    assert max(times) / min(times) < 1.1  # balanced work, not balanced sample counts
    assert plan_dynamic(LENGTHS, 2, 2, COST, 4096) == dynamic


def test_dynamic_plan_refuses_a_sample_over_the_token_limit():
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        plan_dynamic([100, 20], 1, 2, COST, 64)


def test_karmarkar_karp_balances_and_keeps_every_item():
    costs = [9.0, 7.0, 6.0, 5.0, 5.0, 4.0, 3.0, 1.0]
    bins = karmarkar_karp(costs, 3)
    assert sorted(i for chosen in bins for i in chosen) == list(range(len(costs)))
    sums = [sum(costs[i] for i in chosen) for chosen in bins]
    assert max(sums) - min(sums) <= 2.0


def test_cost_model_fit_recovers_the_coefficients():
    truth = CostModel(2e-6, 3e-9, 1e-3)
    grid = [(rows, length, truth.time(rows, length)) for rows in (1, 2, 4) for length in (64, 256, 1024)]
    fitted = CostModel.fit(grid)
    assert fitted.per_token == pytest.approx(truth.per_token, rel=1e-6)
    assert fitted.per_token_squared == pytest.approx(truth.per_token_squared, rel=1e-6)
    assert fitted.overhead == pytest.approx(truth.overhead, rel=1e-6)


def test_cost_model_fit_prices_short_micro_batches_by_their_relative_error():
    """Measurements spanning 30x with 5% noise: the fit keeps every micro-batch within 15% of its time, the
    per-micro-batch overhead that dominates the short ones included (an absolute fit drops it)."""
    truth = CostModel(4e-5, 1.3e-7, 5e-3)
    noise = [1.05, 0.95, 1.0, 1.05, 0.95, 1.05, 0.95]
    shapes = [(1, 32), (1, 128), (1, 512), (1, 1024), (4, 32), (4, 128), (4, 512)]
    grid = [(rows, length, truth.time(rows, length) * factor) for (rows, length), factor in zip(shapes, noise)]
    fitted = CostModel.fit(grid)
    assert all(abs(fitted.time(rows, length) / seconds - 1) < 0.15 for rows, length, seconds in grid)
    assert fitted.overhead == pytest.approx(truth.overhead, rel=0.3)
    with pytest.raises(ValueError, match="must be positive"):
        CostModel.fit([(1, 32, 0.0), *grid])


def test_options_refuse_what_the_pipeline_cannot_run():
    kwargs = {"tp_overlap": 1, "schedule": "1f1b", "multi_stage_schedules": ("interleaved_1f1b",)}
    assert MicroBatching.of("dynamic", None, None, pipeline_parallel=2, **kwargs).enabled
    with pytest.raises(ValueError, match="pad, pack, dynamic"):
        MicroBatching.of("sorted", None, None, pipeline_parallel=2, **kwargs)
    with pytest.raises(ValueError, match="pipeline_parallel>=2"):
        MicroBatching.of("pack", None, None, pipeline_parallel=1, **kwargs)
    with pytest.raises(ValueError, match="tp_overlap=1"):
        MicroBatching.of("pad", None, None, pipeline_parallel=2, **{**kwargs, "tp_overlap": 2})
    with pytest.raises(ValueError, match="three non-negative"):
        MicroBatching.of("dynamic", None, [1.0, 2.0], pipeline_parallel=2, **kwargs)


def _batch() -> VariableBatch:
    generator = torch.Generator().manual_seed(0)
    return VariableBatch.of([torch.randint(1, 50, (n,), generator=generator) for n in (5, 9, 3, 14)])


def test_micro_batch_tensors_shift_labels_and_restart_positions():
    batch = _batch()
    packed = micro_batch_tensors(batch, MicroBatch(((0, 1), (2,)), 16), packed=True)
    assert packed.input_ids[0, :14].tolist() == batch.sample(0).tolist() + batch.sample(1).tolist()
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1]
    assert packed.labels[0, :5].tolist() == batch.sample(0)[1:].tolist() + [-100]
    assert (packed.labels != -100).sum() == target_count(batch.lengths[:3])
    padded = micro_batch_tensors(batch, MicroBatch(((3,), (1,)), 16))
    assert padded.position_ids is None and padded.input_ids.shape == (2, 16)
    assert next(iter(batch)).shape == (4, 16)


@pytest.mark.parametrize("model_type, config", [
    ("llama", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "attn_implementation": "eager"}),
    ("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 4, "attn_implementation": "eager"}),
])
def test_packed_rows_score_each_document_as_if_alone(model_type, config):
    """Restarting positions keep packed documents apart (transformers builds the block-diagonal mask)."""
    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(name=model_type, model_type=model_type, config=config), vocab_size=64)
    model.config.use_cache = False  # with a cache, transformers does not look for packed documents
    model.eval()  # no dropout
    batch = _batch()
    alone = sum(summed_token_loss(model(t.input_ids).logits, t.labels) for t in (
        micro_batch_tensors(batch, MicroBatch(((i,),), 16)) for i in range(4)))
    together = micro_batch_tensors(batch, MicroBatch(((0, 1, 2), (3,)), 32), packed=True)
    packed = summed_token_loss(model(together.input_ids, position_ids=together.position_ids).logits, together.labels)
    assert packed.item() == pytest.approx(alone.item(), rel=1e-5)


def test_text_data_keeps_each_document_length(tmp_path):
    path = tmp_path / "mix.jsonl"
    documents = ["x" * n for n in (3, 40, 7, 90, 12, 25, 60, 5, 33, 18)] + [list(range(1, 30))]
    path.write_text("\n".join(json.dumps({"text": d}) for d in documents))
    data = LanguageModelingData(DataConfig(name="text", path=str(path), lengths="variable", batch_size=4,
                                           max_length=64, val_fraction=0.1))
    data.setup("fit")
    lengths = sorted(len(sample) for sample in data.train_set + data.val_set)
    assert lengths == sorted([n + 1 for n in (3, 40, 7, 12, 25, 60, 5, 33, 18)] + [64, 29])  # bytes + end of text
    batch = next(iter(data.train_dataloader()))
    assert isinstance(batch, VariableBatch) and batch.tokens.shape[0] == 4
    with pytest.raises(ValueError, match="data.lengths"):
        LanguageModelingData(DataConfig(name="text", path=str(path), lengths="sorted"))


def test_variable_batches_are_refused_where_nothing_plans_them():
    check_consumer(SimpleNamespace(micro_batching=MicroBatching("dynamic")))
    for strategy in (object(), SimpleNamespace(micro_batching=MicroBatching("none"))):
        with pytest.raises(ValueError, match="strategy.micro_batching=dynamic"):
            check_consumer(strategy)


def test_synthetic_data_has_a_variable_length_variant():
    data = LanguageModelingData(DataConfig(name="synthetic", lengths="variable", num_sequences=64, batch_size=8,
                                           max_length=256, val_fraction=0.1))
    data.setup("fit")
    lengths = [len(sample) for sample in data.train_set]
    assert min(lengths) >= 16 and max(lengths) <= 256 and len(set(lengths)) > 10
    assert len(data.train_dataloader()) == 8


def test_a_module_with_its_own_loss_is_refused_under_micro_batching() -> None:
    """Micro-batching computes the token loss itself: a module whose loss differs must not be trained on another."""
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.strategies.merak3d.variable_step import _check_token_loss

    class Smoothed(CausalLMModule):
        def loss_from_logits(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten(),
                                                     label_smoothing=0.1)

    _check_token_loss(CausalLMModule.__new__(CausalLMModule))
    with pytest.raises(ValueError, match="Smoothed.loss_from_logits is its own"):
        _check_token_loss(Smoothed.__new__(Smoothed))


def test_the_token_limit_is_per_context_parallel_rank():
    from lightning_merak.parallel.micro_batching.options import MicroBatching
    from lightning_merak.strategies.merak3d.variable_step import plan_step

    options = MicroBatching("dynamic", tokens=2048)
    alone = plan_step(options, LENGTHS, 2, 2, 4, COST)
    split = plan_step(options, LENGTHS, 2, 2, 4, COST, context_parallel=4)
    assert max(micro.padded_tokens for replica in alone.replicas for micro in replica) <= 2048
    assert max(micro.padded_tokens for replica in split.replicas for micro in replica) <= 4 * 2048
    assert sum(map(len, split.replicas)) < sum(map(len, alone.replicas))  # fewer, fuller micro-batches
