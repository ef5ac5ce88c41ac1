"""Hydra option ``memory=delta``: the :class:`DeltaMemory` callback from a structured config.

The budget is a string (Hydra structured configs cannot hold a union of int, float and
str): ``"auto"``, a fraction ``"0.5"``/``"50%"``, or bytes ``"2GiB"``/``"1073741824"``.
It is parsed when the option object is created and again in ``build_callbacks``, so a
bad value fails with a message naming the accepted forms before training starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from lightning_merak.callbacks.delta.budget import parse_budget
from lightning_merak.config import CallbackOptionConfig, register_option

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DeltaMemoryConfig", "register"]


@dataclass
class DeltaMemoryConfig(CallbackOptionConfig):
    """``memory=delta memory.budget=...``; fields mirror :class:`DeltaMemory`'s arguments."""

    name: str = "delta"
    budget: str = "auto"
    swap_tier: Optional[str] = None
    swap_dir: Optional[str] = None
    warmup_steps: int = 2
    director: str = "exposed"
    prefetch_depth: int = 5
    min_offload_bytes: int = 1024
    stash_depth: int = 8
    host_pool_bytes: Optional[int] = None
    replan_on_shape_change: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        parse_budget(str(self.budget))

    def build_callbacks(self) -> list[pl.Callback]:
        from lightning_merak.callbacks.delta.callback import DeltaMemory

        return [
            DeltaMemory(
                budget=parse_budget(str(self.budget)),
                swap_tier=self.swap_tier,
                swap_dir=self.swap_dir,
                warmup_steps=self.warmup_steps,
                director=self.director,
                prefetch_depth=self.prefetch_depth,
                min_offload_bytes=self.min_offload_bytes,
                stash_depth=self.stash_depth,
                host_pool_bytes=self.host_pool_bytes,
                replan_on_shape_change=self.replan_on_shape_change,
                plot=self.plot,
            )
        ]


def register() -> None:
    """Register ``memory=delta``'s schema (called by the project's config setup)."""
    register_option("memory", "delta", DeltaMemoryConfig)
