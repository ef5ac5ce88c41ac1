"""rank_loads against its definition from block_rows, on random counts, plans and paddings.

rank_loads sums each owner's block of a row at once and takes hosted rows back out per replica
(the planners call it tens of times per layer call), so it is checked against the per-block accounting.
"""

from __future__ import annotations

import random

import pytest

from lightning_merak.plugins.moe.core.placement import (
    Padding,
    PlacementPlan,
    Replication,
    block_rows,
    rank_loads,
    replica_rows,
)
from lightning_merak.plugins.moe.core.placement_cost_model import CommCurve, CostModel


def _reference(counts: list[list[int]], plan: PlacementPlan, padding: Padding, per_rank: int) -> dict[str, list[int]]:
    ranks = len(counts)
    rows = block_rows(counts, plan, padding)
    computed, sent, received = [0] * ranks, [0] * ranks, [0] * ranks
    for r, row in enumerate(rows):
        for e, n in enumerate(row):
            owner = e // per_rank
            computed[owner] += n
            if owner != r:
                sent[r] += n
                received[owner] += n
    params_sent, params_received = [0] * ranks, [0] * ranks
    for rep in plan.replications:
        params_sent[rep.owner] += len(rep.replicas)
        for r in rep.replicas:
            params_received[r] += 1
            computed[r] += replica_rows(counts, r, rep.expert, padding)
    return dict(computed=computed, sent=sent, received=received, params_sent=params_sent,
                params_received=params_received)


def _random_plan(rng: random.Random, ranks: int, per_rank: int) -> PlacementPlan:
    experts = ranks * per_rank
    replications = []
    for expert in rng.sample(range(experts), rng.randint(0, experts)):
        owner = expert // per_rank
        others = [r for r in range(ranks) if r != owner]
        replicas = tuple(sorted(rng.sample(others, rng.randint(1, len(others)))))
        replications.append(Replication(expert, owner, replicas))
    return PlacementPlan(experts, ranks, tuple(replications))


@pytest.mark.parametrize("padding", [Padding("dropless"), Padding("fixed", 37), Padding("max")])
@pytest.mark.parametrize("ranks,per_rank", [(2, 4), (4, 1), (3, 2)])
def test_rank_loads_equal_the_block_accounting(padding: Padding, ranks: int, per_rank: int) -> None:
    rng = random.Random(ranks * 31 + per_rank)
    for _ in range(50):
        counts = [[rng.choice((0, rng.randint(1, 300))) for _ in range(ranks * per_rank)] for _ in range(ranks)]
        plan = _random_plan(rng, ranks, per_rank)
        loads = rank_loads(counts, plan, padding, per_rank)
        expected = _reference(counts, plan, padding, per_rank)
        assert {name: getattr(loads, name) for name in expected} == expected, (counts, plan)


def test_precomputed_loads_price_like_computed_ones() -> None:
    cost = CostModel(CommCurve.from_bandwidth(1e8, 1e-4), CommCurve.from_bandwidth(1e8, 1e-4), 2e5, 512, 500_000, 2,
                     nonmoe_forward_s=0.002, overlap_efficiency=0.6)
    counts = [[500, 20, 30, 10], [400, 60, 5, 90]]
    plan = PlacementPlan(4, 2, (Replication(0, 0, (1,)),))
    loads = rank_loads(counts, plan, Padding("dropless"), 2)
    for timing in ("prefetched", "current", "done"):
        assert cost.total(counts, plan, Padding("dropless"), timing, loads) == cost.total(
            counts, plan, Padding("dropless"), timing)
