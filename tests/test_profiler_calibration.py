"""Calibrating the planner from traces (pure): group kinds, links per kind, probes, the replay predictor, re-ranking."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from lightning_merak.callbacks.profiler.lightning_profiler import run_meta
from lightning_merak.planning.planner import Layout, Plan, Prediction, rerank
from lightning_merak.planning.replay.calibration import (
    Probe,
    ReplayPredictor,
    TraceCalibration,
    block_call_cost,
    calibrate_from_traces,
    layout_from_meta,
    link_costs,
    probe_key,
    traced_blocks,
)
from lightning_merak.planning.replay.refine import with_block_call_cost
from lightning_merak.planning.replay.synthesize import (
    BLOCK_BACKWARD_RATIO,
    LayoutSpec,
    ModelShape,
    StepCosts,
    calibrate,
    group_kind,
    layout_graph,
    predict_layout,
)
from lightning_merak.planning.replay.trace import CommRecord, RankTrace, Span, Trace

SHAPE = ModelShape(blocks=2, block_params=100_000, other_params=50_000, hidden=8, seq=4)
"""250 000 parameters: a 1 MB fp32 gradient all-reduce at dp=2."""
DP2 = LayoutSpec(dp=2, pp=1, tp=1, micro_batches=1, samples=4)
TP2 = LayoutSpec(dp=1, pp=1, tp=2, micro_batches=1, samples=4)
PP2 = LayoutSpec(dp=1, pp=2, tp=1, micro_batches=2, samples=4)


def _dp2_trace() -> Trace:
    """Both ranks: FW 0-30 ms (blocks 5-15, 15-25), BW 30-80 ms with the gradient all-reduce (1 MB, launched at 60,
    waited 75-80), UPDATE 80-95, a blocking 1 KiB all-reduce 96-97, step 0-100 ms."""
    ranks = []
    for rank in range(2):
        spans = [Span("step 0", "step", 0.0, 0.100, 0), Span("training_step", "FW", 0.0, 0.030, 0, 1),
                 Span("block 0", "FW", 0.005, 0.015, 0, 2), Span("block 1", "FW", 0.015, 0.025, 0, 2),
                 Span("backward", "BW", 0.030, 0.080, 0, 1), Span("optimizer_step", "UPDATE", 0.080, 0.095, 0, 1)]
        comms = [CommRecord("all_reduce", "collective", (0, 1), 0, 1_000_000, 0.060, 0, complete=0.080,
                            wait_start=0.075, wait_end=0.080),
                 CommRecord("all_reduce", "collective", (0, 1), 1, 1024, 0.096, 0, complete=0.097, wait_end=0.097,
                            blocking=True)]
        ranks.append(RankTrace(rank, spans, comms))
    return Trace(ranks, [0.0, 0.0])


def _tp2_probe() -> Trace:
    """Both ranks: FW 0-30 ms whose blocks each wait 2 ms for a 64 KiB tensor-parallel all-reduce, BW 30-80,
    UPDATE 80-90, step 0-100 ms."""
    ranks = []
    for rank in range(2):
        spans = [Span("step 0", "step", 0.0, 0.100, 0), Span("training_step", "FW", 0.0, 0.030, 0, 1),
                 Span("block 0", "FW", 0.005, 0.015, 0, 2), Span("block 1", "FW", 0.015, 0.025, 0, 2),
                 Span("backward", "BW", 0.030, 0.080, 0, 1), Span("optimizer_step", "UPDATE", 0.080, 0.090, 0, 1)]
        comms = [CommRecord("all_reduce", "collective", (0, 1), seq, 65536, start, 0, complete=start + 0.002,
                            wait_end=start + 0.002, blocking=True) for seq, start in enumerate((0.010, 0.020))]
        ranks.append(RankTrace(rank, spans, comms))
    return Trace(ranks, [0.0, 0.0], {"layout": {"dp": 1, "pp": 1, "tp": 2, "micro_batches": 1, "overlap": 1}})


def test_group_kind_names_the_dimension_a_group_spans() -> None:
    layout = LayoutSpec(dp=2, pp=2, tp=2, micro_batches=2, samples=4)
    assert group_kind(("collective", (0, 4), 0), layout) == "dp"
    assert group_kind(("collective", (0, 2), 0), layout) == "pp"
    assert group_kind(("collective", (0, 1), 0), layout) == "tp"
    assert group_kind(("collective", (0, 1, 2, 3), 0), layout) == "world"
    assert group_kind(("p2p", 0, 2, 0, 0), layout) == "pp"


def test_link_costs_take_the_fixed_time_from_small_ops_and_the_rate_from_large_ones() -> None:
    links = link_costs(_dp2_trace(), DP2)
    fixed, rate = links["dp"]
    assert fixed == pytest.approx(0.001)
    assert rate == pytest.approx(1_000_000 / 0.019)  # 20 ms transfer, 1 ms of it fixed


def test_calibration_reads_the_planner_constants() -> None:
    calibration = calibrate_from_traces(_dp2_trace(), SHAPE, DP2)
    base = calibration.base
    assert base.block_forward_per_sample == pytest.approx(0.020 / (2 * 4))
    assert base.rest_forward_per_sample == pytest.approx(0.010 / 4)
    # its 5 ms wait removed; a block's backward priced at twice its forward, the head's takes the rest
    assert base.backward_ratio == BLOCK_BACKWARD_RATIO
    assert base.rest_backward_ratio == pytest.approx((0.045 - 2 * 0.020) / 0.010)
    assert base.update_per_param == pytest.approx(0.015 / 250_000)
    assert base.host_per_step == pytest.approx(0.100 - 0.006 - 0.030 - 0.045 - 0.015)
    assert base.link("dp") == pytest.approx((0.001, 1_000_000 / 0.019))
    assert base.link("pp") == (base.op_fixed_s, base.link_bytes_per_s)  # not traced: the whole trace's link


def test_a_tensor_parallel_probe_keeps_its_collectives_in_the_compute_and_replays_its_own_step() -> None:
    calibration = calibrate_from_traces(_dp2_trace(), SHAPE, DP2, [Probe(_tp2_probe(), SHAPE, TP2)])
    probe, correction = calibration.costs_for(TP2)
    assert correction == pytest.approx(1.0)  # the probe's costs re-derive its traced step
    assert probe.tp_comm_in_compute
    assert probe.block_forward_per_sample == pytest.approx(0.020 * 2 / (2 * 4))  # waits kept, times tp
    assert {kind for kind, _, _ in probe.links} == {"dp", "tp"}  # the main trace's dp link carried over
    assert calibration.costs_for(LayoutSpec(1, 1, 2, 1, 4, overlap=2))[0] is calibration.base
    predictor = ReplayPredictor(calibration)
    assert predictor.step_time(TP2) == pytest.approx(0.100)
    deeper = ModelShape(4, SHAPE.block_params, SHAPE.other_params, SHAPE.hidden, SHAPE.seq)
    more_blocks = ReplayPredictor(calibrate_from_traces(_dp2_trace(), deeper, DP2, [Probe(_tp2_probe(), SHAPE, TP2)]))
    # two more blocks: their forward (10 ms each at tp=2), backward (twice that) and optimizer work
    assert more_blocks.step_time(TP2) == pytest.approx(0.100 + 2 * 0.010 * 3 + 2 * 100_000 / 2 * probe.update_per_param)
    with pytest.raises(ValueError, match="same"):
        calibrate_from_traces(_dp2_trace(), SHAPE, DP2, [Probe(_tp2_probe(), SHAPE, TP2)] * 2)


def _prediction(layout: Layout, seconds: float) -> Prediction:
    return Prediction(layout, seconds, 8, 1.0, {"compute": seconds}, True)


def test_rerank_orders_the_plan_by_another_predictor_and_keeps_the_analytic_time() -> None:
    dp, tp = Layout(2, 1, 1, 1, 1, 0.0), Layout(1, 1, 2, 1, 1, 0.0)
    analytic = Plan(ranked=(_prediction(dp, 0.1), _prediction(tp, 0.2)), rejected=())
    replayed = rerank(analytic, lambda layout: 0.3 if layout.dp == 2 else 0.15)
    assert [p.layout for p in replayed.ranked] == [tp, dp]
    assert replayed.best.step_time_s == 0.15 and replayed.best.components["analytic_step_s"] == 0.2
    with pytest.raises(ValueError, match="positive"):
        rerank(analytic, lambda layout: 0.0)
    calibration = calibrate_from_traces(_dp2_trace(), SHAPE, DP2)
    predictor = ReplayPredictor(calibration)
    assert predictor.planner_step_time(dp, 4) == pytest.approx(predictor.step_time(DP2))


def test_meta_gives_the_traced_layout_or_names_the_fix() -> None:
    assert layout_from_meta(_tp2_probe().meta, samples=4) == TP2
    with pytest.raises(ValueError, match="MerakTraceProfiler"):
        layout_from_meta({})
    with pytest.raises(ValueError, match="context_parallel=2, which the replay calibration does not model"):
        layout_from_meta({"layout": {"dp": 1, "pp": 1, "tp": 1, "cp": 2}})
    assert traced_blocks(_tp2_probe()) == 2
    assert _tp2_probe().ranks[1].block_names() == {"block 0", "block 1"}


def test_run_meta_records_a_merak3d_layout_and_the_model() -> None:
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
    model = torch.nn.Module()
    model.layers, model.head = blocks, torch.nn.Linear(4, 3, bias=False)
    strategy = SimpleNamespace(data_parallel=1, pipeline_parallel=1, tensor_parallel=2, micro_batches=None,
                               tp_overlap=2, layout=SimpleNamespace(context_parallel=2))
    module = SimpleNamespace(trainer=SimpleNamespace(strategy=strategy, world_size=4), model=model)
    meta = run_meta(module)
    assert meta["layout"] == {"dp": 1, "pp": 1, "tp": 2, "micro_batches": 1, "overlap": 2, "cp": 2}
    assert meta["model"] == {"blocks": 2, "block_params": 20, "other_params": 12, "hidden": 0}
    assert run_meta(None) == {}


def test_a_layout_takes_the_probe_of_its_kind_then_the_nearest() -> None:
    base = calibrate_from_traces(_dp2_trace(), SHAPE, DP2).base
    tp, pp, both = (dataclasses.replace(base, host_per_step=seconds) for seconds in (1.0, 2.0, 3.0))
    calibration = TraceCalibration(base, SHAPE, DP2, (((False, 2, 1), tp, 1.1), ((True, 1, 1), pp, 1.2),
                                                      ((True, 2, 1), both, 1.3)), correction=0.9)
    assert calibration.costs_for(LayoutSpec(1, 1, 2, 1, 4)) == (tp, 1.1)
    assert calibration.costs_for(LayoutSpec(1, 2, 1, 4, 4)) == (pp, 1.2)
    assert calibration.costs_for(LayoutSpec(1, 2, 2, 4, 4)) == (both, 1.3)
    assert calibration.costs_for(LayoutSpec(1, 4, 2, 4, 4, overlap=2)) == (pp, 1.2)
    assert calibration.costs_for(LayoutSpec(2, 1, 1, 1, 4)) == (base, 0.9)
    assert probe_key(LayoutSpec(1, 2, 2, 4, 4, overlap=2)) == (True, 2, 2)


def test_a_pipeline_keeps_the_traced_partition_where_the_stage_count_matches() -> None:
    costs = dataclasses.replace(calibrate_from_traces(_dp2_trace(), SHAPE, DP2).base, stage_blocks=(2, 0))
    assert layout_graph(costs, SHAPE, LayoutSpec(1, 2, 1, 2, 4))[1]["stage_blocks"] == [2, 0]
    deeper = ModelShape(4, SHAPE.block_params, SHAPE.other_params, SHAPE.hidden, SHAPE.seq)
    assert layout_graph(costs, deeper, LayoutSpec(1, 2, 1, 2, 4))[1]["stage_blocks"] == [2, 2]  # another model


def _pp2_trace(gaps_after_backward: Optional[tuple[float, float]] = None) -> Trace:
    """Two micro-batches of 2 samples on 2 stages of one block each (2 ms a forward call). Stage 0: each forward
    chunk 1 ms beyond its block (the stage's own work), 6 ms backward chunks, 0.5 ms of the loop between chunks;
    stage 1: 3 ms of head after its block (1 ms of it the stage's own work), 8 ms backward chunks, 1.5 ms gaps.
    A blocking 1 MB all-reduce (35-42 ms) gives the link's rate; UPDATE 42-47 ms, steps of 50 ms.
    ``gaps_after_backward`` (ms per stage): other gaps after a backward chunk."""
    ms = 0.001
    ranks = []
    for rank, (forward, backward, gap) in enumerate(((3, 6, 0.5), (5, 8, 1.5))):
        spans, at = [], 1.0
        for kind, m in (("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1)):
            length = forward if kind == "forward" else backward
            gap = gaps_after_backward[rank] if gaps_after_backward and kind == "backward" else gap
            spans.append(Span(f"stage {rank} {kind} mb{m}", "FW" if kind == "forward" else "BW", at * ms,
                              (at + length) * ms, 0, 2))
            if kind == "forward":
                start = at + 1.0 if rank == 0 else at
                spans.append(Span(f"block {rank}", "FW", start * ms, (start + 2) * ms, 0, 3))
            at += length + gap
        spans += [Span("step 0", "step", 0.0, 0.050, 0), Span("training_step", "FW", 0.0, (at - gap) * ms, 0, 1),
                  Span("optimizer_step", "UPDATE", 0.042, 0.047, 0, 1)]
        comms = [CommRecord("all_reduce", "collective", (0, 1), 0, 1_000_000, 0.035, 0, complete=0.042,
                            wait_end=0.042, blocking=True)]
        ranks.append(RankTrace(rank, spans, comms))
    return Trace(ranks, [0.0, 0.0], {"layout": {"dp": 1, "pp": 2, "tp": 1, "micro_batches": 2, "overlap": 1}})


def test_a_pipeline_trace_gives_the_fixed_costs_per_chunk_and_per_gap() -> None:
    costs = calibrate(_pp2_trace(), SHAPE, PP2)
    assert costs.chunk_forward_s == pytest.approx(0.001)
    assert costs.chunk_host_s == pytest.approx((0.0005, 0.0015))
    assert costs.block_forward_per_sample == pytest.approx(0.001)  # 2 ms calls of 2 samples
    assert costs.rest_forward_per_sample == pytest.approx(0.001)  # 3 ms of head less the stage's own 1 ms, 2 samples
    assert costs.stage_blocks == (1, 1)
    assert costs.chunk_backward_s == pytest.approx((0.006, 0.008))  # each stage's backward chunk
    # the gaps leave the loop's time per step: each rank's step less its work, wait and gaps (18.5 and 7.5 ms)
    assert costs.host_per_step == pytest.approx((0.0185 + 0.0075) / 2)


def test_the_gaps_after_forward_and_after_backward_chunks_are_told_apart() -> None:
    costs = calibrate(_pp2_trace(gaps_after_backward=(0.1, 0.3)), SHAPE, PP2)
    assert costs.chunk_host_s == pytest.approx((0.0005, 0.0015))
    assert costs.chunk_host_after_backward_s == pytest.approx((0.0001, 0.0003))
    # each rank's loop time less its gaps: the gaps after backward chunks no longer count as forward ones
    assert costs.host_per_step == pytest.approx((0.0189 + 0.0087) / 2)
    # stage 1 runs F0 B0 F1 B1 at M=2 (1F1B): 2 gaps after a forward, 1 after a backward
    only_gaps = dataclasses.replace(costs, block_forward_per_sample=0.0, rest_forward_per_sample=0.0,
                                    chunk_forward_s=0.0, host_per_step=0.0, update_per_param=0.0)
    assert only_gaps.gap_seconds(1, 2, False, 2.0) == pytest.approx(0.0003)
    assert only_gaps.gap_seconds(0, 3, True, 2.0) == pytest.approx(0.001)  # other stage counts: the mean


def _block_calls(seconds: float) -> Trace:
    return Trace([RankTrace(0, [Span("block 0", "FW", 0.0, seconds, 0, 2), Span("block 1", "FW", seconds, 2 * seconds,
                                                                                  0, 2)], [])], [0.0])


def test_two_traces_at_different_samples_per_call_separate_a_blocks_fixed_cost() -> None:
    # 0.5 ms fixed + 0.25 ms a sample: 8 samples a call (data parallel) 2.5 ms, 4 (two micro-batches) 1.5 ms
    dp, pp = LayoutSpec(2, 1, 1, 1, 8), LayoutSpec(1, 2, 1, 2, 8)
    fixed = block_call_cost(_block_calls(0.0025), dp, _block_calls(0.0015), pp)
    assert fixed == pytest.approx(0.0005)
    assert block_call_cost(_block_calls(0.0025), dp, _block_calls(0.0010), pp) == 0.0  # tilted by noise: none
    costs = StepCosts(block_forward_per_sample=0.0015 / 4, rest_forward_per_sample=0.0, backward_ratio=2.0,
                      update_per_param=0.0, host_per_step=0.0, op_fixed_s=0.0, link_bytes_per_s=1e15)
    split = with_block_call_cost(costs, pp, fixed)
    assert split.block_call_s + 4 * split.block_forward_per_sample == pytest.approx(0.0015)  # the traced call kept
    shape = ModelShape(2, 1000, 0, 8, 4)
    one_sample = LayoutSpec(1, 2, 1, 8, 8)
    # M=8: 8 calls of 0.75 ms per stage instead of 0.375 ms, over 9 slots of forward and backward
    assert predict_layout(split, shape, one_sample).step_time == pytest.approx(9 * 3 * 0.00075)
    assert predict_layout(costs, shape, one_sample).step_time == pytest.approx(9 * 3 * 0.000375)
    with pytest.raises(ValueError, match="different micro-batch sizes"):
        block_call_cost(_block_calls(0.0025), dp, _block_calls(0.0015), LayoutSpec(1, 1, 1, 1, 8))
