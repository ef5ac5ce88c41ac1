"""``merak-train faults.*``: what a run does on a hang, a lost rank and a non-finite step.

One typed node of the root config, not a group of alternatives: every run has these settings.

    merak-train faults.collective_timeout_s=60        # a hang ends every rank after 60 s, naming who is missing
    merak-train faults.nonfinite=stop                 # stop at the first NaN/inf loss or gradient, naming the step
    merak-train faults.collective_timeout_s=null      # no watchdog (no lost-rank message either)

Declared here, light to import; the callbacks are imported when a run builds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from lightning_merak.util.fields import option

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FaultsConfig"]

_NONFINITE = ("skip", "stop", "off")


@dataclass
class FaultsConfig:
    """Fault handling of a ``merak-train`` run (each field's description is its ``metadata["help"]``)."""

    collective_timeout_s: Optional[float] = option(
        120.0, "A collective waiting this long with none completing ends every rank (`null`: no watchdog). The "
        "message names the collective, its group and the ranks that did not arrive; gloo alone waits 10-30 "
        "minutes, silently.")
    dead_after_s: float = option(
        15.0, "A rank whose heartbeat is silent this long is lost: survivors stop, naming it and the newest "
        "complete checkpoint. A rank on the same host is seen at once when its process ends.")
    nonfinite: str = option(
        "skip", "On a NaN/inf loss or gradient on any rank: `skip` the step (on every rank, counted in "
        "`nonfinite/skipped`), `stop` the run naming the step, or `off`.")
    max_skipped: Optional[int] = option(
        10, "With `skip`, stop after this many skipped steps in a row (`null`: never).")

    def __post_init__(self) -> None:
        if self.collective_timeout_s is not None and self.collective_timeout_s <= 0:
            raise ValueError(f"faults.collective_timeout_s={self.collective_timeout_s} must be positive, or null "
                             "to turn the watchdog off")
        if self.dead_after_s <= 0:
            raise ValueError(f"faults.dead_after_s={self.dead_after_s} must be positive")
        if self.nonfinite not in _NONFINITE:
            raise ValueError(f"faults.nonfinite={self.nonfinite!r} must be one of {', '.join(_NONFINITE)}")
        if self.max_skipped is not None and self.max_skipped < 1:
            raise ValueError(f"faults.max_skipped={self.max_skipped} must be at least 1, or null (never stop)")

    def build_callbacks(self) -> list[pl.Callback]:
        """The watchdog and the non-finite guard, as configured."""
        callbacks: list[pl.Callback] = []
        if self.collective_timeout_s is not None:
            from lightning_merak.callbacks.faults import FaultWatch  # lazy: torch, Lightning

            callbacks.append(FaultWatch(self.collective_timeout_s, self.dead_after_s,
                                        timeout_option="faults.collective_timeout_s"))
        if self.nonfinite != "off":
            from lightning_merak.callbacks.nonfinite import NonFiniteGuard  # lazy: torch, Lightning

            callbacks.append(NonFiniteGuard(self.nonfinite, self.max_skipped))  # type: ignore[arg-type]
        return callbacks
