"""The callback's own accounting of saved activations resident on the device.

Every saved tensor the callback sees is registered here under its storage key with a
reference count, so views of one storage count once and a storage stops counting when
its last holder lets go. The ledger also keeps a timeline of one step for the plot.
Pure Python: callers pass keys and byte counts, not tensors.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Hashable

__all__ = ["ResidentLedger", "TimelinePoint"]


@dataclass(frozen=True)
class TimelinePoint:
    """Resident saved bytes at ``t_s`` seconds after the step started; ``label`` marks events."""

    t_s: float
    resident_bytes: int
    label: str = ""


@dataclass
class _Entry:
    nbytes: int
    count: int


@dataclass
class ResidentLedger:
    """Reference-counted resident bytes per storage, with the peak and a per-step timeline."""

    max_points: int = 20_000
    resident_bytes: int = 0
    peak_bytes: int = 0
    _entries: dict[Hashable, _Entry] = field(default_factory=dict)
    _step_start: float = field(default_factory=time.perf_counter)
    timeline: list[TimelinePoint] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def acquire(self, key: Hashable, nbytes: int) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.count += 1
                return
            self._entries[key] = _Entry(nbytes, 1)
            self._change(nbytes)

    def release(self, key: Hashable) -> None:
        """Drop one holder of ``key``; called from autograd threads too, hence the lock."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.count -= 1
            if entry.count == 0:
                del self._entries[key]
                self._change(-entry.nbytes)

    def is_resident(self, key: Hashable) -> bool:
        return key in self._entries

    def adjust(self, delta_bytes: int, label: str = "") -> None:
        """Account bytes that have no storage of their own to follow (modelled recompute)."""
        with self._lock:
            self._change(delta_bytes, label)

    def mark(self, label: str) -> None:
        with self._lock:
            self._record(label)

    def start_step(self) -> None:
        """Begin a new timeline; the peak restarts from what is resident now."""
        self._step_start = time.perf_counter()
        self.timeline = []
        self.peak_bytes = self.resident_bytes
        self._record("step start")

    def _change(self, delta: int, label: str = "") -> None:
        self.resident_bytes += delta
        if self.resident_bytes > self.peak_bytes:
            self.peak_bytes = self.resident_bytes
        self._record(label)

    def _record(self, label: str) -> None:
        if len(self.timeline) < self.max_points:
            t = time.perf_counter() - self._step_start
            self.timeline.append(TimelinePoint(t, self.resident_bytes, label))
