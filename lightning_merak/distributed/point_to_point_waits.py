"""Counting a rank's waits for point-to-point sends and receives, for the watchdog (:mod:`.watchdog`).

Why: torch's flight recorder on gloo (torch 2.13, measured) records collectives only; a pipeline's sends and
receives between stages and ring attention's exchanges leave no trace in it, so a rank blocked for minutes on a
receive from a stalled stage looked to the watchdog like a rank waiting in nothing. gloo gives no completion hook
either, so while :func:`count_point_to_point_waits` holds, ``isend`` and ``irecv`` of ``torch.distributed``
(which every caller looks up at call time: torch's pipelining, ``batch_isend_irecv``, and ``send`` and ``recv``,
which wait on them) return works whose ``wait`` counts as begun on entry and returned on exit. What counts is
the wait, not the op: a receive posted early while the stage computes is no stall, and a rank computing for
long, with every wait returned, shows nothing in flight.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["PeerOp", "count_point_to_point_waits", "open_point_to_point_waits", "point_to_point_waits"]


@dataclass(frozen=True)
class PeerOp:
    """A send or receive as its caller named the peer: a global rank, or a rank of ``group`` (``group_peer``)."""

    name: str
    peer: int | None
    group_peer: int | None = None
    group: object = None

    def global_peer(self) -> int | None:
        """The peer's global rank (None: a receive from any rank)."""
        if self.peer is not None or self.group_peer is None:
            return self.peer
        import torch.distributed as dist  # lazy: torch only where a stall is described

        return dist.get_global_rank(self.group if self.group is not None else dist.group.WORLD, self.group_peer)

    def __str__(self) -> str:
        peer = self.global_peer()
        return f"{self.name} {'to' if 'send' in self.name else 'from'} {'any rank' if peer is None else f'rank {peer}'}"


class _Waits:
    """This process's waits for sends and receives: how many began, how many returned, which have not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._began = self._returned = 0
        self._open: dict[int, PeerOp] = {}

    @contextmanager
    def waiting(self, op: PeerOp) -> Iterator[None]:
        with self._lock:
            self._began += 1
            number = self._began
            self._open[number] = op
        try:
            yield
        finally:
            with self._lock:
                self._returned += 1
                del self._open[number]

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self._began, self._returned

    def open_ops(self) -> list[PeerOp]:
        with self._lock:
            return list(self._open.values())


_WAITS = _Waits()


def point_to_point_waits() -> tuple[int, int]:
    """(waits begun, waits returned) of this process, since it started."""
    return _WAITS.counts()


def open_point_to_point_waits() -> list[PeerOp]:
    """The sends and receives this process waits for now."""
    return _WAITS.open_ops()


class _WatchedWork:
    """The work of an ``isend`` or ``irecv`` whose waits are counted; everything else goes to the work."""

    def __init__(self, work: object, op: PeerOp) -> None:
        self._work, self._op = work, op

    def wait(self, *args: object, **kwargs: object) -> object:
        with _WAITS.waiting(self._op):
            return self._work.wait(*args, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._work, name)


def _counting_waits(original: Callable) -> Callable:
    """``original`` (``isend`` or ``irecv`` of torch.distributed), the waits for its works counted."""
    signature, name = inspect.signature(original), original.__name__
    sends = name == "isend"

    @functools.wraps(original)
    def counted(*args: object, **kwargs: object) -> object:
        given = signature.bind_partial(*args, **kwargs).arguments
        op = PeerOp(name, given.get("dst" if sends else "src"), given.get("group_dst" if sends else "group_src"),
                    given.get("group"))
        work = original(*args, **kwargs)
        return work if work is None else _WatchedWork(work, op)

    counted.counts_waits = True  # type: ignore[attr-defined]
    return counted


def count_point_to_point_waits(modules: Sequence[object]) -> Callable[[], None]:
    """Wrap ``isend`` and ``irecv`` of ``modules`` to count this process's waits for their works (``send`` and
    ``recv`` included); returns the function that puts them back.

    Pass ``distributed_c10d`` first, then ``torch.distributed``: both, or ``P2POp``'s check of its ``op`` against
    c10d's own ``isend`` fails for ops built from ``dist.isend``.
    """
    wrapped: list[tuple[object, str, Callable, Callable]] = []
    for name in ("isend", "irecv"):
        original = getattr(modules[0], name)
        if getattr(original, "counts_waits", False):  # another watchdog of this process counts them already
            continue
        counted = _counting_waits(original)
        for module in modules:
            if getattr(module, name, None) is original:
                setattr(module, name, counted)
                wrapped.append((module, name, original, counted))

    def restore() -> None:
        for module, name, original, counted in reversed(wrapped):
            if getattr(module, name) is counted:  # else wrapped again since (a profiler's recorder): left counting
                setattr(module, name, original)

    return restore
