"""StageBusyClock: chunk compute inside a schedule step is busy time, the rest of the step is the bubble."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from lightning_merak.parallel.pipeline.busy import StageBusyClock


class _Stage:
    """Stands for a pipelining stage: chunk methods that take a known time."""

    def forward_one_chunk(self, chunk_id: int, seconds: float) -> int:
        time.sleep(seconds)
        return chunk_id

    def backward_one_chunk(self, chunk_id: int, seconds: float) -> None:
        time.sleep(seconds)


def test_chunks_inside_a_step_are_busy_and_the_waits_are_not():
    stages = [_Stage(), _Stage()]
    clock = StageBusyClock(stages, torch.device("cpu"))
    assert clock.last is None
    stages[0].forward_one_chunk(0, 0.05)  # outside a step: not counted
    with clock.step():
        assert stages[0].forward_one_chunk(1, 0.02) == 1
        time.sleep(0.05)  # waiting for a neighbour stage
        stages[1].backward_one_chunk(0, 0.03)
    busy, step = clock.last
    assert busy == pytest.approx(0.05, abs=0.02)
    assert step >= busy + 0.05
    with clock.step():
        stages[1].forward_one_chunk(0, 0.0)
    assert clock.last[0] < 0.02, "each step replaces the last one's record"


def test_a_patch_of_the_class_after_wrapping_still_runs_once_per_chunk():
    stage = _Stage()
    clock = StageBusyClock([stage], torch.device("cpu"))
    calls: list[Any] = []
    original = _Stage.forward_one_chunk

    def patched(self: _Stage, chunk_id: int, seconds: float) -> int:
        calls.append(chunk_id)
        return original(self, chunk_id, seconds)

    _Stage.forward_one_chunk = patched  # a profiler installed later patches the class
    try:
        with clock.step():
            stage.forward_one_chunk(3, 0.0)
    finally:
        _Stage.forward_one_chunk = original
    assert calls == [3] and clock.last is not None
