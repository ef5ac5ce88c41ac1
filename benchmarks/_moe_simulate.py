"""The *simulated* 8–64-rank table: the cost model calibrated in the emulated run, on the same routings.

One expert per rank. Per step the policies are priced as the layer runs them: DeepSpeed-MoE
(padded to the largest block), dropless dispatch, our FasterMoE-style shadowing planned from the step's
counts (one chunk), and ours (the step planner, prefetching the previous step's plan only where the model
says it pays, as :meth:`PlacementMOELayer._plan_next` does). Nothing here is measured. The cost model is
the one ours calibrated in the emulated run, whose ranks (more than cores) each ran under a fixed CPU quota
(``rank_cpu`` in the JSON), so its expert rate is one rank's own, as on a device. The simulated ranks have a
device each, so any lone-rank expert rate calibrated beside it (ranks lending cores) is left out: an
imbalance costs its busiest rank's rows at the shared rate.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from benchmarks._moe_routing import Routing, routing_counts

__all__ = ["cost_model_from", "simulate"]


def cost_model_from(data: dict[str, Any], experts_per_rank: int | None = None) -> Any:
    from lightning_merak.plugins.moe import CommCurve, CostModel

    return CostModel(
        all_to_all=CommCurve(tuple(data["all_to_all"]["sizes_bytes"]), tuple(data["all_to_all"]["seconds"])),
        point_to_point=CommCurve(tuple(data["point_to_point"]["sizes_bytes"]),
                                 tuple(data["point_to_point"]["seconds"])),
        expert_tokens_per_s=data["expert_tokens_per_s"], bytes_per_token=data["bytes_per_token"],
        expert_param_bytes=data["expert_param_bytes"],
        experts_per_rank=experts_per_rank or data["experts_per_rank"],
        overlap_efficiency=data.get("overlap_efficiency", 1.0),
        all_to_all_overlap_efficiency=data.get("all_to_all_overlap_efficiency", 1.0),
    )


def _ours(counts_per_step: Sequence[list[list[int]]], cost: Any) -> tuple[list[float], list[float], list[str]]:
    from lightning_merak.plugins.moe import (
        Padding,
        PlannerSettings,
        choose_step_plan,
        predicted_plan,
        prefetch_pays,
        rank_loads,
    )

    settings, padding = PlannerSettings(), Padding("dropless")
    times, ratios, kinds = [], [], []
    previous, prefetched = None, None
    for counts in counts_per_step:
        choice = choose_step_plan(counts, cost, padding, settings, prefetched=prefetched)
        times.append(choice.predicted_s)
        loads = rank_loads(counts, choice.plan, padding, 1).computed
        ratios.append(max(loads) / statistics.mean(loads))
        kinds.append(f"{choice.kind}/{choice.timing}")
        pays = previous is not None and prefetch_pays(counts, cost, previous[1], padding, choice.best_current_s)
        previous = predicted_plan(counts, cost, padding, settings)
        prefetched = previous if pays and previous is not None else None
    return times, ratios, kinds


def simulate(cost_data: dict[str, Any], tokens_per_rank: int, routings: Sequence[Routing], steps: int,
             ranks: Sequence[int] = (8, 16, 32, 64)) -> list[dict[str, Any]]:
    """Per configuration (ranks × routing): each policy's predicted MoE-layer time per step (the mean, so that a
    ratio of two is the ratio of their times over all steps), and per step the load max/mean of tokens computed
    per rank, for ours and for dropless dispatch (the same loads as no replication)."""
    from lightning_merak.plugins.moe import Padding, PlacementPlan, plan_shadowing, rank_loads

    cost = cost_model_from(cost_data, experts_per_rank=1)
    rows = []
    for world in ranks:
        for routing in routings:
            series = [routing_counts(routing, world, world, tokens_per_rank, step) for step in range(steps)]
            empty = PlacementPlan(world, world)
            deepspeed = statistics.mean(cost.total(c, empty, Padding("max")) for c in series)
            dropless = statistics.mean(cost.total(c, empty, Padding("dropless")) for c in series)
            shadowing = statistics.mean(cost.total(c, plan_shadowing(c, cost), Padding("dropless"), "current")
                                     for c in series)
            times, ratios, kinds = _ours(series, cost)
            ours = statistics.mean(times)
            dropless_ratios = [max(loads) / statistics.mean(loads)
                               for loads in (rank_loads(c, empty, Padding("dropless"), 1).computed for c in series)]
            rows.append({
                "ranks": world, "routing": routing.label, "deepspeed_ms": 1000 * deepspeed,
                "dropless_ms": 1000 * dropless, "shadowing_ms": 1000 * shadowing, "ours_ms": 1000 * ours,
                "ours_over_best_baseline": min(deepspeed, dropless, shadowing) / ours,
                "ours_worst_step_max_over_mean": max(ratios),
                "dropless_worst_step_max_over_mean": max(dropless_ratios),
                "ours_kinds": {k: kinds.count(k) for k in sorted(set(kinds))},
            })
    return rows
