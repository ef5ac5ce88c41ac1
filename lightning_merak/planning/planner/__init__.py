"""Pure core of the merak3d layout planner (spec 1.6 and 1.7).

Plain Python over measured numbers: no process groups, no Lightning, no timing. A profiler
fills the records of :mod:`.profile`; :func:`plan` predicts every data x context x pipeline x
tensor layout with its micro-batches, tensor-parallel overlap degree and recompute ratio, and
picks the fastest that fits memory.
"""

from lightning_merak.planning.planner.attention import ContextAttention
from lightning_merak.planning.planner.cost_model import COMPONENTS, Layout, Prediction, micro_batch_samples, predict
from lightning_merak.planning.planner.experts import ExpertLayers
from lightning_merak.planning.planner.overlap import OverlapResult, simulate_overlapped_chain
from lightning_merak.planning.planner.profile import (
    BlockTimes,
    CollectiveCost,
    MeasuredBlocks,
    ModelProfile,
    NetworkProfile,
    SearchSpace,
    average_profiles,
    fit_collective_cost,
    fit_pipeline_runtime,
)
from lightning_merak.planning.planner.search import (
    Plan,
    ProfileKeys,
    candidate_layouts,
    plan,
    required_profile_keys,
    rerank,
)
from lightning_merak.planning.planner.step_check import BatchClock, StepTimeCheck

__all__ = [
    "COMPONENTS",
    "BatchClock",
    "BlockTimes",
    "CollectiveCost",
    "ContextAttention",
    "ExpertLayers",
    "Layout",
    "MeasuredBlocks",
    "ModelProfile",
    "NetworkProfile",
    "OverlapResult",
    "Plan",
    "Prediction",
    "ProfileKeys",
    "SearchSpace",
    "StepTimeCheck",
    "average_profiles",
    "candidate_layouts",
    "fit_collective_cost",
    "fit_pipeline_runtime",
    "micro_batch_samples",
    "plan",
    "predict",
    "required_profile_keys",
    "rerank",
    "simulate_overlapped_chain",
]
