"""``strategy=merak3d``: the strategy's options, declared once, and the Hydra schema derived from them.

:class:`Merak3DOptions` (plain Python, no torch) holds every argument of
:class:`~lightning_merak.strategies.merak3d.Merak3DStrategy` with its default;
:class:`~lightning_merak.strategies.merak3d.arguments.Merak3DArguments` extends it with the checks,
and the Hydra schema :class:`Merak3DStrategyConfig` takes its fields (degrees, which may be
``"auto"``, become ``Any`` there).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, Optional, Union

from lightning_merak.config import StrategyConfig, register_option
from lightning_merak.options.schema import schema_of

__all__ = ["Degree", "Merak3DOptions", "Merak3DStrategyConfig", "register"]

Degree = Union[int, Literal["auto"]]


@dataclass(frozen=True)
class Merak3DOptions:
    """``Merak3DStrategy``'s arguments and their defaults (documented on the strategy)."""

    data_parallel: Degree = "auto"
    pipeline_parallel: Degree = 1
    tensor_parallel: Degree = 1
    tp_overlap: Degree = 1
    tp_weight_grad_overlap: Optional[bool] = None
    sequence_parallel: bool = False
    micro_batches: Optional[int] = None
    schedule: str = "1f1b"
    virtual_stages: int = 2
    recompute: str = "none"
    recompute_ratio: float = 0.5
    partition: str = "autopipe"
    process_group_backend: Optional[str] = None
    timeout_s: float = 600.0
    memory_limit: Optional[float] = None
    plan_only: bool = False
    planner_calibration: str = "analytic"
    vocab_parallel: bool = True
    compact_host_memory: bool = False
    data_parallel_sharding: str = "none"
    data_parallel_shard_size: Optional[int] = None
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    grad_bucket_mb: Optional[float] = None
    micro_batching: str = "none"
    micro_batch_tokens: Optional[int] = None
    micro_batching_cost: Optional[tuple[float, float, float]] = None


_Merak3DFields = schema_of(Merak3DOptions, "_Merak3DFields")


@dataclass
class Merak3DStrategyConfig(_Merak3DFields, StrategyConfig):  # type: ignore[misc,valid-type]
    """``strategy=merak3d``: every argument of :class:`~lightning_merak.strategies.merak3d.Merak3DStrategy`.

    Degrees take an integer or ``auto``; ``pipeline_parallel``, ``tensor_parallel``,
    ``tp_overlap`` or ``recompute`` set to ``auto`` run the layout planner, and
    ``plan_only=true`` prints the planned layout and exits.
    """

    name: str = "merak3d"

    def strategy_kwargs(self) -> dict[str, Any]:
        """Every option as a constructor argument, with ``kwargs`` on top."""
        own = {item.name: getattr(self, item.name) for item in fields(Merak3DOptions)}
        return {**own, **self.kwargs}


def register() -> None:
    """Register ``strategy=merak3d``'s schema (called by the project's config setup)."""
    register_option("strategy", "merak3d", Merak3DStrategyConfig)
