"""Wall-clock timing that the profilers share."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["median_call_time"]


def median_call_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median time of ``repeats`` calls after one warm-up call: robust to a busy machine."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
