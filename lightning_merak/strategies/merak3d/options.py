"""``Merak3DStrategy``'s options, declared once: every argument with its default (plain Python, no torch).

:class:`~lightning_merak.strategies.merak3d.arguments.Merak3DArguments` extends it with the checks; the Hydra
schema of ``strategy=merak3d`` (:mod:`lightning_merak.cli.options.strategy`) takes its fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

__all__ = ["Degree", "Merak3DOptions"]

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
