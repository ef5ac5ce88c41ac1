"""Layout profiler on real gloo ranks: real tensor-parallel blocks, gradient sync and optimizer are measured."""

from __future__ import annotations

import pytest
import torch

from lightning_merak.testing import run_distributed

VOCAB, SEQ = 96, 16


def _llama_and_tokens() -> tuple[torch.nn.Module, torch.Tensor]:
    """A two-block Llama and a batch of 4 sequences, the same on every rank."""
    from lightning_merak.modules.causal_lm import build_causal_lm
    from lightning_merak.modules.config import ModelConfig

    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(name="llama", model_type="llama", config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}), vocab_size=VOCAB)
    model.config.use_cache = False
    return model, torch.randint(VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))


def _profile_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from lightning_merak.planning.measure.layout import profile_model, profile_network
    from lightning_merak.planning.planner import SearchSpace, required_profile_keys
    from lightning_merak.strategies.merak3d import average_gradients
    from lightning_merak.strategies.merak3d.block_splits import tensor_parallel_plan
    from lightning_merak.strategies.merak3d.build import call_model

    model, inputs = _llama_and_tokens()
    space = SearchSpace(world_size=world_size, global_batch_size=None, replica_batch_size=4,
                        tp_degrees_allowed=(1, 2), max_pipeline_stages=1, overlap_choices=(1, 2))
    keys = required_profile_keys(space, 2)
    loss_batches = []

    def loss_of(logits: torch.Tensor, samples: int) -> torch.Tensor:
        loss_batches.append(logits.shape[0])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), inputs[:samples].flatten())

    profile = profile_model(model, inputs, call_model, tensor_parallel_plan, keys,
                            lambda params: torch.optim.AdamW(params), repeats=3,
                            process_group_device=torch.device("cpu"), loss_of=loss_of)
    gradient_bytes = 4 << 20
    network = profile_network(keys.all_reduce_group_sizes, torch.device("cpu"), large_bytes=1 << 16,
                              repeats=3, gradient_bytes=gradient_bytes, pipeline=True)
    grads = list(torch.full((gradient_bytes // 4,), float(rank + 1)).chunk(8))
    average_gradients(grads, dist.new_group(list(range(world_size))), world_size)
    return {"keys": keys.measured_blocks, "profile": profile, "network": network, "loss_batches": set(loss_batches),
            "grads_averaged": sorted({value for grad in grads for value in grad.unique().tolist()})}


@pytest.mark.distributed
def test_profiler_measures_real_blocks_gradient_sync_and_optimizer_on_two_ranks():
    results = run_distributed(_profile_rank, 2, timeout_s=300)
    profile, network = results[0]["profile"], results[0]["network"]
    assert set(profile.measured_blocks) == set(results[0]["keys"]) == {(2, 1, 4), (2, 2, 4)}
    for blocks in profile.measured_blocks.values():
        assert blocks.forward_first_s > 0 and blocks.backward_first_s > 0
    assert set(profile.block_optimizer_s) == {1, 2} and min(profile.block_optimizer_s.values()) > 0
    assert set(profile.block_clip_s) == {1, 2} and min(profile.block_clip_s.values()) > 0
    assert profile.clip_s_per_parameter_byte > 0
    assert min(profile.prefix_update_s) > 0 and min(profile.suffix_update_s) > 0
    # norms, residuals and column inputs are saved outside the split layers; attention inside them
    for tp in (1, 2):
        assert 0 < profile.block_sequence_split_bytes_per_sample[tp] < profile.block_activation_bytes_per_sample[tp]
    # the loss is timed on whole micro-batches (4 samples here), never on sub-batches
    assert set(profile.loss_times) == results[0]["loss_batches"] == {4}
    assert min(profile.loss_times[4]) > 0
    assert set(network.gradient_sync) == {2}
    # timings belong to benchmarks/planner.py; here: a usable fit, and the averaging it times is right
    assert 0 < network.gradient_sync_s(1 << 20, 2) <= network.gradient_sync_s(4 << 20, 2) < float("inf")
    assert all(r["grads_averaged"] == [1.5] for r in results)
    # two stages that compute nothing still cost the pipeline runtime something; how it splits between
    # chunks and steps is a fit on noisy timings (a figure, see test_planner_core for the fit itself)
    assert 0 <= network.pipeline_action_s < float("inf") and 0 <= network.pipeline_step_s < float("inf")
    assert network.pipeline_action_s + network.pipeline_step_s > 0
    assert results[1]["network"] == network


def _real_block_collectives_rank(rank: int, world_size: int, sequence_parallel: bool) -> dict:
    from lightning_merak.distributed.collectives import record_communication
    from lightning_merak.planning.measure.layout import profile_model
    from lightning_merak.planning.planner import SearchSpace, required_profile_keys
    from lightning_merak.strategies.merak3d.block_splits import sequence_parallel_plan, tensor_parallel_plan
    from lightning_merak.strategies.merak3d.build import call_model

    model, inputs = _llama_and_tokens()
    space = SearchSpace(world_size=world_size, global_batch_size=None, replica_batch_size=4,
                        tp_degrees_allowed=(2,), max_pipeline_stages=1, overlap_choices=(2,))
    with record_communication() as trace:
        profile = profile_model(
            model, inputs, call_model, tensor_parallel_plan, required_profile_keys(space, 2),
            lambda params: torch.optim.AdamW(params), repeats=1, process_group_device=torch.device("cpu"),
            sequence_plan_of=sequence_parallel_plan if sequence_parallel else None)
    return {"ops": sorted({event["op"] for event in trace.events}), "measured": set(profile.measured_blocks)}


@pytest.mark.distributed
def test_profiler_times_sequence_parallel_blocks_with_their_own_collectives():
    plain = run_distributed(_real_block_collectives_rank, 2, args=(False,), timeout_s=300)[0]
    sequence = run_distributed(_real_block_collectives_rank, 2, args=(True,), timeout_s=300)[0]
    assert plain["measured"] == sequence["measured"] == {(2, 2, 4)}
    assert plain["ops"] == ["all_reduce"]
    assert sequence["ops"] == ["all_gather", "reduce_scatter"]


def test_large_parameters_are_timed_on_a_part_and_scaled(monkeypatch):
    """A large embedding's update is timed on a bounded copy: setup never copies the whole table.

    The update's timing is replaced by fixed figures, so the scaling is checked exactly.
    """
    from lightning_merak.parallel.pipeline.trace import trace_model
    from lightning_merak.planning.measure import layout as layout_profiler
    from lightning_merak.strategies.merak3d.build import call_model

    model, inputs = _llama_and_tokens()
    trace = trace_model(model, inputs, call_model)
    prefix, suffix = trace.outside_parameters(model)
    largest = 1000
    timed: list[list[int]] = []

    def fixed_update_times(parameters, optimizer_factory, repeats):
        timed.append([p.numel() for p in parameters])
        return 1.0, 2.0

    monkeypatch.setattr(layout_profiler, "time_parameter_update", fixed_update_times)
    before = [p.detach().clone() for p in model.parameters()]
    prefix_s, suffix_s = layout_profiler.time_outside_update(model, trace, torch.optim.AdamW, repeats=1,
                                                             largest=largest)
    for group, times, sizes in zip((prefix, suffix), (prefix_s, suffix_s), timed):
        total = sum(p.numel() for p in group)
        assert max(sizes) <= largest < total
        assert times == (total / sum(sizes), 2.0 * total / sum(sizes))
    for original, param in zip(before, model.parameters()):
        assert torch.equal(original, param)


def test_timing_copies_keep_small_parameters_whole():
    from lightning_merak.planning.measure.layout import timing_copies

    small, large = torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(30, 100))
    frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)
    copies, scale = timing_copies([small, large, frozen], largest=1000)
    assert [c.numel() for c in copies] == [10, 1000]
    assert scale == 3010 / 1010
    assert torch.equal(copies[0], small) and copies[0] is not small
    assert torch.equal(copies[1], large.reshape(-1)[:1000])


def test_parameter_update_is_timed_on_trainable_parameters_only():
    from lightning_merak.planning.measure.layout import time_parameter_update

    frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)
    assert time_parameter_update([frozen], torch.optim.SGD, repeats=1) == (0.0, 0.0)
    trainable = torch.nn.Parameter(torch.zeros(8))
    optimizer_s, clip_s = time_parameter_update([trainable, frozen], lambda params: torch.optim.SGD(params, lr=1.0),
                                                repeats=2)
    assert optimizer_s > 0 and clip_s > 0
    assert bool((trainable < 0).all())  # stepped along its (clipped) gradient of ones


