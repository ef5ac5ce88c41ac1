"""Snapshots of the process-wide random generators, for code that must replay or fork dropout masks.

A snapshot holds the CPU generator's state and, once CUDA is in use, every GPU's (CUDA is
never initialised just to take one). Recomputation restores a forward's snapshot; sub-batches
and tensor-parallel ranks switch to streams seeded from one shared draw.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["GeneratorStates", "capture", "restore", "same", "seeded", "spread_seed"]

GeneratorStates = tuple[torch.Tensor, Optional[list[torch.Tensor]]]
"""(CPU generator state, every GPU's generator state or None while CUDA is unused)."""

_SPREAD = 0x9E3779B97F4A7C15
"""Odd constant spacing derived seeds apart (the 64-bit golden ratio)."""


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture() -> GeneratorStates:
    """The generators' current states."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if _cuda_in_use() else None


def same(first: GeneratorStates, second: GeneratorStates) -> bool:
    """Whether two snapshots hold the same states (nothing was drawn between them)."""
    if not torch.equal(first[0], second[0]) or (first[1] is None) != (second[1] is None):
        return False
    return first[1] is None or all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def restore(states: GeneratorStates) -> None:
    """Put the generators back in ``states``."""
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state_all(states[1])


def seeded(seed: int) -> GeneratorStates:
    """The states every generator has after ``manual_seed(seed)``, without touching the generators."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    if not _cuda_in_use():
        return cpu, None
    return cpu, [torch.Generator(device=f"cuda:{device}").manual_seed(seed).get_state()
                 for device in range(torch.cuda.device_count())]


def spread_seed(base: int, index: int) -> int:
    """The ``index``-th seed derived from ``base``: distinct for distinct indices, and never ``base`` itself."""
    return (base + (index + 1) * _SPREAD) % 2**63
