"""Hydra options of the ``strategy`` group that need typed arguments (``strategy=merak3d``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from lightning_merak.config import StrategyConfig, register_option

__all__ = ["Merak3DStrategyConfig", "register"]


@dataclass
class Merak3DStrategyConfig(StrategyConfig):
    """``strategy=merak3d``: every argument of :class:`~lightning_merak.strategies.merak3d.Merak3DStrategy`.

    Degrees take an integer or ``auto``; ``pipeline_parallel``, ``tensor_parallel``,
    ``tp_overlap`` or ``recompute`` set to ``auto`` run the layout planner, and
    ``plan_only=true`` prints the planned layout and exits.
    """

    name: str = "merak3d"
    data_parallel: Any = "auto"
    pipeline_parallel: Any = 1
    tensor_parallel: Any = 1
    tp_overlap: Any = 1
    tp_weight_grad_overlap: Optional[bool] = None
    sequence_parallel: bool = False
    micro_batches: Optional[int] = None
    schedule: str = "1f1b"
    virtual_stages: int = 2
    recompute: str = "none"
    recompute_ratio: float = 0.5
    partition: str = "autopipe"
    timeout_s: float = 600.0
    memory_limit: Optional[float] = None
    plan_only: bool = False
    vocab_parallel: bool = True

    def strategy_kwargs(self) -> dict[str, Any]:
        """Every field but the option's name, as constructor arguments, with ``kwargs`` on top."""
        own = {item.name: getattr(self, item.name) for item in fields(self) if item.name not in ("name", "kwargs")}
        return {**own, **self.kwargs}


def register() -> None:
    """Register ``strategy=merak3d``'s schema (called by the project's config setup)."""
    register_option("strategy", "merak3d", Merak3DStrategyConfig)
