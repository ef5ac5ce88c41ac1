"""Dropout in tensor-parallel regions draws a different mask on each rank (Megatron's model-parallel RNG).

Between a column layer and its row partner each rank holds its own heads or channels; with
sequence parallelism a whole block holds this rank's slice of the sequence. Every rank starts
from the same generator state, so without a fork their masks would repeat one pattern across
heads or slices. At a region's entry one seed is drawn from the current generator — the same
draw on every rank, so the replicated computation after the region stays replicated — and
this rank's stream is seeded from it and the rank; at the exit the shared stream is
restored. A recomputed region replays that draw and with it the masks; sub-batch threads
keep separate stacks.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from lightning_merak.strategies import random_state

__all__ = ["enter_rank_stream", "install_rank_streams", "leave_rank_stream"]

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


def install_rank_streams(block: nn.Module, column_groups: list[list[str]], rows: list[str], rank: int,
                         whole_block: bool) -> None:
    """Fork ``rank``'s stream from each column group's first layer to its row partner, or over ``block``.

    ``whole_block`` is for sequence parallelism, where everything inside the block is this
    rank's own. Only training forwards fork (evaluation draws nothing).
    """
    if whole_block:
        key = object()
        block.register_forward_pre_hook(lambda module, args: enter_rank_stream(key, rank) if module.training else None)
        block.register_forward_hook(lambda module, args, output: leave_rank_stream(key), prepend=True)
        return
    for members, row in zip(column_groups, rows, strict=True):
        key = object()

        def enter(module: nn.Module, args: Any, key: object = key) -> None:
            if module.training:
                enter_rank_stream(key, rank)

        for name in members:
            block.get_submodule(name).register_forward_pre_hook(enter)
        block.get_submodule(row).register_forward_pre_hook(lambda module, args, key=key: leave_rank_stream(key))
