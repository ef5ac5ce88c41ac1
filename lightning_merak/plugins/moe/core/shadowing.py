"""FasterMoE-style shadowing (PPoPP'22), the comparison baseline: hot experts to every rank.

Runs every step on the current counts. Experts are taken in order of global load
while the modelled latency keeps falling; each shadowed expert is broadcast to all
other ranks of the EP group, whose tokens for it then stay local.
"""

from __future__ import annotations

from lightning_merak.plugins.moe.core.placement import Counts, PlacementPlan, Replication, owner_of, validate_counts
from lightning_merak.plugins.moe.core.placement_cost_model import CostModel

__all__ = ["plan_shadowing"]


def plan_shadowing(counts: Counts, cost_model: CostModel) -> PlacementPlan:
    """FasterMoE's rule with this machine's constants instead of its hard-coded ones."""
    ep_size = len(counts)
    num_experts = len(counts[0]) if counts else 0
    validate_counts(counts, ep_size, num_experts)
    loads = [sum(counts[r][e] for r in range(ep_size)) for e in range(num_experts)]
    order = sorted(range(num_experts), key=lambda e: (-loads[e], e))
    per_token = 1.0 / cost_model.expert_tokens_per_s
    total_bytes = sum(loads) * cost_model.bytes_per_token
    send_feature = cost_model.all_to_all.time(total_bytes / max(ep_size, 1)) / max(sum(loads) / max(ep_size, 1), 1)
    send_model = cost_model.point_to_point.time(cost_model.expert_param_bytes)
    best = 3 * per_token * loads[order[0]] + 4 * send_feature * loads[order[0]] if order else 0.0
    shadowed: list[Replication] = []
    for i in range(num_experts - 1):
        nxt = loads[order[i + 1]]
        latency = 3 * per_token * nxt + 4 * send_feature * nxt + (i + 1) * send_model
        if latency >= best:
            break
        best = latency
        expert = order[i]
        owner = owner_of(expert, cost_model.experts_per_rank)
        shadowed.append(Replication(expert, owner, tuple(r for r in range(ep_size) if r != owner)))
    return PlacementPlan(num_experts, ep_size, tuple(shadowed) if ep_size > 1 else ())
