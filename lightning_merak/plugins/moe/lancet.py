"""Lancet's chunk count: simulate the pipelined MoE layer for k ∈ {1, 2, 4, 8}, keep the fastest.

Simulator (Lancet §1.5, range limited to the MoE layer): chunk c's dispatch, expert
compute and combine are stages; a stage starts when its dependency ends and the
previous op of its kind (the link, or the compute unit) is free. All-to-alls are
issued in the executor's order D0, D1, C0, D2, C1, ... and share one link.
"""

from __future__ import annotations

from lightning_merak.plugins.moe.cost_model import CostModel
from lightning_merak.plugins.moe.placement import Counts, Padding, PlacementPlan, rank_loads

__all__ = ["CHUNK_CHOICES", "choose_chunks", "pipelined_time"]

CHUNK_CHOICES = (1, 2, 4, 8)


def pipelined_time(all_to_all_s: float, compute_s: float, chunks: int) -> float:
    """Forward time of one layer split ``chunks`` ways (``all_to_all_s`` is one chunk's all-to-all)."""
    link_free = 0.0
    compute_free = 0.0
    dispatch_end = [0.0] * chunks
    combine_end = 0.0
    issue = [("D", 0)]
    for c in range(chunks):
        if c + 1 < chunks:
            issue.append(("D", c + 1))
        issue.append(("C", c))
    compute_end = [0.0] * chunks
    for kind, c in issue:
        if kind == "D":
            dispatch_end[c] = link_free + all_to_all_s
            link_free = dispatch_end[c]
        else:
            compute_end[c] = max(dispatch_end[c], compute_free) + compute_s
            compute_free = compute_end[c]
            combine_end = max(compute_end[c], link_free) + all_to_all_s
            link_free = combine_end
    return combine_end


def choose_chunks(cost_model: CostModel, counts: Counts, plan: PlacementPlan, padding: Padding) -> int:
    """The chunk count with the least simulated forward time; ties go to fewer chunks."""
    loads = rank_loads(counts, plan, padding, cost_model.experts_per_rank)
    traffic_bytes = max(max(s, r) for s, r in zip(loads.sent, loads.received)) * cost_model.bytes_per_token
    compute_s = max(loads.computed) / cost_model.expert_tokens_per_s
    best, best_time = 1, float("inf")
    for chunks in CHUNK_CHOICES:
        per_chunk = cost_model.all_to_all.time(traffic_bytes / chunks)
        simulated = pipelined_time(per_chunk, compute_s / chunks, chunks)
        if simulated < best_time - 1e-12:
            best, best_time = chunks, simulated
    return best
