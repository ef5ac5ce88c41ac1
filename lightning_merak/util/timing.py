"""Wall-clock timing that the profilers share."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["mean_call_time", "median_call_time"]


def _call_times(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_call_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median time of ``repeats`` calls after one warm-up call: robust to a busy machine."""
    return statistics.median(_call_times(fn, repeats))


def mean_call_time(fn: Callable[[], Any], repeats: int) -> float:
    """Mean time of ``repeats`` calls after one warm-up call: what a long run of such calls pays on average.

    Other load on the machine slows some calls; a training step of many calls meets it in
    proportion, and the median of a few calls leaves it out.
    """
    return statistics.fmean(_call_times(fn, repeats))
