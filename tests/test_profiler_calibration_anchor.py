"""Calibration that reproduces its own traced layout (pure): the slowest replica, the traced backward level of a
pipeline, gradient buckets that overlap the backward, anchoring on the traced step, a pipeline probe's call line."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_merak.planning.replay.calibration import (
    Probe,
    ReplayPredictor,
    block_call_cost,
    calibrate_from_traces,
    rederivation_anchor,
)
from lightning_merak.planning.replay.engine import measured_step_time
from lightning_merak.planning.replay.synthesize import LayoutSpec, StepCosts, calibrate, predict_layout
from lightning_merak.planning.replay.trace import Span, Trace
from tests.test_profiler_calibration import DP2, PP2, SHAPE, TP2, _dp2_trace, _pp2_trace


def _stretched(trace: Trace, rank: int, names: tuple[str, ...], factor: float, from_zero: bool = False) -> Trace:
    """``trace`` with ``rank``'s spans named in ``names`` (prefix match) lasting ``factor`` times longer (with
    ``from_zero``, their start times scaled too, so that spans in a row stay in a row)."""
    ranks = []
    for each in trace.ranks:
        if each.rank == rank:
            spans = [dataclasses.replace(s, start=s.start * (factor if from_zero else 1.0),
                                         end=s.start * (factor if from_zero else 1.0) + (s.end - s.start) * factor)
                     if s.name.startswith(names) else s for s in each.spans]
            each = dataclasses.replace(each, spans=spans)
        ranks.append(each)
    return dataclasses.replace(trace, ranks=ranks)


def test_a_step_is_priced_at_its_slowest_replica_not_their_mean() -> None:
    # rank 1's forward and blocks take 1.5x as long (its core shared): the step waits for it
    slow = _stretched(_dp2_trace(), 1, ("block ", "training_step"), 1.5, from_zero=True)
    costs = calibrate(slow, SHAPE, DP2)
    assert costs.block_forward_per_sample == pytest.approx(0.030 / (2 * 4))
    assert calibrate(_dp2_trace(), SHAPE, DP2).block_forward_per_sample == pytest.approx(0.020 / (2 * 4))


def test_a_pipeline_trace_prices_blocks_backward_at_its_first_stages_measured_ratio() -> None:
    # stage 0's backward chunks shortened to 4.5 ms: its chunks (block and own work, 3 ms) run backward at 1.5x
    trace = _stretched(_pp2_trace(), 0, ("stage 0 backward",), 0.75)
    costs = calibrate(trace, SHAPE, PP2)
    assert costs.backward_ratio == pytest.approx(1.5)
    # stage 1: 16 ms of backward chunks, its blocks and own work (2 x 3 ms) at 1.5x, the head's 4 ms takes the rest
    assert costs.rest_backward_ratio == pytest.approx((0.016 - 1.5 * 0.006) / 0.004)


def test_gradient_buckets_leave_as_the_last_backward_finishes_them() -> None:
    costs = StepCosts(block_forward_per_sample=0.001, rest_forward_per_sample=0.0, backward_ratio=2.0,
                      update_per_param=0.0, host_per_step=0.0, op_fixed_s=0.0, link_bytes_per_s=400_000.0)
    # 100 000 parameters a block: 400 kB, one second each on the wire at dp=2; the embedding and head's 25 000 each
    step = predict_layout(costs, SHAPE, DP2).step_time
    # forward 2 x 4 ms, backward 2 x 8 ms; the head's bucket (0.25 s) leaves at once, the first block's after 8 ms
    # queues behind it, the second's behind that, then the embedding's: 2.5 s of transfers from 8 ms
    assert step == pytest.approx(0.008 + 2.5)
    pipelined = predict_layout(costs, SHAPE, LayoutSpec(2, 2, 1, 2, 4)).step_time
    assert pipelined < step  # each stage reduces only its own parameters


def test_every_cost_set_predicts_its_own_traced_step() -> None:
    trace = _stretched(_dp2_trace(), 0, ("optimizer_step",), 2.0)  # a step the costs do not re-derive
    calibration = calibrate_from_traces(trace, SHAPE, DP2, correction=0.9)
    anchor = rederivation_anchor(calibration.base, trace, SHAPE, DP2)
    assert anchor != pytest.approx(1.0)
    predictor = ReplayPredictor(calibration)
    assert predictor.step_time(DP2) == pytest.approx(0.9 * measured_step_time(trace))
    # other layouts move by the re-derived change from the traced one
    assert predictor.step_time(TP2) == pytest.approx(0.9 * anchor * predict_layout(calibration.base, SHAPE, TP2)
                                                     .step_time)


def test_a_pipeline_probe_takes_a_block_calls_fixed_time_from_both_traces() -> None:
    # the main trace's block calls: 3 ms at 4 samples; the probe's: 2 ms at 2 samples (a micro-batch of PP2)
    main = _dp2_trace()
    main = dataclasses.replace(main, ranks=[dataclasses.replace(r, spans=[
        Span(s.name, s.category, s.start, s.start + 0.003, s.step, s.depth) if s.name.startswith("block ") else s
        for s in r.spans]) for r in main.ranks])
    probe = _pp2_trace()
    fixed = block_call_cost(main, DP2, probe, PP2)
    assert fixed == pytest.approx(0.001)
    costs, _ = calibrate_from_traces(main, SHAPE, DP2, [Probe(probe, SHAPE, PP2)]).costs_for(PP2)
    assert costs.block_call_s == pytest.approx(fixed)
    assert costs.block_call_s + 2 * costs.block_forward_per_sample == pytest.approx(0.002)  # the traced call kept
    one_sample = LayoutSpec(1, 2, 1, 4, 4)
    linear = calibrate(probe, SHAPE, PP2)
    assert predict_layout(costs, SHAPE, one_sample).step_time > predict_layout(linear, SHAPE, one_sample).step_time
