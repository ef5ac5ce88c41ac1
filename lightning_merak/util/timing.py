"""Device time: how long a device took to run a region of work, read here by every timer that feeds a decision.

On a GPU a call returns once its kernels are queued, so ``time.perf_counter()`` around GPU work measures their
launch: a planner, partitioner, cost model or scheduler fed such figures finds compute nearly free. Timers whose
figures feed a decision time through this module instead:

* :class:`DeviceTimer` times the body of a ``with`` block: on CUDA by a pair of events recorded on the device's
  current stream, whose elapsed time is read (after waiting for the end event) only when
  :attr:`~DeviceTimer.seconds` is asked for, so many regions can be timed before the host waits once;
* :class:`DeviceStamp` is one such point in the device's time, for a region cut where hooks run
  (:meth:`DeviceStamp.seconds_since` reads the time between two);
* :func:`device_now` is the wall clock once the device has run everything queued: for figures needed at once
  as plain wall-clock times, or for work spread over several streams (copies on a side stream) that events on
  one stream would not wait for;
* :class:`DeviceSeconds` keeps a series of such regions (one per training step), read when looked at;
* :func:`median_call_time` / :func:`mean_call_time` time repeated calls of a function, fewer of them inside
  :func:`repeat_budget` once the calls have taken its seconds.

On the CPU, where a call has finished when it returns, and on any other device, every figure is a
``time.perf_counter()`` difference, as a plain wall clock gives.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Callable, Optional, Union, overload

import torch

__all__ = ["MIN_BUDGETED_REPEATS", "DeviceSeconds", "DeviceStamp", "DeviceTimer", "device_now", "mean_call_time",
           "budget_spent", "budget_start", "median_call_time", "repeat_budget", "synchronize"]

Device = Union[torch.device, str]


def _on_cuda(device: Device) -> bool:
    """Whether ``device`` queues its work (CUDA) rather than running it before a call returns."""
    return torch.device(device).type == "cuda"


def synchronize(device: Device) -> None:
    """Wait until ``device`` has run everything queued on it; a no-op on the CPU."""
    if _on_cuda(device):
        torch.cuda.synchronize(device)


def device_now(device: Device) -> float:
    """``time.perf_counter()`` once ``device`` has run everything queued: the difference of two readings is the
    device's time between them. It stops the host from running ahead, so prefer :class:`DeviceTimer` where the
    figure can wait."""
    synchronize(device)
    return time.perf_counter()


class DeviceStamp:
    """A point in ``device``'s time, taken when constructed: a CUDA event recorded on the device's current stream,
    or the wall clock on the CPU."""

    __slots__ = ("_event", "_wall")

    def __init__(self, device: Device) -> None:
        self._event: Optional[Any] = None
        self._wall = 0.0
        if _on_cuda(device):
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record(torch.cuda.current_stream(device))
        else:
            self._wall = time.perf_counter()

    def seconds_since(self, earlier: "DeviceStamp") -> float:
        """Seconds from ``earlier`` to this point on the device; on CUDA it waits until the device reached both."""
        if (self._event is None) != (earlier._event is None):
            raise ValueError("both stamps must be taken on one device")
        if self._event is None:
            return self._wall - earlier._wall
        earlier._event.synchronize()
        self._event.synchronize()
        return earlier._event.elapsed_time(self._event) / 1000.0


class DeviceTimer:
    """``with DeviceTimer(device) as timer: ...`` times the block's work on ``device``; :attr:`seconds` reads it."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._start: Optional[DeviceStamp] = None
        self._end: Optional[DeviceStamp] = None

    def __enter__(self) -> "DeviceTimer":
        self._start, self._end = DeviceStamp(self.device), None
        return self

    def __exit__(self, kind: Optional[type[BaseException]], error: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        self._end = DeviceStamp(self.device)

    @property
    def seconds(self) -> float:
        """The region's seconds on the device (on CUDA the first read waits until the device has run it)."""
        if self._start is None or self._end is None:
            raise RuntimeError("a DeviceTimer is read after its with block has ended")
        return self._end.seconds_since(self._start)


class DeviceSeconds(Sequence[float]):
    """The seconds of regions on a device, in the order they were appended: appending one does not wait for the
    device; looking at the figures reads those not read yet (on CUDA, after waiting for their ends)."""

    def __init__(self) -> None:
        self._read: list[float] = []
        self._unread: list[tuple[DeviceStamp, DeviceStamp]] = []

    def append(self, start: DeviceStamp, end: DeviceStamp) -> None:
        """Add the region from ``start`` to ``end``."""
        self._unread.append((start, end))

    def __len__(self) -> int:
        return len(self._read) + len(self._unread)

    @overload
    def __getitem__(self, index: int) -> float: ...

    @overload
    def __getitem__(self, index: slice) -> list[float]: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[float, list[float]]:
        self._read += [end.seconds_since(start) for start, end in self._unread]
        self._unread.clear()
        return self._read[index]


MIN_BUDGETED_REPEATS = 1
"""Timed calls :func:`repeat_budget` keeps at least. A call that outlasts the budget on its own (seconds) already
spreads the machine's brief disturbances over its length; shorter ones get as many repeats as the budget holds."""

_BUDGET_S: ContextVar[Optional[float]] = ContextVar("repeat_budget_s", default=None)


@contextmanager
def repeat_budget(seconds: float) -> Iterator[None]:
    """Inside the block, :func:`median_call_time` and :func:`mean_call_time` stop repeating a call once its calls
    (warm-up included) have taken ``seconds`` of wall time, after at least :data:`MIN_BUDGETED_REPEATS` timed ones.

    Repeats average out disturbances of a few milliseconds, which a call of seconds barely feels; without a bound,
    every quantity a profiler times costs ``repeats`` such calls (a layout planner at 16k tokens on CPU took over
    ten minutes per rank). Calls of milliseconds keep all their repeats. On CUDA the wall time counts only what the
    host waited for, so the bound cuts less there.
    """
    if seconds <= 0:
        raise ValueError(f"repeat_budget needs seconds > 0, got {seconds}")
    token = _BUDGET_S.set(seconds)
    try:
        yield
    finally:
        _BUDGET_S.reset(token)


def budget_start() -> float:
    """The host clock where a quantity's calls begin (before its warm-up), for :func:`budget_spent`; outside a
    :func:`repeat_budget` no clock is read (0.0)."""
    return time.perf_counter() if _BUDGET_S.get() is not None else 0.0


def budget_spent(started: float, timed: int) -> bool:
    """Whether a quantity whose calls began at ``started`` (:func:`budget_start`) and has ``timed`` timed calls
    should stop repeating under :func:`repeat_budget` (never outside one)."""
    budget_s = _BUDGET_S.get()
    return budget_s is not None and timed >= MIN_BUDGETED_REPEATS and time.perf_counter() - started >= budget_s


def _call_times(fn: Callable[[], Any], repeats: int, device: Device) -> list[float]:
    started = budget_start()
    fn()
    timers = []
    for _ in range(repeats):
        with DeviceTimer(device) as timer:
            fn()
        timers.append(timer)
        if budget_spent(started, len(timers)):
            break
    return [timer.seconds for timer in timers]


def median_call_time(fn: Callable[[], Any], repeats: int, device: Device) -> float:
    """Median device time of ``repeats`` calls (fewer under :func:`repeat_budget`) after one warm-up call: robust
    to a busy machine."""
    return statistics.median(_call_times(fn, repeats, device))


def mean_call_time(fn: Callable[[], Any], repeats: int, device: Device) -> float:
    """Mean device time of ``repeats`` calls (fewer under :func:`repeat_budget`) after one warm-up call: what a
    long run of such calls pays on average.

    Other load on the machine slows some calls; a training step of many calls meets it in
    proportion, and the median of a few calls leaves it out.
    """
    return statistics.fmean(_call_times(fn, repeats, device))
