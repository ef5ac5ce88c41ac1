"""DeepSpeed-MoE drop-in with Pro-Prophet placement, Lancet overlap and a FasterMoE baseline.

Names are imported on first use: the layer pulls in DeepSpeed, which the pure planner, the
cost model and the Hydra options do not need.
"""

from lightning_merak.lazy import lazy_attributes

_EXPORTS = {
    "CommCurve": ".placement_cost_model", "CostModel": ".placement_cost_model", "CostTerms": ".placement_cost_model",
    "TransferScheduler": ".executor",
    "ExpertGroups": ".groups", "carve_expert_groups": ".groups", "ensure_expert_groups": ".groups",
    "choose_chunks": ".lancet", "pipelined_time": ".lancet",
    "block_pipelined_time": ".lancet", "choose_block_chunks": ".lancet", "lancet_overlap": ".lancet_block",
    "MoE": ".layer", "MoEOptions": ".options", "PlacementMOELayer": ".layer",
    "Padding": ".placement", "PlacementPlan": ".placement", "Replication": ".placement",
    "block_rows": ".placement", "rank_loads": ".placement",
    "plan_pro_prophet": ".placement_planner",
    "profile_cost_model": ".cost_measurement",
    "plan_shadowing": ".shadowing",
    "swap_sparse_moe_blocks": ".block_replacement",
    "moe_param_groups": ".optim",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_attributes(__name__, _EXPORTS)
