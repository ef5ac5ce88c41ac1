"""Block spans' timing over intervals (pure): a trace's block backwards against the forwards of the calls they
time, with recomputed forwards (inside a backward) told apart."""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Callable, Iterable

from lightning_merak.planning.replay.trace import Span

__all__ = ["covering", "merged_intervals", "timed_block_backward"]


def timed_block_backward(spans: list[Span], busy: Callable[[float, float, str], float],
                         in_backward: Callable[[float, float], bool]) -> tuple[float, float]:
    """The busy seconds (``busy(start, end, thread)``) of the blocks' backward spans (recomputed forwards inside them
    removed) and of the forward calls they time: each timed (step, block) pairs with as many of its forwards outside
    any backward (0, 0: no backward span)."""
    backward = [s for s in spans if s.is_block("BW")]
    if not backward:
        return 0.0, 0.0
    in_block_backward = covering(backward)
    untimed = Counter((s.step, s.name) for s in backward)
    timed_forward, recomputed = 0.0, 0.0
    for span in sorted((s for s in spans if s.is_block()), key=lambda s: s.start):
        if in_backward(span.start, span.end):
            recomputed += busy(span.start, span.end, span.thread) if in_block_backward(span.start, span.end) else 0.0
        elif untimed[(span.step, span.name)]:
            untimed[(span.step, span.name)] -= 1
            timed_forward += busy(span.start, span.end, span.thread)
    return sum(busy(s.start, s.end, s.thread) for s in backward) - recomputed, timed_forward


def merged_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) ``intervals`` as disjoint intervals in time order."""
    union: list[list[float]] = []
    for start, end in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([start, end])
    return [(start, end) for start, end in union]


def covering(spans: Iterable[Span]) -> Callable[[float, float], bool]:
    """Whether an interval (start, end) lies within the union of ``spans``."""
    union = merged_intervals((s.start, s.end) for s in spans)
    starts = [interval[0] for interval in union]

    def covered(start: float, end: float) -> bool:
        index = bisect.bisect_right(starts, start) - 1
        return index >= 0 and end <= union[index][1]

    return covered
