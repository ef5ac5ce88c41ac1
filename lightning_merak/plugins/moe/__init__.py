"""DeepSpeed-MoE drop-in with Pro-Prophet placement, Lancet overlap and a FasterMoE baseline.

Names are imported on first use: the layer pulls in DeepSpeed, which the pure planner, the
cost model and the Hydra options do not need.
"""

from lightning_merak.lazy import lazy_attributes

_EXPORTS = {
    "CommCurve": ".cost_model", "CostModel": ".cost_model", "CostTerms": ".cost_model",
    "TransferScheduler": ".executor",
    "ExpertGroups": ".groups", "carve_expert_groups": ".groups", "ensure_expert_groups": ".groups",
    "choose_chunks": ".lancet", "pipelined_time": ".lancet",
    "block_pipelined_time": ".lancet", "choose_block_chunks": ".lancet", "lancet_overlap": ".lancet_block",
    "MoE": ".layer", "MoEOptions": ".layer", "PlacementMOELayer": ".layer",
    "Padding": ".placement", "PlacementPlan": ".placement", "Replication": ".placement",
    "block_rows": ".placement", "rank_loads": ".placement",
    "plan_pro_prophet": ".planner",
    "profile_cost_model": ".profile",
    "plan_shadowing": ".shadowing",
    "swap_sparse_moe_blocks": ".swap",
    "moe_param_groups": ".optim",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_attributes(__name__, _EXPORTS)
