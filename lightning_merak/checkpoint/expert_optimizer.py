"""The expert optimizer state a Lightning checkpoint of expert-parallel MoE layers keeps for every EP rank.

Lightning writes rank 0's optimizer state alone; under DDP the MoE callback
(:class:`~lightning_merak.callbacks.moe.placement.MoEPlacementCallback`) adds every EP rank's expert state under
:data:`EXPERT_OPTIMIZER_KEY`, with the ``ep_size`` that spread the experts. A run at another ``ep_size`` holds
other experts on each rank and cannot take that state (the experts' weights, saved whole, load at any); merak-train
refuses it before launch (:func:`lightning_merak.checkpoint.compatible.check_resume_expert_parallel`), the callback
again when it restores.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from torch import nn

from lightning_merak.protocols.experts import ExpertParallelLayer

__all__ = ["EXPERT_OPTIMIZER_KEY", "expert_parallel_size", "saved_expert_parallel_size"]

EXPERT_OPTIMIZER_KEY = "moe_expert_optimizer_states"
"""Where a checkpoint keeps ``{"ep_size": ..., "states": [per optimizer: per EP rank: its expert states]}``."""


def expert_parallel_size(module: nn.Module) -> int:
    """The ``ep_size`` of ``module``'s first MoE layer that spreads its experts over ranks; 1 where none does."""
    return next((layer.ep_size for layer in module.modules()
                 if isinstance(layer, ExpertParallelLayer) and layer.ep_size > 1), 1)


def saved_expert_parallel_size(checkpoint: Mapping[str, Any]) -> Optional[int]:
    """The ``ep_size`` ``checkpoint``'s expert optimizer state was saved with; None where a resume restores none
    (no such state, or no optimizer state at all: a weights-only save)."""
    saved = checkpoint.get(EXPERT_OPTIMIZER_KEY)
    if saved is None or "optimizer_states" not in checkpoint:
        return None
    return int(saved["ep_size"])
