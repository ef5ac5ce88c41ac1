"""How long a rank's stages computed during a schedule step, and how long the step took: the measured bubble.

:class:`StageBusyClock` times each chunk a ``torch.distributed.pipelining`` stage runs (forward, backward,
weight gradient) and the schedule's whole step. What the step spent outside its chunks is waiting for a
neighbour stage, the pipeline's bubble (plus the sends and receives that were not overlapped). On CUDA the
chunks are timed with events on the current stream, read only when :attr:`last` is asked for; on the CPU a
chunk has finished when its call returns and the wall clock is read.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

__all__ = ["CHUNK_METHODS", "StageBusyClock"]

CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class _Interval:
    """One timed region: CUDA events on ``device``'s current stream, or the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self._events: Optional[tuple[Any, Any]] = None
        self._start = self._end = 0.0
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def start(self) -> None:
        if self._events is not None:
            self._events[0].record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._end = time.perf_counter()

    def seconds(self) -> float:
        if self._events is not None:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1000.0
        return self._end - self._start


class StageBusyClock:
    """Times the chunks of ``stages`` (pipeline stage objects of one rank) and the steps :meth:`step` wraps.

    Each stage object's chunk methods are wrapped on the instance; the wrapper calls the class's method as it
    is at call time, so a profiler that patches the class still sees every call.
    """

    def __init__(self, stages: Iterable[Any], device: torch.device) -> None:
        self._device = device
        self._chunks: list[_Interval] = []
        self._step: Optional[_Interval] = None
        self._timing = False
        self._inside = False
        for stage in stages:
            for name in CHUNK_METHODS:
                if hasattr(type(stage), name):
                    setattr(stage, name, self._timed(stage, name))

    def _timed(self, stage: Any, name: str) -> Callable[..., Any]:
        def chunk(*args: Any, **kwargs: Any) -> Any:
            method = getattr(type(stage), name)
            if not self._timing or self._inside:
                return method(stage, *args, **kwargs)
            interval = _Interval(self._device)
            self._inside = True
            interval.start()
            try:
                return method(stage, *args, **kwargs)
            finally:
                interval.stop()
                self._inside = False
                self._chunks.append(interval)

        return chunk

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time one schedule step and the chunks it runs (the previous step's record is replaced)."""
        self._chunks = []
        self._step = _Interval(self._device)
        self._step.start()
        self._timing = True
        try:
            yield
        finally:
            self._timing = False
            self._step.stop()

    @property
    def last(self) -> Optional[tuple[float, float]]:
        """``(busy seconds, step seconds)`` of the last timed step, ``None`` before one (synchronises on CUDA)."""
        if self._step is None:
            return None
        return sum(chunk.seconds() for chunk in self._chunks), self._step.seconds()
