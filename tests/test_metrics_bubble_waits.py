"""The measured bubble counts a receive wait inside a chunk (gloo's early-receive stage) as idle, not compute."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_merak.parallel.pipeline.busy import RECEIVE_WAIT_METHODS, StageBusyClock
from lightning_merak.parallel.pipeline.schedules import EarlyReceiveStage

WAIT_S, COMPUTE_S = 0.06, 0.02


class _WaitingStage:
    """Stands for :class:`EarlyReceiveStage`: each chunk first waits for its posted receive, then computes."""

    def wait_posted_receive(self, kind: str, chunk: int) -> None:
        time.sleep(WAIT_S)

    def forward_one_chunk(self, chunk: int) -> None:
        self.wait_posted_receive("forward", chunk)
        time.sleep(COMPUTE_S)

    def backward_one_chunk(self, chunk: int) -> None:
        self.wait_posted_receive("backward", chunk)
        time.sleep(COMPUTE_S)


def test_a_receive_wait_inside_a_chunk_is_idle_time():
    stage = _WaitingStage()
    clock = StageBusyClock([stage], torch.device("cpu"))
    with clock.step():
        stage.forward_one_chunk(0)
        stage.backward_one_chunk(0)
    busy, step = clock.last
    assert busy == pytest.approx(2 * COMPUTE_S, abs=0.03), "the waits were counted as compute"
    assert 1 - busy / step > 0.5


def test_a_wait_outside_any_chunk_is_not_taken_off_twice():
    stage = _WaitingStage()
    clock = StageBusyClock([stage], torch.device("cpu"))
    with clock.step():
        stage.wait_posted_receive("forward", 0)  # the step's time only: no chunk holds it
        stage.forward_one_chunk(0)
    busy, _ = clock.last
    assert busy == pytest.approx(COMPUTE_S, abs=0.03)


def test_the_early_receive_stage_waits_through_a_method_the_clock_times():
    assert all(callable(getattr(EarlyReceiveStage, name, None)) for name in RECEIVE_WAIT_METHODS)
