"""One CPU core per rank, for benchmarks that emulate one device per rank on a shared machine."""

from __future__ import annotations

import os


def pin_rank_to_core(rank: int) -> int | None:
    """Restrict this process to one of the cores it may use (``rank`` modulo their count) and return it.

    Without pinning the scheduler moves ranks between cores and lets an idle rank's core run a busy one,
    so an expert or stage that waits costs less than it would on its own device. ``None`` where the
    platform has no CPU affinity (macOS, Windows); the process then runs unpinned.
    """
    if not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[rank % len(allowed)]
    for thread in _threads():
        try:
            os.sched_setaffinity(thread, {core})
        except ProcessLookupError:  # the thread ended after it was listed
            continue
    return core


def _threads() -> list[int]:
    """Every thread of this process (Linux's affinity is per thread; threads started later inherit it).

    Importing torch already starts a thread, so pinning only the calling one would leave it free."""
    try:
        return [int(task) for task in os.listdir("/proc/self/task")]
    except FileNotFoundError:
        return [0]
