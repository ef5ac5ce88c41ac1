"""Gathering one object from every rank through the rendezvous store, with a deadline of its own.

Why: ranks that measure for minutes before exchanging the results (a layout planner profiling 16k-token
sequences on shared CPU cores) finish minutes apart, and those waiting in a collective meanwhile look hung to the
collective watchdog, whose stall timeout is sized for training steps. A wait in the store is no collective: it
is bounded by the deadline the caller sizes to its work, and past it the error names the ranks that did not
deliver and the option that sets the deadline.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["StoreGatherTimeout", "gather_through_store"]

_POLL_S = 0.2


class StoreGatherTimeout(RuntimeError):
    """Some ranks delivered nothing to :func:`gather_through_store` before its deadline."""


def gather_through_store(value: Any, key: str, timeout_s: float, what: str, option: str) -> list[Any]:
    """Every rank's ``value`` of the default process group, in rank order, exchanged under ``key`` in its store.

    ``key`` must be the same on every rank and new to the store (a store can outlive a run, as torchrun's
    agent's does across restarts: derive it from a value the ranks agreed on in this run). A rank waits at most
    ``timeout_s`` for the others; then :class:`StoreGatherTimeout` says ``what`` they were doing and to raise
    ``option``.
    """
    if timeout_s <= 0:
        raise ValueError(f"gather_through_store needs timeout_s > 0, got {timeout_s}")
    store = c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"{key}/{rank}", pickle.dumps(value))
    started = time.monotonic()
    received: dict[int, Any] = {}
    while True:
        for other in range(world):
            name = f"{key}/{other}"
            if other not in received and store.check([name]):
                received[other] = pickle.loads(store.get(name))
        if len(received) == world:
            return [received[other] for other in range(world)]
        waited = time.monotonic() - started
        if waited >= timeout_s:
            missing = [other for other in range(world) if other not in received]
            raise StoreGatherTimeout(
                f"rank {rank} waited {waited:.0f} s for ranks {missing} to finish {what}; they are slower or "
                f"stopped. If they are only slower, raise {option}")
        time.sleep(_POLL_S)
