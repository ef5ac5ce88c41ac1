"""Pipeline parallelism: a pure core (exported here) and the runtime merak3d builds on it.

Pure core, plain Python over per-block costs (no process groups, no Lightning): ``costs``,
``partition``, ``recompute``, ``simulate``, ``timeline`` (imported on first use: matplotlib) — the
partitioners and the schedule simulator (spec sections 1.2-1.5). Runtime, imported by merak3d
directly: ``recording``, ``trace`` and ``meta_trace`` (recording one forward), ``stage`` (stage
modules cut from the model) and ``schedules`` (torch.distributed.pipelining stages and schedules).
"""

from lightning_merak.parallel.pipeline.costs import (
    DEFAULT_BACKWARD_RATIO,
    BlockCost,
    Partition,
    VocabularyShare,
    build_partition,
    optimizer_delays_s,
    split_vocabulary_head,
    with_optimizer_seconds,
)
from lightning_merak.parallel.pipeline.partition import (
    CARRY_FAN_OUT_THRESHOLD,
    estimate_stage_memory_bytes,
    estimate_stage_recompute_s,
    high_fan_out_nodes,
    merge_skip_connections,
    partition_autopipe,
    partition_by_parameters,
    partition_min_max,
    partition_uniform,
    predicted_step_s,
)
from lightning_merak.parallel.pipeline.recompute import blocks_to_recompute, stage_aware_recompute_ratios
from lightning_merak.parallel.pipeline.simulate import (
    SCHEDULES,
    ScheduledOp,
    SimulationResult,
    peak_inflight_microbatches,
    simulate_schedule,
    stage_op_order,
)
from lightning_merak.util.lazy import lazy_attributes

__all__ = [
    "CARRY_FAN_OUT_THRESHOLD",
    "DEFAULT_BACKWARD_RATIO",
    "SCHEDULES",
    "BlockCost",
    "Partition",
    "ScheduledOp",
    "SimulationResult",
    "VocabularyShare",
    "blocks_to_recompute",
    "build_partition",
    "estimate_stage_memory_bytes",
    "estimate_stage_recompute_s",
    "high_fan_out_nodes",
    "merge_skip_connections",
    "optimizer_delays_s",
    "partition_autopipe",
    "partition_by_parameters",
    "partition_min_max",
    "partition_uniform",
    "peak_inflight_microbatches",
    "plot_timeline",
    "predicted_step_s",
    "simulate_schedule",
    "split_vocabulary_head",
    "stage_aware_recompute_ratios",
    "stage_op_order",
    "with_optimizer_seconds",
]

__getattr__ = lazy_attributes(__name__, {"plot_timeline": ".timeline"})  # matplotlib, on first use
