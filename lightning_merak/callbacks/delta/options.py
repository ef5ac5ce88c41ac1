"""DeltaMemory's settings, declared once: the callback's keyword arguments, the manager's options and
``merak-train``'s ``memory=delta`` schema all take their fields, defaults and checks from here.

Plain Python (no torch), so the Hydra schema can derive from it while ``--help`` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["SWAP_TIERS", "DeltaOptions"]

SWAP_TIERS = ("host", "disk")
DIRECTORS = ("exposed", "delta")


@dataclass
class DeltaOptions:
    """Every setting of :class:`~lightning_merak.callbacks.delta.DeltaMemory` but the budget, the blocks
    and per-block overrides (documented there)."""

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
