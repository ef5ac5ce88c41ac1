"""One planner per step (issue #25): every placement kind priced on this step's counts, with a guard.

Pure: count matrices in, choices out. Cost models are built from bandwidths so each test
sets which side of a trade-off wins.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_merak.plugins.moe import (
    PLAN_KINDS,
    CommCurve,
    CostModel,
    Padding,
    PlacementPlan,
    PlannerSettings,
    Replication,
    choose_step_plan,
    predicted_plan,
    prefetch_pays,
    rank_loads,
)

RANKS = 4


def _model(transfer_bw: float, a2a_bw: float = 1e6, tokens_per_s: float = 1e7) -> CostModel:
    return CostModel(CommCurve.from_bandwidth(a2a_bw), CommCurve.from_bandwidth(transfer_bw), tokens_per_s, 64, 4096,
                     1)


def _hot(expert: int, load: int = 400, cold: int = 10) -> list[list[int]]:
    """Every rank sends ``load`` tokens to ``expert`` and ``cold`` to each other expert."""
    return [[load if e == expert else cold for e in range(RANKS)] for _ in range(RANKS)]


def _max_over_mean(counts: list[list[int]], plan: PlacementPlan) -> float:
    computed = rank_loads(counts, plan, Padding(), 1).computed
    return max(computed) / (sum(computed) / len(computed))


def test_rotated_hot_set_is_planned_from_this_steps_counts_not_the_stale_prefetch() -> None:
    cost = _model(transfer_bw=1e8)
    stale = predicted_plan(_hot(0), cost, Padding(), PlannerSettings())
    assert stale is not None and stale[1].replications
    rotated = _hot(2)
    choice = choose_step_plan(rotated, cost, Padding(), prefetched=stale)
    assert choice.timing == "current" and choice.kind in ("pro_prophet", "shadowing")
    assert _max_over_mean(rotated, choice.plan) <= 1.15 < _max_over_mean(rotated, stale[1])
    assert not prefetch_pays(rotated, cost, stale[1], Padding(), choice.best_current_s)


def test_a_prefetch_that_still_fits_is_used_and_keeps_prefetching_on() -> None:
    """Transfers that a long dense layer hides when prefetched but that outlast the dispatch when current."""
    cost = replace(_model(transfer_bw=1e5), nonmoe_forward_s=1.0)
    counts = _hot(1)
    prefetched = predicted_plan(counts, cost, Padding(), PlannerSettings())
    assert prefetched is not None
    choice = choose_step_plan(counts, cost, Padding(), prefetched=prefetched)
    assert (choice.kind, choice.timing) == (prefetched[0], "predicted")
    assert choice.predicted_s < choice.best_current_s
    assert prefetch_pays(counts, cost, prefetched[1], Padding(), choice.best_current_s)


def test_guard_never_runs_a_plan_predicted_slower_than_no_replication() -> None:
    cost = _model(transfer_bw=1e3)  # a replica costs seconds: nothing may replicate
    counts = _hot(0)
    stale = ("pro_prophet", PlacementPlan(RANKS, RANKS, (Replication(0, 0, (1, 2, 3)),)))
    choice = choose_step_plan(counts, cost, Padding(), prefetched=stale)
    assert choice.kind == "dropless" and not choice.plan.replications
    assert choice.predicted_s == pytest.approx(cost.total(counts, PlacementPlan(RANKS, RANKS), Padding()))


def test_a_padded_layer_switches_to_dropless_dispatch_when_that_is_cheapest() -> None:
    cost = _model(transfer_bw=1e3)
    counts = [[10, 400, 10, 10]] + [[10] * RANKS] * (RANKS - 1)  # one block sets every block's padded size
    choice = choose_step_plan(counts, cost, Padding("max"))
    assert (choice.kind, choice.padding) == ("dropless", Padding("dropless"))
    only_none = choose_step_plan(counts, cost, Padding("max"), PlannerSettings(kinds=("none",)))
    assert (only_none.kind, only_none.padding) == ("none", Padding("max"))
    fixed = choose_step_plan(_hot(0), cost, Padding("fixed", 100))  # drops tokens: dropless would change them
    assert fixed.padding == Padding("fixed", 100)


def test_kinds_compete_by_predicted_cost_and_only_the_allowed_ones() -> None:
    cost = _model(transfer_bw=1e8)
    counts = _hot(3)
    every = choose_step_plan(counts, cost, Padding())
    for kinds in (("none", "shadowing"), ("none", "pro_prophet")):
        restricted = choose_step_plan(counts, cost, Padding(), PlannerSettings(kinds=kinds))
        assert restricted.kind in kinds or restricted.kind == "dropless"
        assert every.predicted_s <= restricted.predicted_s
    assert every.kind_index == PLAN_KINDS.index(every.kind)
    with pytest.raises(ValueError, match="includes 'none'"):
        PlannerSettings(kinds=("pro_prophet",))
    with pytest.raises(ValueError, match="subset"):
        PlannerSettings(kinds=("none", "everything"))


def test_previous_step_only_timing_offers_no_current_plan() -> None:
    cost = _model(transfer_bw=1e8)
    choice = choose_step_plan(_hot(0), cost, Padding(), current=False)
    assert not choice.plan.replications
    stale = predicted_plan(_hot(0), cost, Padding(), PlannerSettings())
    assert choose_step_plan(_hot(0), cost, Padding(), prefetched=stale, current=False).timing == "predicted"


def test_current_transfers_share_the_dispatch_links() -> None:
    """A current-step plan pays what its transfer adds to a rank's link beyond the all-to-all and experts."""
    cost = _model(transfer_bw=2e5)
    counts = _hot(0)
    plan = PlacementPlan(RANKS, RANKS, (Replication(0, 0, (1, 2, 3)),))
    prefetched, current, done = (cost.terms(counts, plan, Padding(), timing)
                                 for timing in ("prefetched", "current", "done"))
    assert done.total < prefetched.total <= current.total
    base = 4 * current.all_to_all + 3 * current.expert_forward
    assert current.total > base + max(0.0, current.aggregate - 2 * current.expert_forward)


