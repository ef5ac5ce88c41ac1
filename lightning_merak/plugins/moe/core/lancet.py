"""Lancet's chunk count: simulate the pipelined MoE layer for k ∈ {1, 2, 4, 8}, keep the fastest.

Simulator (Lancet §1.5, range limited to the MoE layer): chunk c's dispatch, expert
compute and combine are stages; a stage starts when its dependency ends and the
previous op of its kind (the link, or the compute unit) is free. All-to-alls are
issued in the executor's order D0, D1, C0, D2, C1, ... and share one link.

Block scope (:func:`block_pipelined_time`) widens the range to the decoder block: the
batch runs as k sub-batches through the block's dense computation (attention), the
joint gate (which needs every sub-batch's logits), dispatch, experts and combine, and a
sub-batch's combine overlaps the other sub-batches' experts and next dense computation.
"""

from __future__ import annotations

from lightning_merak.plugins.moe.core.placement import Counts, Padding, PlacementPlan, rank_loads
from lightning_merak.plugins.moe.core.placement_cost_model import CostModel

__all__ = ["CHUNK_CHOICES", "block_pipelined_time", "choose_block_chunks", "choose_chunks", "chunk_times",
           "pipelined_time", "simulated_block_time"]

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


def chunk_times(cost_model: CostModel, counts: Counts, plan: PlacementPlan, padding: Padding) -> dict[int, float]:
    """Simulated forward seconds of the layer for each chunk count of :data:`CHUNK_CHOICES`."""
    loads = rank_loads(counts, plan, padding, cost_model.experts_per_rank)
    traffic_bytes = max(max(s, r) for s, r in zip(loads.sent, loads.received)) * cost_model.bytes_per_token
    compute_s = max(loads.computed) / cost_model.expert_tokens_per_s
    return {chunks: pipelined_time(cost_model.all_to_all.time(traffic_bytes / chunks), compute_s / chunks, chunks)
            for chunks in CHUNK_CHOICES}


def choose_chunks(cost_model: CostModel, counts: Counts, plan: PlacementPlan, padding: Padding) -> int:
    """The chunk count with the least simulated forward time; ties go to fewer chunks.

    Chunks pay only by overlapping all-to-alls with expert compute: where the measured all-to-all
    overlap efficiency is under one half (an oversubscribed CPU), one chunk.
    """
    if cost_model.all_to_all_overlap_efficiency < 0.5:
        return 1
    best, best_time = 1, float("inf")
    for chunks, simulated in chunk_times(cost_model, counts, plan, padding).items():
        if simulated < best_time - 1e-12:
            best, best_time = chunks, simulated
    return best


def block_pipelined_time(dense_s: float, all_to_all_s: float, expert_s: float, chunks: int, blocks: int = 2) -> float:
    """Forward time of ``blocks`` decoder blocks run as ``chunks`` sub-batches (times are per sub-batch).

    The compute unit runs each block's dense parts of sub-batches 0…k−1, then their experts;
    the link carries the dispatches 0…k−1 (after the joint gate, i.e. after the last dense
    part), then each combine once its experts are done. Sub-batch i enters the next block
    when its combine has arrived.
    """
    if chunks < 1 or blocks < 1:
        raise ValueError(f"chunks={chunks} and blocks={blocks} must be at least 1")
    compute_free = link_free = 0.0
    ready = [0.0] * chunks
    for _ in range(blocks):
        dense_end = []
        for c in range(chunks):
            compute_free = max(compute_free, ready[c]) + dense_s
            dense_end.append(compute_free)
        gated = max(dense_end)
        dispatch_end = []
        for _c in range(chunks):
            link_free = max(link_free, gated) + all_to_all_s
            dispatch_end.append(link_free)
        for c in range(chunks):
            compute_free = max(compute_free, dispatch_end[c]) + expert_s
            link_free = max(link_free, compute_free) + all_to_all_s
            ready[c] = link_free
    return max(ready)


def simulated_block_time(
    cost_model: CostModel, counts: Counts, plan: PlacementPlan, dense_s: float, chunks: int, blocks: int = 2,
    sub_batch_overhead_s: float = 0.0,
) -> float:
    """:func:`block_pipelined_time` for ``chunks`` sub-batches of a measured block under ``counts`` and ``plan``.

    ``dense_s`` is the measured dense (non-MoE) forward time of one block on the whole
    batch; sub-batches exchange their kept routes only, so traffic is priced unpadded.
    ``sub_batch_overhead_s`` is what each sub-batch adds per block beyond its share of the
    work (switching turns, smaller kernels), measured by :class:`~.lancet_block.LancetBlockForward`.
    """
    if dense_s < 0 or sub_batch_overhead_s < 0:
        raise ValueError(f"dense_s={dense_s} and sub_batch_overhead_s={sub_batch_overhead_s} must be >= 0")
    loads = rank_loads(counts, plan, Padding("dropless"), cost_model.experts_per_rank)
    traffic_bytes = max(max(s, r) for s, r in zip(loads.sent, loads.received)) * cost_model.bytes_per_token
    expert_s = max(loads.computed) / cost_model.expert_tokens_per_s
    per_chunk = cost_model.all_to_all.time(traffic_bytes / chunks)
    return block_pipelined_time(dense_s / chunks + sub_batch_overhead_s, per_chunk, expert_s / chunks, chunks, blocks)


def choose_block_chunks(
    cost_model: CostModel, counts: Counts, plan: PlacementPlan, dense_s: float, batch: int, blocks: int = 2,
    sub_batch_overhead_s: float = 0.0,
) -> int:
    """The sub-batch count (dividing ``batch``) with the least simulated block time; ties go to fewer."""
    if dense_s < 0 or batch < 1:
        raise ValueError(f"dense_s={dense_s} must be >= 0 and batch={batch} >= 1")
    best, best_time = 1, float("inf")
    for chunks in CHUNK_CHOICES:
        if batch % chunks:
            continue
        simulated = simulated_block_time(cost_model, counts, plan, dense_s, chunks, blocks, sub_batch_overhead_s)
        if simulated < best_time - 1e-12:
            best, best_time = chunks, simulated
    return best
