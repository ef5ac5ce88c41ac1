"""How long a rank's stages computed during a schedule step, and how long the step took: the measured bubble.

:class:`StageBusyClock` times each chunk a ``torch.distributed.pipelining`` stage runs (forward, backward,
weight gradient) and the schedule's whole step. What the step spent outside its chunks is waiting for a
neighbour stage, the pipeline's bubble (plus the sends and receives that were not overlapped). A stage that waits
for a neighbour's message inside a chunk (:class:`~.schedules.EarlyReceiveStage`, through a method named in
:data:`RECEIVE_WAIT_METHODS`) has that wait timed apart and counted idle, not busy. On CUDA the chunks are timed
with events on the current stream, read only when :attr:`last` is asked for; on the CPU a chunk has finished
when its call returns and the wall clock is read.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from lightning_merak.util.timing import DeviceTimer

__all__ = ["CHUNK_METHODS", "RECEIVE_WAIT_METHODS", "StageBusyClock"]

CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
RECEIVE_WAIT_METHODS = ("wait_posted_receive",)
"""Methods a stage calls inside a chunk to block on a neighbour's message: their time is idle, not compute."""


class StageBusyClock:
    """Times the chunks of ``stages`` (pipeline stage objects of one rank) and the steps :meth:`step` wraps.

    Each stage object's chunk (and receive-wait) methods are wrapped on the instance; the wrapper calls the
    class's method as it is at call time, so a profiler that patches the class still sees every call.
    """

    def __init__(self, stages: Iterable[Any], device: torch.device) -> None:
        self._device = device
        self._chunks: list[DeviceTimer] = []
        self._waits: list[DeviceTimer] = []
        """Receive waits inside the chunks: counted in a chunk's time, taken off the busy time."""
        self._step: Optional[DeviceTimer] = None
        self._timing = False
        self._inside = False
        for stage in stages:
            for name in CHUNK_METHODS:
                if hasattr(type(stage), name):
                    setattr(stage, name, self._timed(stage, name))
            for name in RECEIVE_WAIT_METHODS:
                if hasattr(type(stage), name):
                    setattr(stage, name, self._timed_wait(stage, name))

    def _timed(self, stage: Any, name: str) -> Callable[..., Any]:
        def chunk(*args: Any, **kwargs: Any) -> Any:
            method = getattr(type(stage), name)
            if not self._timing or self._inside:
                return method(stage, *args, **kwargs)
            self._inside = True
            try:
                with DeviceTimer(self._device) as timer:
                    return method(stage, *args, **kwargs)
            finally:
                self._inside = False
                self._chunks.append(timer)

        return chunk

    def _timed_wait(self, stage: Any, name: str) -> Callable[..., Any]:
        def wait(*args: Any, **kwargs: Any) -> Any:
            method = getattr(type(stage), name)
            if not (self._timing and self._inside):  # outside a chunk a wait is idle time already
                return method(stage, *args, **kwargs)
            timer = DeviceTimer(self._device)
            try:
                with timer:
                    return method(stage, *args, **kwargs)
            finally:
                self._waits.append(timer)

        return wait

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time one schedule step and the chunks it runs (the previous step's record is replaced)."""
        self._chunks, self._waits = [], []
        self._timing = True
        try:
            with DeviceTimer(self._device) as self._step:
                yield
        finally:
            self._timing = False

    @property
    def last(self) -> Optional[tuple[float, float]]:
        """``(busy seconds, step seconds)`` of the last timed step, ``None`` before one (synchronises on CUDA):
        the chunks' time less the receive waits inside them."""
        if self._step is None:
            return None
        busy = sum(chunk.seconds for chunk in self._chunks) - sum(wait.seconds for wait in self._waits)
        return max(0.0, busy), self._step.seconds
