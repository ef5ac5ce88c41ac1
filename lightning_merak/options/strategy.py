"""Hydra options of the ``strategy`` group that need typed arguments (``strategy=merak3d``)."""

from __future__ import annotations

from dataclasses import dataclass
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

    def strategy_kwargs(self) -> dict[str, Any]:
        return {
            "data_parallel": self.data_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "tensor_parallel": self.tensor_parallel,
            "tp_overlap": self.tp_overlap,
            "tp_weight_grad_overlap": self.tp_weight_grad_overlap,
            "sequence_parallel": self.sequence_parallel,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "recompute": self.recompute,
            "recompute_ratio": self.recompute_ratio,
            "partition": self.partition,
            "timeout_s": self.timeout_s,
            "memory_limit": self.memory_limit,
            "plan_only": self.plan_only,
            **self.kwargs,
        }


def register() -> None:
    """Register ``strategy=merak3d``'s schema (called by the project's config setup)."""
    register_option("strategy", "merak3d", Merak3DStrategyConfig)
