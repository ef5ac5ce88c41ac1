"""Each block's backward timed by the recorder, and the calibration pricing blocks at their timed ratio."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_merak.callbacks.profiler.recorder import TraceRecorder
from lightning_merak.distributed.sub_batches import SubBatchForward
from lightning_merak.distributed.turns import yield_turn
from lightning_merak.planning.replay.calibration import Probe, ReplayPredictor, calibrate_from_traces
from lightning_merak.planning.replay.call_curve import CallCurve
from lightning_merak.planning.replay.refine import with_probed_backward
from lightning_merak.planning.replay.synthesize import (
    BLOCK_BACKWARD_RATIO,
    ModelShape,
    _rank_breakdown,
    calibrate,
    predict_layout,
)
from lightning_merak.planning.replay.trace import RankTrace, Span, Trace
from tests.test_profiler_calibration import DP2, PP2, SHAPE, TP2, _dp2_trace, _tp2_probe

SLOW_BACKWARD_S = 0.2


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a block with a known extra backward time."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLOW_BACKWARD_S)
        return grad


class _Block(nn.Module):
    def __init__(self, width: int, slow: bool) -> None:
        super().__init__()
        self.linear, self.slow = nn.Linear(width, width), slow

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        y = torch.relu(self.linear(x)) + x
        return (_SlowBackward.apply(y) if self.slow else y), None


class _Net(nn.Module):
    def __init__(self, width: int = 16, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, width)
        self.blocks = nn.ModuleList(_Block(width, slow=index == 1) for index in range(3))
        self.checkpointed = checkpointed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = (checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x))[0]
        return x.sum()


def _record(net: _Net, grad: bool = True) -> list[Span]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (4, 8))
    recorder = TraceRecorder(0)
    recorder.install()
    try:
        step = recorder.begin_step(0)
        with torch.set_grad_enabled(grad):
            loss = net(tokens)
        if grad:
            with recorder.span("backward", "BW"):
                loss.backward()
        recorder.close_span(step)
    finally:
        trace = recorder.finish()
    return trace.spans


def _block_backwards(spans: list[Span]) -> list[Span]:
    return sorted((s for s in spans if s.category == "BW" and s.name.startswith("block ")), key=lambda s: s.start)


def test_each_blocks_backward_is_a_span_inside_the_backward() -> None:
    spans = _record(_Net())
    blocks = _block_backwards(spans)
    assert [s.name for s in blocks] == ["block 2", "block 1", "block 0"]
    backward = next(s for s in spans if s.name == "backward")
    assert all(backward.start <= s.start and s.end <= backward.end for s in blocks)
    assert all(before.end <= after.start for before, after in zip(blocks, blocks[1:]))
    assert all(s.depth == backward.depth + 1 for s in blocks)
    durations = {s.name: s.end - s.start for s in blocks}
    assert durations["block 1"] >= SLOW_BACKWARD_S
    assert durations["block 0"] < SLOW_BACKWARD_S and durations["block 2"] < SLOW_BACKWARD_S


def test_a_block_whose_input_needs_no_gradient_is_not_timed() -> None:
    net = _Net()
    net.embed.requires_grad_(False)
    assert [s.name for s in _block_backwards(_record(net))] == ["block 2", "block 1"]
    assert _block_backwards(_record(_Net(), grad=False)) == []


def test_a_recomputed_forward_falls_inside_the_backward_it_serves() -> None:
    spans = _record(_Net(checkpointed=True))
    backward = {s.name: s for s in _block_backwards(spans)}
    assert sorted(backward) == ["block 0", "block 1", "block 2"]
    for name, span in backward.items():
        forwards = [s for s in spans if s.category == "FW" and s.name == name]
        assert len(forwards) == 2  # the forward and its recomputation
        assert sum(span.start <= s.start and s.end <= span.end for s in forwards) == 1


def _with_block_backwards(trace: Trace, seconds: float, recompute: float = 0.0) -> Trace:
    """``trace`` with each block's backward timed: block 1 from 30 ms, block 0 after it, each ``seconds`` long (a
    ``recompute`` forward of the block at the start of each)."""
    ranks = []
    for rank in trace.ranks:
        spans = list(rank.spans)
        for position, name in enumerate(("block 1", "block 0")):
            start = 0.030 + position * seconds
            spans.append(Span(name, "BW", start, start + seconds, 0, 2))
            if recompute:
                spans.append(Span(name, "FW", start, start + recompute, 0, 3))
        ranks.append(RankTrace(rank.rank, spans, rank.comms))
    return Trace(ranks, trace.offsets, trace.meta)


def test_a_probe_prices_added_blocks_at_their_timed_backward() -> None:
    # block forwards of 10 ms (their 2 ms of tensor-parallel waits kept), backwards of 13 ms
    probe = _with_block_backwards(_tp2_probe(), 0.013)
    assert calibrate(probe, SHAPE, TP2, tp_comm_in_compute=True).backward_ratio == pytest.approx(1.3)
    deeper = ModelShape(4, SHAPE.block_params, SHAPE.other_params, SHAPE.hidden, SHAPE.seq)
    calibration = calibrate_from_traces(_dp2_trace(), deeper, DP2, [Probe(probe, SHAPE, TP2)])
    costs, correction = calibration.costs_for(TP2)
    assert correction == pytest.approx(1.0)
    added = 2 * 0.010 * (1 + 1.3) + 2 * 100_000 / 2 * costs.update_per_param
    assert ReplayPredictor(calibration).step_time(TP2) == pytest.approx(0.100 + added)


def test_a_recomputation_inside_a_block_backward_is_not_its_backward() -> None:
    probe = _with_block_backwards(_tp2_probe(), 0.020, recompute=0.006)
    traced = calibrate(probe, SHAPE, TP2, tp_comm_in_compute=True)
    assert traced.backward_ratio == pytest.approx((0.020 - 0.006) / 0.010)
    assert traced.block_forward_per_sample == pytest.approx(0.020 * 2 / (2 * 4))  # recomputations left out


def test_block_backwards_overlapped_by_data_parallel_reduction_are_priced_by_flops() -> None:
    # the gradient all-reduce starts at 60 ms: inside blocks' backwards of 20 ms each (30-70 ms), after ones of 13 ms
    overlapped = calibrate(_with_block_backwards(_dp2_trace(), 0.020), SHAPE, DP2)
    assert (overlapped.backward_ratio, overlapped.backward_ratio_source) == (BLOCK_BACKWARD_RATIO, "flops")
    reduced_after = calibrate(_with_block_backwards(_dp2_trace(), 0.013), SHAPE, DP2)
    assert reduced_after.backward_ratio == pytest.approx(1.3)
    assert reduced_after.backward_ratio_source == "blocks"


# a block call of 2 and 4 samples: forward 2 / 3 ms, backward 3 / 4.5 ms (1.5x at 4 samples)
_BLOCK_CURVE = CallCurve((2.0, 4.0), (0.002, 0.003), (0.003, 0.0045))


def test_a_probe_prices_block_backwards_the_trace_could_not_time_apart() -> None:
    overlapped = calibrate(_with_block_backwards(_dp2_trace(), 0.020), SHAPE, DP2)
    probed = with_probed_backward(overlapped, _BLOCK_CURVE, 4)
    assert (probed.backward_ratio, probed.backward_ratio_source) == (pytest.approx(1.5), "probe")
    assert predict_layout(probed, SHAPE, PP2).step_time < predict_layout(overlapped, SHAPE, PP2).step_time
    assert probed.block_seconds(4, forward=False) == pytest.approx(1.5 * probed.block_seconds(4, forward=True))


def test_a_timed_backward_is_kept_over_the_probes() -> None:
    reduced_after = calibrate(_with_block_backwards(_dp2_trace(), 0.013), SHAPE, DP2)
    assert with_probed_backward(reduced_after, _BLOCK_CURVE, 4) is reduced_after
    with pytest.raises(ValueError, match="outside the curve's"):
        with_probed_backward(reduced_after, _BLOCK_CURVE, 8)


class _TurnTakingBlock(nn.Module):
    """A block that hands the turn to the other sub-batches halfway, as a tensor-parallel block does at its
    collective."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.first(x))
        yield_turn()
        return self.second(hidden) + x