def test_measured_overlap_efficiency_limits_what_transfers_and_chunks_hide() -> None:
    from lightning_merak.plugins.moe import choose_chunks
    from lightning_merak.plugins.moe.cost_measurement import _efficiency

    assert _efficiency(0.01, 0.03, 0.03) == pytest.approx(1.0)  # the transfer ran wholly beside compute
    assert _efficiency(0.01, 0.03, 0.04) == 0.0  # one after the other
    assert _efficiency(0.01, 0.03, 0.035) == pytest.approx(0.5)
    counts = _hot(0)
    plan = PlacementPlan(RANKS, RANKS, (Replication(0, 0, (1, 2, 3)),))
    slow_compute = _model(transfer_bw=2e6, tokens_per_s=1e5)
    hidden = slow_compute.total(counts, plan, Padding())
    serial = replace(slow_compute, overlap_efficiency=0.0).total(counts, plan, Padding())
    assert serial > hidden
    cheap_latency = _model(transfer_bw=1e8, a2a_bw=1e5, tokens_per_s=1e4)
    assert choose_chunks(cheap_latency, counts, PlacementPlan(RANKS, RANKS), Padding()) > 1
    assert choose_chunks(replace(cheap_latency, all_to_all_overlap_efficiency=0.2), counts,
                         PlacementPlan(RANKS, RANKS), Padding()) == 1
    with pytest.raises(ValueError, match="overlap_efficiency"):
        replace(cheap_latency, overlap_efficiency=1.5)


def test_a_plan_that_moves_no_rows_still_pays_the_all_to_all_latency() -> None:
    """Replicating every expert everywhere leaves the all-to-alls empty, but the layer still issues all four."""
    latency = 0.01
    cost = CostModel(CommCurve.from_bandwidth(1e6, latency_s=latency), CommCurve.from_bandwidth(1e9), 1e7, 64, 4096, 1)
    everywhere = PlacementPlan(RANKS, RANKS, tuple(Replication(e, e, tuple(r for r in range(RANKS) if r != e))
                                                   for e in range(RANKS)))
    terms = cost.terms(_hot(0), everywhere, Padding("dropless"), "done")
    assert rank_loads(_hot(0), everywhere, Padding("dropless"), 1).sent == [0] * RANKS
    assert terms.all_to_all == pytest.approx(latency, rel=1e-3)
    assert terms.total >= 4 * latency


def test_ranks_sharing_cores_make_an_imbalance_cheaper_than_its_rows_at_the_shared_rate() -> None:
    """Busiest rank 2x the mean: on one device per rank it pays 2x; where the idle ranks' cores speed it up
    (measured: alone 2x the shared rate) it pays no more than a balanced step; the lone rate is never slower."""
    shared = CostModel(CommCurve.from_bandwidth(1e6), CommCurve.from_bandwidth(1e6), 1000.0, 64, 4096, 1)
    alone = replace(shared, expert_tokens_per_s_alone=2000.0)
    unbalanced, balanced = [400, 100, 100, 200], [200, 200, 200, 200]
    assert shared.expert_compute(unbalanced) == pytest.approx(0.4)
    assert alone.expert_compute(unbalanced) == pytest.approx(0.2)
    assert alone.expert_compute(balanced) == pytest.approx(shared.expert_compute(balanced))
    with pytest.raises(ValueError, match="expert_tokens_per_s_alone"):
        replace(shared, expert_tokens_per_s_alone=500.0)
