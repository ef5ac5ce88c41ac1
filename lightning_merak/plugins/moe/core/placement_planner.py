"""Pro-Prophet's greedy locality-based placement search (Algorithm 1), per layer.

Deterministic: integer counts, fixed iteration order, ties to the lowest index, and
float costs computed identically from identical inputs, so every rank of an EP
group derives the same plan from the same all-gathered counts.
"""

from __future__ import annotations

from typing import Sequence

from lightning_merak.plugins.moe.core.placement import (
    Counts,
    Padding,
    PlacementPlan,
    RankLoads,
    Replication,
    block_rows,
    owner_of,
    rank_loads,
    replica_rows,
    validate_counts,
)
from lightning_merak.plugins.moe.core.placement_cost_model import CostModel, TransferTiming

__all__ = ["plan_pro_prophet"]


class _LoadMemo:
    """:func:`rank_loads` per plan for one count matrix and padding.

    The three greedy runs share their first prefixes and every prefix is priced and then measured for
    balance, so one search asked for the same plan's loads several times, on the critical path between
    the count exchange and the dispatch.
    """

    def __init__(self, counts: Counts, padding: Padding, experts_per_rank: int) -> None:
        self.counts, self.padding, self.experts_per_rank = counts, padding, experts_per_rank
        self._loads: dict[PlacementPlan, RankLoads] = {}

    def __call__(self, plan: PlacementPlan) -> RankLoads:
        loads = self._loads.get(plan)
        if loads is None:
            loads = self._loads[plan] = rank_loads(self.counts, plan, self.padding, self.experts_per_rank)
        return loads


def _balancing_replicas(
    expert: int,
    owner: int,
    eligible: Sequence[int],
    counts: Counts,
    plan: PlacementPlan,
    padding: Padding,
    computed: Sequence[int],
) -> tuple[int, ...]:
    """The eligible senders that should compute their own rows of ``expert``.

    A sender ``r`` taking its rows moves them off the owner: the owner computes its
    current block from ``r`` less, ``r`` computes ``replica_rows`` more. Senders are
    added lightest resulting load first while that load stays below the owner's
    remaining load, so every addition lowers the larger of the two and no replica
    rank ends up heavier than the owner was. Replicating to every sender instead
    moves all of a hot expert's remote rows at once and can overshoot: the owner
    becomes the lightest rank and the senders, already busy, the heaviest. Returned
    in the order added.
    """
    added = {r: replica_rows(counts, r, expert, padding) for r in eligible}
    # A sender's block is what it would compute as a replica, except under "max" padding (the plan's largest block).
    if padding.mode == "max":
        rows = block_rows(counts, plan, padding)
        removed = {r: rows[r][expert] for r in eligible}
    else:
        removed = added
    owner_load = computed[owner]
    replicas = []
    for r in sorted(eligible, key=lambda r: (computed[r] + added[r], r)):
        if computed[r] + added[r] >= owner_load:
            break
        replicas.append(r)
        owner_load -= removed[r]
    return tuple(replicas)


def _cheapest_prefix(
    expert: int, owner: int, replicas: Sequence[int], chosen: list[Replication], counts: Counts,
    cost_model: CostModel, padding: Padding, timing: TransferTiming, loads: _LoadMemo,
) -> tuple[int, ...]:
    """The first ``j`` of ``replicas`` (in the order added) that the cost model prices lowest.

    Every replica is one copy from the owner, so its link carries them one after another: past a few
    ranks a larger set costs more in copies than it saves in the owner's rows (16 simulated ranks,
    400 Mbit/s: 11 copies of the hottest expert priced 433 ms against 382 for no replication). A set of
    one replica (every set at two ranks) is its own only prefix."""
    if len(replicas) <= 1:
        return tuple(replicas)
    num_experts, ep_size = len(counts[0]), len(counts)
    best: tuple[float, tuple[int, ...]] | None = None
    for j in range(1, len(replicas) + 1):
        prefix = tuple(sorted(replicas[:j]))
        trial = PlacementPlan(num_experts, ep_size, (*chosen, Replication(expert, owner, prefix)))
        time = cost_model.total(counts, trial, padding, timing, loads(trial))
        if best is None or time < best[0]:
            best = (time, prefix)
    return best[1] if best is not None else ()


