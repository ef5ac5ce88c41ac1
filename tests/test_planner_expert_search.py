"""The planner searches the expert-parallel size (#30): with ``moe.ep_size`` unset every ep dividing both dp and the
experts is a candidate, each priced by the cost model: the experts a rank keeps (1/ep of them), their gradients'
sum over the dp/ep ranks holding the same ones, and the all-to-all over ep ranks."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_merak.planning.planner import (
    CollectiveCost,
    Layout,
    NetworkProfile,
    SearchSpace,
    candidate_layouts,
    plan,
    predict,
    required_profile_keys,
)
from lightning_merak.planning.planner.search import expert_parallel_sizes
from tests.test_planner_experts import EXPERTS, _profile

# world 4, one stage: every layout is dp=4 (2 samples per replica, as _profile times them)
SPACE = SearchSpace(world_size=4, global_batch_size=8, tp_degrees_allowed=(1,), max_pipeline_stages=1, ep_size=None,
                    recompute_ratios=(0.0,))
_LINK = CollectiveCost(latency_s=0.1, bandwidth_bytes_per_s=100.0)


def _network(exchange: CollectiveCost, all_reduce: CollectiveCost = _LINK) -> NetworkProfile:
    return NetworkProfile(all_reduce={2: all_reduce, 4: all_reduce}, p2p=_LINK, all_to_all={2: exchange, 4: exchange})


def test_unset_ep_takes_every_size_dividing_dp_and_the_experts() -> None:
    assert expert_parallel_sizes(SPACE, 4, num_experts=8) == [1, 2, 4]
    assert expert_parallel_sizes(SPACE, 4, num_experts=6) == [1, 2]  # 4 does not split 6 experts
    assert expert_parallel_sizes(SPACE, 3, num_experts=6) == [1, 3]
    assert expert_parallel_sizes(SPACE, 4) == [4]  # the experts not known: the whole data-parallel group
    fixed = dataclasses.replace(SPACE, ep_size=2)
    assert expert_parallel_sizes(fixed, 4, num_experts=8) == [2]
    assert expert_parallel_sizes(fixed, 3, num_experts=8) == []  # ep must divide dp
    space = dataclasses.replace(SPACE, max_pipeline_stages=2)
    assert sorted({(layout.dp, layout.pp, layout.ep) for layout in candidate_layouts(space, num_experts=4)}) == [
        (2, 2, 1), (2, 2, 2), (4, 1, 1), (4, 1, 2), (4, 1, 4)]


def test_the_profile_asks_for_each_planned_ep_s_exchange_and_replica_reduction() -> None:
    keys = required_profile_keys(SPACE, num_experts=4)
    assert keys.all_to_all_group_sizes == {2, 4}  # ep=2 and ep=4 exchange; ep=1 none
    assert keys.all_reduce_group_sizes == {2, 4}  # dp=4, and dp/ep=2 replicas of each ep=2 expert group


def test_an_ep_below_dp_keeps_half_the_experts_and_sums_their_gradients_over_the_replicas() -> None:
    """dp=4 with 4 experts of 400 bytes: ep=2 keeps 200 bytes and all-reduces their gradients over its 2 replicas;
    ep=4 keeps 100 and has no replica; ep=1 keeps all 400, all-reduced over 4 ranks."""
    network = _network(CollectiveCost(latency_s=0.01, bandwidth_bytes_per_s=1000.0))
    by_ep = {ep: predict(Layout(4, 1, 1, 1, 1, 0.0, ep=ep), _profile(), network, SPACE) for ep in (1, 2, 4)}
    assert {ep: p.memory_components["parameters"] for ep, p in by_ep.items()} == {1: 540, 2: 340, 4: 240}
    # the dense 140 bytes' all-reduce over 4 ranks is common to all three; the experts' sum comes on top
    dense = by_ep[4].components["dp_allreduce"]
    assert by_ep[2].components["dp_allreduce"] - dense == pytest.approx(0.1 + 2 * (1 / 2) * 200 / 100)
    assert by_ep[1].components["dp_allreduce"] - dense == pytest.approx(0.1 + 2 * (3 / 4) * 400 / 100)
    assert by_ep[1].components["expert_all_to_all"] == 0.0
    # each direction moves (ep - 1)/ep of 2 samples x 16 tokens x top-2 x hidden 8 x 4 bytes = 2048 bytes
    assert by_ep[2].components["expert_all_to_all"] == pytest.approx(4 * (0.01 + 1.024) + 0.01 + 0.032)
    assert by_ep[4].components["expert_all_to_all"] == pytest.approx(4 * (0.01 + 1.536) + 0.01 + 0.096)


def test_the_search_chooses_ep_by_its_price() -> None:
    """A slow exchange keeps every expert on every rank; a fast exchange over a slow all-reduce spreads them over all
    four; a memory limit between the ep=1 and ep=2 footprints rules ep=1 out."""
    slow = _network(CollectiveCost(latency_s=0.01, bandwidth_bytes_per_s=10.0))
    assert plan(SPACE, _profile(), slow).best.layout.ep == 1
    fast_exchange = _network(CollectiveCost(latency_s=0.01, bandwidth_bytes_per_s=1000.0),
                             all_reduce=CollectiveCost(latency_s=0.1, bandwidth_bytes_per_s=10.0))
    assert plan(SPACE, _profile(), fast_exchange).best.layout.ep == 4
    footprint = {ep: predict(Layout(4, 1, 1, 1, 1, 0.0, ep=ep), _profile(), slow, SPACE).memory_bytes
                 for ep in (1, 2)}
    limited = plan(dataclasses.replace(SPACE, memory_limit_bytes=(footprint[1] + footprint[2]) / 2), _profile(), slow)
    assert limited.best.layout.ep == 2  # the cheapest that fits
    assert [layout.ep for layout, _ in limited.rejected] == [1]


def test_a_fixed_ep_is_kept() -> None:
    fixed = dataclasses.replace(SPACE, ep_size=2)
    ranked = plan(fixed, _profile(), _network(CollectiveCost(latency_s=0.01, bandwidth_bytes_per_s=10.0))).ranked
    assert [prediction.layout.ep for prediction in ranked] == [2]
    assert EXPERTS.num_experts == 4
