"""A receive posted early over gloo (no completion time): the receiver's compute before its wait is no transfer."""

from __future__ import annotations

import pytest

from lightning_merak.callbacks.profiler import Trace, WhatIf, replay_trace
from lightning_merak.planning.replay.engine import measured_step_time
from lightning_merak.planning.replay.trace import CommRecord, RankTrace, Span

MB = 1_000_000


def _posted_early_receive() -> Trace:
    """Rank 1 posts a 1 MB irecv at 0 ms, computes to 25 ms and waits 0.5 ms for it; rank 0 sends at 1 ms and
    computes to 30 ms. Neither side has a completion time (gloo's point-to-point works have no future)."""
    sender = RankTrace(0, [Span("step 0", "step", 0.0, 0.030, 0), Span("stage 0 forward mb0", "FW", 0.0, 0.030, 0, 1)],
                       [CommRecord("isend", "send", (0, 1), 0, MB, 0.001, 0, peer=1)])
    receiver = RankTrace(1, [Span("step 0", "step", 0.0, 0.030, 0),
                             Span("stage 1 forward mb0", "FW", 0.0, 0.030, 0, 1)],
                         [CommRecord("irecv", "recv", (0, 1), 0, MB, 0.0, 0, wait_start=0.025, wait_end=0.0255,
                                     peer=0)])
    return Trace([sender, receiver], [0.0, 0.0])


def test_unmodified_replay_still_reproduces_the_step() -> None:
    trace = _posted_early_receive()
    assert replay_trace(trace).step_time == pytest.approx(measured_step_time(trace))


def test_halving_the_bandwidth_costs_at_most_the_transfer_the_receiver_waited_for() -> None:
    trace = _posted_early_receive()
    base = replay_trace(trace).step_time
    waited = 0.0005  # all the trace says the transfer took: it was done by the end of a 0.5 ms wait
    slower = replay_trace(trace, WhatIf(bandwidth_ratio=0.5)).step_time
    assert base <= slower <= base + waited * (1 / 0.5 - 1) + 1e-9