@pytest.mark.distributed  # inductor starts its C++ compiler
def test_compiled_blocks_are_timed_compiled_in_one_process(monkeypatch):
    """Compiled blocks: each local shard's segments scaled by its measured compiled-over-eager time."""
    from lightning_merak.parallel.fast_blocks import FastBlocks
    from lightning_merak.parallel.regional_compile import compile_counts
    from lightning_merak.planning.measure import layout
    from lightning_merak.planning.planner import SearchSpace, required_profile_keys
    from lightning_merak.strategies.merak3d.block_splits import tensor_parallel_plan
    from lightning_merak.strategies.merak3d.build import call_model

    model, inputs = _llama_and_tokens()
    space = SearchSpace(world_size=2, global_batch_size=None, replica_batch_size=4, tp_degrees_allowed=(1, 2),
                        max_pipeline_stages=1, overlap_choices=(1,))
    ratios = []
    measure = layout._compiled_over_eager

    def recorded(*args, **kwargs):
        ratios.append(measure(*args, **kwargs))
        return ratios[-1]

    monkeypatch.setattr(layout, "_compiled_over_eager", recorded)
    torch.compiler.reset()  # graphs an earlier test compiled would be reused
    before = compile_counts()
    profile = layout.profile_model(model, inputs, call_model, tensor_parallel_plan, required_profile_keys(space, 2),
                                   lambda params: torch.optim.AdamW(params), repeats=2,
                                   fast_blocks=FastBlocks(compile=True))
    assert compile_counts().graphs > before.graphs
    assert len(ratios) == len(profile.block_times) and all(f > 0 and b > 0 for f, b in ratios)
    assert all(sum(times.forward_segments_s) > 0 for times in profile.block_times.values())