class _SubBatchedNet(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_TurnTakingBlock(width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_each_sub_batch_records_its_own_block_spans() -> None:
    net = _SubBatchedNet()
    net.forward = SubBatchForward(net, 2)
    recorder = TraceRecorder(0)
    recorder.install()
    try:
        step = recorder.begin_step(0)
        net(torch.randn(4, 16, requires_grad=True)).sum().backward()
        recorder.close_span(step)
    finally:
        spans = recorder.finish().spans
    blocks = [s for s in spans if s.is_block()]
    assert sorted((s.name, s.thread) for s in blocks) == [
        ("block 0", "sub-batch 0"), ("block 0", "sub-batch 1"), ("block 1", "sub-batch 0"), ("block 1", "sub-batch 1")]
    first, second = sorted((s for s in blocks if s.name == "block 0"), key=lambda s: s.start)
    assert second.start < first.end  # the turns interleave the sub-batches' blocks
    waits = [s for s in spans if s.category == "WAIT"]
    assert {s.thread for s in waits} == {"sub-batch 0", "sub-batch 1"}
    assert any(first.start < s.start and s.end <= first.end for s in waits if s.thread == first.thread)
    backwards = [s for s in spans if s.is_block("BW")]  # each sub-batch's thread times its own
    assert sorted((s.name, s.thread) for s in backwards) == [
        ("block 0", "sub-batch 0"), ("block 0", "sub-batch 1"), ("block 1", "sub-batch 0"), ("block 1", "sub-batch 1")]


def test_a_sub_batchs_block_excludes_its_waits_for_the_turn() -> None:
    # two sub-batches take turns of 5 ms from 5 to 45 ms, each block in two turns: 40 ms of block work
    def sub_batch(index: int, block: int, span: tuple[float, float], wait: tuple[float, float]) -> list[Span]:
        thread = f"sub-batch {index}"
        return [Span(f"block {block}", "FW", *span, 0, 2, thread), Span("turn", "WAIT", *wait, 0, 3, thread)]

    spans = [Span("step 0", "step", 0.0, 0.100, 0), Span("training_step", "FW", 0.0, 0.050, 0, 1),
             *sub_batch(0, 0, (0.005, 0.020), (0.010, 0.015)), *sub_batch(1, 0, (0.010, 0.030), (0.015, 0.025)),
             *sub_batch(0, 1, (0.020, 0.040), (0.025, 0.035)), *sub_batch(1, 1, (0.030, 0.045), (0.035, 0.040)),
             Span("backward", "BW", 0.050, 0.090, 0, 1)]
    (totals,) = _rank_breakdown(Trace([RankTrace(0, spans)], [0.0]))
    assert totals["block"] == pytest.approx(0.040)  # the spans' 70 ms less each thread's waits for its turn
    assert totals["FW"] == pytest.approx(0.050)
