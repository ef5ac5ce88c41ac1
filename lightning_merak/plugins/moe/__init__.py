"""DeepSpeed-MoE drop-in with Pro-Prophet placement, Lancet overlap and a FasterMoE baseline."""

from lightning_merak.plugins.moe.cost_model import CommCurve, CostModel, CostTerms
from lightning_merak.plugins.moe.executor import TransferScheduler
from lightning_merak.plugins.moe.groups import ExpertGroups, carve_expert_groups, ensure_expert_groups
from lightning_merak.plugins.moe.lancet import choose_chunks, pipelined_time
from lightning_merak.plugins.moe.layer import MoE, MoEOptions, PlacementMOELayer
from lightning_merak.plugins.moe.placement import Padding, PlacementPlan, Replication, block_rows, rank_loads
from lightning_merak.plugins.moe.planner import plan_pro_prophet
from lightning_merak.plugins.moe.profile import profile_cost_model
from lightning_merak.plugins.moe.shadowing import plan_shadowing

__all__ = [
    "CommCurve",
    "CostModel",
    "CostTerms",
    "ExpertGroups",
    "MoE",
    "MoEOptions",
    "Padding",
    "PlacementMOELayer",
    "PlacementPlan",
    "Replication",
    "TransferScheduler",
    "block_rows",
    "carve_expert_groups",
    "choose_chunks",
    "ensure_expert_groups",
    "pipelined_time",
    "plan_pro_prophet",
    "plan_shadowing",
    "profile_cost_model",
    "rank_loads",
]
