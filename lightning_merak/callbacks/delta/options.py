"""DeltaMemory's settings, declared once: the callback's keyword arguments, the manager's options and
``merak-train``'s ``memory=delta`` schema all take their fields, defaults and checks from here.

Plain Python (no torch), so the Hydra schema can derive from it while ``--help`` stays light.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from lightning_merak.util.fields import option
from lightning_merak.util.values import is_count

__all__ = ["SWAP_TIERS", "DeltaOptions"]

SWAP_TIERS = ("host", "disk")
DIRECTORS = ("exposed", "delta")


@dataclass
class DeltaOptions:
    """Every setting of :class:`~lightning_merak.callbacks.delta.DeltaMemory` but the budget, the blocks
    and per-block overrides (documented there), with its default and what it does."""

    swap_tier: Optional[str] = option(
        None, "Where swapped activations wait for backward: `host` (pinned host memory, side-stream copies; the "
        "default on GPU) or `disk` (files written by a background thread; the default on CPU).")
    swap_dir: Optional[str] = option(None, "Parent directory of the disk tier's private directory (default: tmp).")
    warmup_steps: int = option(2, "Steps profiled with every block kept before the plan is made.")
    director: str = option(
        "exposed", "How a block too large to keep is handled: `exposed` recomputes it when its forward takes less "
        "than the swap time backward cannot hide; `delta` (the paper's rule) recomputes it when twice its swap "
        "time exceeds its forward.")
    prefetch_depth: int = option(5, "Swapped blocks loaded ahead during backward (DELTA uses 5).")
    min_offload_bytes: int = option(1024, "Saved tensors smaller than this stay on the device.")
    stash_depth: int = option(8, "Copy-outs in flight before the oldest is waited for.")
    host_pool_bytes: Optional[int] = option(
        None, "Cap of the pinned host pool in bytes (default: half the available host memory).")
    replan_on_shape_change: bool = option(
        True, "Re-plan (from the profile, scaled) when the input shapes change.")
    plot: bool = option(True, "Save the memory timeline PNG into the trainer's log directory.")

    def validate(self) -> None:
        """Refuse a setting out of range, naming the accepted values."""
        if self.swap_tier is not None and self.swap_tier not in SWAP_TIERS:
            raise ValueError(f"swap_tier {self.swap_tier!r} is unknown; choose 'host', 'disk' or None (automatic)")
        if self.director not in DIRECTORS:
            raise ValueError(f"director {self.director!r} is unknown; choose 'exposed' or 'delta'")
        for name, low in (("warmup_steps", 1), ("prefetch_depth", 1), ("stash_depth", 1), ("min_offload_bytes", 0)):
            value = getattr(self, name)
            if not is_count(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.host_pool_bytes is not None and (not is_count(self.host_pool_bytes) or self.host_pool_bytes <= 0):
            raise ValueError(
                f"host_pool_bytes must be a positive integer of bytes, or None (half the available host memory), "
                f"got {self.host_pool_bytes!r}"
            )
        for name in ("replan_on_shape_change", "plot"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.swap_dir is not None:
            _check_swap_dir(self.swap_dir)


def _check_swap_dir(swap_dir: object) -> None:
    """Refuse a ``swap_dir`` the disk tier could not create its directory in, before fit rather than at its
    first swap: a path that is a file, or lies under one."""
    if not isinstance(swap_dir, str) or not swap_dir:
        raise ValueError(f"swap_dir must be a directory path or None (tmp), got {swap_dir!r}")
    existing = os.path.abspath(swap_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(
            f"swap_dir {swap_dir!r} cannot be a directory: {existing!r} is a file; name a directory (it is created "
            "if missing) or None (tmp)"
        )
