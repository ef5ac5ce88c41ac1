"""Block spans' timing over intervals (pure): a trace's block backwards against the forwards of the calls they
time, with recomputed forwards (inside a backward) told apart."""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Callable, Iterable

from lightning_merak.profiler.trace import Span

__all__ = ["covering", "timed_block_backward"]


def timed_block_backward(spans: list[Span], busy: Callable[[float, float], float],
                         in_backward: Callable[[float, float], bool]) -> tuple[float, float]:
    """The busy seconds of the blocks' backward spans (recomputed forwards inside them removed) and of the forward
    calls they time: each timed (step, block) pairs with as many of its forwards outside any backward (0, 0: no
    backward span)."""
    backward = [s for s in spans if s.is_block("BW")]
    if not backward:
        return 0.0, 0.0
    in_block_backward = covering(backward)
    untimed = Counter((s.step, s.name) for s in backward)
    timed_forward, recomputed = 0.0, 0.0
    for span in sorted((s for s in spans if s.is_block()), key=lambda s: s.start):
        if in_backward(span.start, span.end):
            recomputed += busy(span.start, span.end) if in_block_backward(span.start, span.end) else 0.0
        elif untimed[(span.step, span.name)]:
            untimed[(span.step, span.name)] -= 1
            timed_forward += busy(span.start, span.end)
    return sum(busy(s.start, s.end) for s in backward) - recomputed, timed_forward


def covering(spans: Iterable[Span]) -> Callable[[float, float], bool]:
    """Whether an interval (start, end) lies within the union of ``spans``."""
    merged: list[list[float]] = []
    for span in sorted(spans, key=lambda s: s.start):
        if merged and span.start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], span.end)
        else:
            merged.append([span.start, span.end])
    starts = [interval[0] for interval in merged]

    def covered(start: float, end: float) -> bool:
        index = bisect.bisect_right(starts, start) - 1
        return index >= 0 and end <= merged[index][1]

    return covered
