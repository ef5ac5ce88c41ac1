"""DeltaMemory's settings, declared once: the callback's keyword arguments, the manager's options and
``merak-train``'s ``memory=delta`` schema all take their fields, defaults and checks from here.

Plain Python (no torch), so the Hydra schema can derive from it while ``--help`` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_merak.util.fields import option

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
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.host_pool_bytes is not None and self.host_pool_bytes <= 0:
            raise ValueError(f"host_pool_bytes must be positive or None, got {self.host_pool_bytes}")
