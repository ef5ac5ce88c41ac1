"""DeepSpeed-MoE drop-in with Pro-Prophet placement, Lancet overlap and a FasterMoE baseline.

Names are imported on first use: the layer pulls in DeepSpeed, which the pure planner, the
cost model and the Hydra options do not need.
"""

from lightning_merak.util.lazy import lazy_attributes

_EXPORTS = {
    "CommCurve": ".core.placement_cost_model", "CostModel": ".core.placement_cost_model",
    "CostTerms": ".core.placement_cost_model",
    "TransferScheduler": ".executor",
    "ExpertGroups": ".groups", "carve_expert_groups": ".groups", "ensure_expert_groups": ".groups",
    "choose_chunks": ".core.lancet", "pipelined_time": ".core.lancet",
    "block_pipelined_time": ".core.lancet", "choose_block_chunks": ".core.lancet", "lancet_overlap": ".lancet_block",
    "MoE": ".layer", "MoEOptions": ".options", "PlacementMOELayer": ".layer",
    "Padding": ".core.placement", "PlacementPlan": ".core.placement", "Replication": ".core.placement",
    "block_rows": ".core.placement", "rank_loads": ".core.placement",
    "plan_pro_prophet": ".core.placement_planner",
    "profile_cost_model": ".cost_measurement",
    "plan_shadowing": ".core.shadowing",
    "PLAN_KINDS": ".core.step_planner", "PlannerSettings": ".core.step_planner", "StepChoice": ".core.step_planner",
    "choose_step_plan": ".core.step_planner", "predicted_plan": ".core.step_planner",
    "prefetch_pays": ".core.step_planner", "step_candidates": ".core.step_planner",
    "PlanCheck": ".core.plan_check", "chunk_times": ".core.lancet",
    "swap_sparse_moe_blocks": ".block_replacement",
    "moe_param_groups": ".optim",
    "enable_expert_parallel": ".experts.enable",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_attributes(__name__, _EXPORTS)
