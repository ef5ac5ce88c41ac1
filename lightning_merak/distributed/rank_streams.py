"""A random stream of this rank's own inside a region whose computation differs between ranks.

Tensor-parallel ranks each hold their own heads or channels (with sequence parallelism, their
own slice of the sequence), yet every rank starts from the same generator state, so without a
fork their dropout masks would repeat one pattern across heads or slices (Megatron's
model-parallel RNG). At a region's entry one seed is drawn from the current generator — the
same draw on every rank, so the replicated computation after the region stays replicated — and
this rank's stream is seeded from it and the rank; at the exit the shared stream is restored.
A recomputed region replays that draw and with it the masks; sub-batch threads keep separate
stacks.
"""

from __future__ import annotations

import threading

import torch

from lightning_merak.util import random_state

__all__ = ["enter_rank_stream", "leave_rank_stream", "shared_stream_state"]

_local = threading.local()


def _open_regions() -> list[tuple[object, random_state.GeneratorStates]]:
    regions = getattr(_local, "regions", None)
    if regions is None:
        regions = _local.regions = []
    return regions


def enter_rank_stream(key: object, rank: int) -> None:
    """Switch this thread's generators to ``rank``'s stream for the region ``key`` (nothing if it is open)."""
    regions = _open_regions()
    if regions and regions[-1][0] is key:
        return
    seed = int(torch.randint(2**62, (1,)))
    regions.append((key, random_state.capture()))
    random_state.restore(random_state.seeded(random_state.spread_seed(seed, rank)))


def leave_rank_stream(key: object) -> None:
    """Restore the shared stream if the region ``key`` is the innermost one open."""
    regions = _open_regions()
    if regions and regions[-1][0] is key:
        random_state.restore(regions.pop()[1])


def shared_stream_state() -> random_state.GeneratorStates | None:
    """The shared stream's states as the innermost open region left them (None outside any region): a draw
    from a copy of them is the same on every rank, and a recomputed region replays it."""
    regions = _open_regions()
    return regions[-1][1] if regions else None