def _greedy_path(
    counts: Counts,
    cost_model: CostModel,
    padding: Padding,
    threshold: float,
    exclude_fewest: int,
    slots_per_rank: int | None,
    balancing: bool,
    loads: _LoadMemo,
    timing: TransferTiming | None = None,
) -> list[PlacementPlan]:
    """Every prefix of one greedy run, shortest first.

    Each step takes the heaviest rank and its unused expert with the most remote
    load. The candidate replica ranks are that expert's senders, less the
    ``exclude_fewest`` lightest senders (the paper's n) and ranks whose
    ``slots_per_rank`` budget is full. The paper replicates to all of them; with
    ``balancing`` only those that lower the load maximum get a replica; with a
    ``timing`` too, only as many of them as the cost model prices lowest with
    transfers issued that way. Stops when
    max−min load < ``threshold``, when the heaviest rank has nothing left to
    replicate, or when no slot is free.
    """
    ep_size = len(counts)
    num_experts = len(counts[0])
    per_rank = cost_model.experts_per_rank
    chosen: list[Replication] = []
    prefixes: list[PlacementPlan] = []
    used: set[int] = set()
    slots = [0] * ep_size
    while len(used) < num_experts:
        plan = PlacementPlan(num_experts, ep_size, tuple(chosen))
        computed = loads(plan).computed
        if max(computed) - min(computed) < threshold:
            break
        heaviest = computed.index(max(computed))
        candidates = [
            e for e in range(heaviest * per_rank, (heaviest + 1) * per_rank)
            if e not in used and any(counts[r][e] for r in range(ep_size) if r != heaviest)
        ]
        if not candidates:
            break
        expert = min(candidates, key=lambda e: (-sum(counts[r][e] for r in range(ep_size) if r != heaviest), e))
        used.add(expert)
        owner = owner_of(expert, per_rank)
        senders = [
            r for r in range(ep_size)
            if r != owner and counts[r][expert] > 0 and (slots_per_rank is None or slots[r] < slots_per_rank)
        ]
        senders.sort(key=lambda r: (counts[r][expert], r))
        eligible = senders[exclude_fewest:]
        if balancing:
            replicas = _balancing_replicas(expert, owner, eligible, counts, plan, padding, computed)
            if timing is not None:
                replicas = _cheapest_prefix(expert, owner, replicas, chosen, counts, cost_model, padding, timing,
                                            loads)
            replicas = tuple(sorted(replicas))
        else:
            replicas = tuple(sorted(eligible))
        if not replicas:
            if slots_per_rank is not None and all(s >= slots_per_rank for i, s in enumerate(slots) if i != owner):
                break
            continue
        for r in replicas:
            slots[r] += 1
        chosen.append(Replication(expert, owner, replicas))
        prefixes.append(PlacementPlan(num_experts, ep_size, tuple(chosen)))
    return prefixes


def plan_pro_prophet(
    counts: Counts,
    cost_model: CostModel,
    padding: Padding = Padding(),
    *,
    exclude_fewest: int = 0,
    alpha: float = 0.25,
    slots_per_rank: int | None = None,
    transfer_timing: TransferTiming = "prefetched",
) -> PlacementPlan:
    """The fastest balanced replication plan, or the fastest plan when none is balanced.

    Loads are balanced when max−min < α·I/E (I routed tokens, E experts: the paper's
    rule; its α = 3 never replicated anything at Zipf 1.2 in our measurements, hence
    α = 0.25). Candidates are the prefixes of three greedy runs (:func:`_greedy_path`):
    the paper's replica sets, which cut all-to-all traffic most; load-balancing sets,
    which even compute without overshooting; and load-balancing sets cut to the size
    the cost model prices lowest, where each replica's copy from the owner costs more
    than its share of the owner's rows saves (many ranks, slow links).
    Only plans the cost model predicts faster than the stock placement qualify;
    among them a balanced plan beats an unbalanced one, then the lower predicted
    time wins, ties going to the paper's run and the shorter prefix. ``transfer_timing`` prices
    the transfers as the layer will issue them (see :meth:`CostModel.terms`).
    """
    ep_size = len(counts)
    num_experts = len(counts[0]) if counts else 0
    if num_experts == 0:
        raise ValueError("counts is empty: pass one row per EP rank with one count per expert")
    validate_counts(counts, ep_size, num_experts)
    per_rank = cost_model.experts_per_rank
    if per_rank * ep_size != num_experts:
        raise ValueError(f"cost model has {per_rank} experts per rank but counts are {ep_size} x {num_experts}")
    threshold = alpha * sum(map(sum, counts)) / num_experts
    best = PlacementPlan(num_experts, ep_size)
    loads = _LoadMemo(counts, padding, per_rank)
    stock_time = cost_model.total(counts, best, padding, loads=loads(best))
    best_key: tuple[bool, float] | None = None
    priced: set[PlacementPlan] = set()
    runs = ((False, None), (True, None), (True, transfer_timing))
    for balancing, trimmed_for in runs:
        for plan in _greedy_path(counts, cost_model, padding, threshold, exclude_fewest, slots_per_rank, balancing,
                                 loads, trimmed_for):
            if plan in priced:  # the runs share prefixes; an equal key never replaces the best
                continue
            priced.add(plan)
            time = cost_model.total(counts, plan, padding, transfer_timing, loads(plan))
            if time >= stock_time:
                continue
            computed = loads(plan).computed
            key = (max(computed) - min(computed) >= threshold, time)
            if best_key is None or key < best_key:
                best, best_key = plan, key
    return best
