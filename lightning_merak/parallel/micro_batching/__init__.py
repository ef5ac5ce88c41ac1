"""Variable-length micro-batches for merak3d (DynaPipe, arXiv 2311.10418): ``strategy.micro_batching``.

Data keeps each sample's own length (``data.lengths=variable``) and arrives as global batches
(:class:`~.samples.VariableBatch`), the same on every rank. Each step plans them into micro-batches
(:mod:`.plan`, pure Python): ``pad`` (equal sample counts, padded to the longest), ``pack`` (rows of
``micro_batch_tokens`` tokens, documents kept apart by restarting positions) or ``dynamic`` (DynaPipe's
dynamic programme over a cost model and a token limit, balanced over data-parallel replicas by
Karmarkar–Karp). Pipeline stages exchange the changing shapes
(:mod:`lightning_merak.strategies.merak3d.variable_step`); the loss is the mean
over the real tokens of the whole global batch in every mode.
"""

from lightning_merak.parallel.micro_batching.options import MODES, MicroBatching
from lightning_merak.parallel.micro_batching.plan import (
           CostModel,
           MicroBatch,
           StepPlan,
           plan_dynamic,
           plan_packed,
           plan_padded,
)
from lightning_merak.parallel.micro_batching.samples import TASK_MIX, GlobalBatches, VariableBatch, multi_task_lengths

__all__ = ["MODES", "TASK_MIX", "CostModel", "GlobalBatches", "MicroBatch", "MicroBatching", "StepPlan",
           "VariableBatch", "multi_task_lengths", "plan_dynamic", "plan_packed", "plan_padded"]
