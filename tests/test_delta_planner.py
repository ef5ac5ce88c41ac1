"""DeltaMemory's pure core: budget parsing, planner (filter + director), ledger, profiles."""

from __future__ import annotations

import pytest

from lightning_merak.callbacks.delta.budget import parse_budget
from lightning_merak.callbacks.delta.ledger import ResidentLedger
from lightning_merak.callbacks.delta.memory_planner import (
    Action,
    BlockProfile,
    PlannerSettings,
    StepProfile,
    calibrate_outside,
    plan_memory,
    simulate_timeline,
)
from lightning_merak.callbacks.delta.profiler import BlockRecord, agree_profile, profile_from_records

MIB = 2**20


def chain(n: int = 6, saved: int = 10 * MIB, forward_s: float = 0.01, outside: int = 2 * MIB) -> StepProfile:
    """A sequential chain: block i's backward starts after blocks i+1.. ran backward."""
    blocks = []
    for i in range(n):
        stale = (n - 1 - i) * 3 * forward_s + 0.001
        blocks.append(BlockProfile(f"layer{i}", forward_s, 2 * forward_s, saved, MIB, stale))
    return StepProfile(tuple(blocks), outside)


def settings(budget: int, bandwidth: float = 10e9, **kwargs) -> PlannerSettings:
    return PlannerSettings(budget, bandwidth, bandwidth, swap_capacity_bytes=10**12, **kwargs)


@pytest.mark.parametrize(
    "text, nbytes, fraction, auto",
    [
        ("auto", None, None, True),
        ("0.5", None, 0.5, False),
        ("50%", None, 0.5, False),
        (0.25, None, 0.25, False),
        (1.0, None, 1.0, False),
        ("2GiB", 2 * 2**30, None, False),
        ("1.5 GB", 1_500_000_000, None, False),
        ("512MiB", 512 * MIB, None, False),
        ("1073741824", 2**30, None, False),
        (4096, 4096, None, False),
    ],
)
def test_parse_budget_accepts_bytes_fractions_and_auto(text, nbytes, fraction, auto):
    budget = parse_budget(text)
    assert (budget.nbytes, budget.fraction, budget.auto) == (nbytes, fraction, auto)


@pytest.mark.parametrize("bad", ["lots", "1.5", "2 parsecs", "-1GiB", "0", 0, -5, 1.5, 0.0, "150%", True, None, [1]])
def test_parse_budget_rejects_bad_values_with_the_accepted_forms(bad):
    with pytest.raises((ValueError, TypeError), match="auto"):
        parse_budget(bad)


def test_generous_budget_keeps_everything():
    profile = chain()
    plan = plan_memory(profile, settings(budget=10**12))
    assert all(d.action is Action.KEEP for d in plan.decisions)
    assert plan.predicted_peak_bytes == plan.unmanaged_peak_bytes == 2 * MIB + 60 * MIB
    assert plan.fits


def test_filter_releases_largest_times_stalest_first_until_the_budget_holds():
    profile = chain()
    budget = 45 * MIB
    plan = plan_memory(profile, settings(budget))
    released = [d.name for d in plan.decisions if d.action is not Action.KEEP]
    assert released == ["layer0", "layer1"]
    assert plan.fits and plan.predicted_peak_bytes <= budget
    assert plan.predicted_peak_bytes == max(b for _, b in simulate_timeline(profile, plan.actions))


def test_filter_prefers_size_times_staleness_over_position():
    blocks = (
        BlockProfile("big_fresh", 0.01, 0.02, 40 * MIB, 0, 0.5),
        BlockProfile("small_stale", 0.01, 0.02, 4 * MIB, 0, 1.0),
    )
    plan = plan_memory(StepProfile(blocks), settings(budget=41 * MIB))
    assert plan.action("big_fresh") is not Action.KEEP
    assert plan.action("small_stale") is Action.KEEP


def test_director_swaps_when_copies_hide_and_recomputes_when_they_cannot():
    fast = plan_memory(chain(), settings(budget=0, bandwidth=100e9))
    assert {d.action for d in fast.decisions} == {Action.SWAP}
    slow = plan_memory(chain(), settings(budget=0, bandwidth=10e6))
    assert {d.action for d in slow.decisions} == {Action.RECOMPUTE}
    assert all(d.reason == "forward < exposed swap" for d in slow.decisions)


def test_exposed_director_uses_overlap_windows_where_delta_rule_does_not():
    # 10 MiB at 1 GB/s: 10.5 ms each way, i.e. 21 ms > 10 ms forward -> DELTA recomputes;
    # but the neighbours' 5 x 10 ms forward / 20 ms backward hide both copies -> swap.
    profile = chain(n=8)
    exposed = plan_memory(profile, settings(budget=30 * MIB, bandwidth=1e9))
    delta = plan_memory(profile, settings(budget=30 * MIB, bandwidth=1e9, director="delta"))
    assert exposed.action("layer0") is Action.SWAP
    assert delta.action("layer0") is Action.RECOMPUTE
    # the last block has nothing after it to hide its copy-in behind
    last = plan_memory(profile, settings(budget=0, bandwidth=1e9))
    assert last.action("layer7") is Action.RECOMPUTE


def test_swap_capacity_exhaustion_falls_back_to_recompute():
    profile = chain()
    plan = plan_memory(profile, PlannerSettings(0, 100e9, 100e9, swap_capacity_bytes=25 * MIB))
    actions = [d.action for d in plan.decisions]
    assert actions.count(Action.SWAP) == 2
    assert any(d.reason == "swap tier full" for d in plan.decisions)


def test_overrides_are_honoured_and_unknown_names_fail():
    profile = chain()
    plan = plan_memory(profile, settings(10**12, overrides={"layer3": Action.RECOMPUTE}))
    assert plan.action("layer3") is Action.RECOMPUTE
    assert plan.decisions[3].released_bytes == 9 * MIB
    with pytest.raises(ValueError, match="layer9"):
        plan_memory(profile, settings(10**12, overrides={"layer9": Action.SWAP}))


def test_tiny_blocks_are_never_released():
    blocks = tuple(BlockProfile(f"b{i}", 0.01, 0.02, MIB, 0, 1.0) for i in range(4)) + (
        BlockProfile("tiny", 0.01, 0.02, 1, 0, 10.0),
    )
    plan = plan_memory(StepProfile(blocks), settings(budget=0, min_block_fraction=0.01))
    assert plan.action("tiny") is Action.KEEP
    assert plan.decisions[-1].reason == "below size threshold"


def test_infeasible_budget_is_reported_with_the_lowest_reachable_peak():
    profile = chain(outside=50 * MIB)
    plan = plan_memory(profile, settings(budget=MIB))
    assert not plan.fits
    assert plan.min_peak_bytes >= 50 * MIB
    assert "lowest reachable" in plan.table()


def test_simulated_timeline_follows_the_actions():
    blocks = (BlockProfile("a", 0.01, 0.02, 8, 2, 1.0), BlockProfile("b", 0.01, 0.02, 4, 1, 0.5))
    profile = StepProfile(blocks, outside_bytes=1)
    keep = dict(simulate_timeline(profile, {"a": Action.KEEP, "b": Action.KEEP}))
    assert keep["fwd b done"] == 13 and keep["bwd a done"] == 1
    mixed = dict(simulate_timeline(profile, {"a": Action.RECOMPUTE, "b": Action.SWAP}))
    assert mixed["fwd a done"] == 3 and mixed["fwd b done"] == 3
    assert mixed["bwd b"] == 7 and mixed["bwd a"] == 9 and mixed["bwd a done"] == 1


def test_planner_settings_validate_units_and_choices():
    with pytest.raises(ValueError, match="director"):
        settings(1, director="dtr")
    with pytest.raises(ValueError, match="bandwidth"):
        PlannerSettings(1, 0.0, 1.0, 1)


def test_step_profile_median_and_scaling():
    a, b, c = chain(forward_s=0.01), chain(forward_s=0.03), chain(forward_s=0.02)
    median = StepProfile.median([a, b, c])
    assert median.blocks[0].forward_s == pytest.approx(0.02)
    doubled = median.scaled(2.0)
    assert doubled.blocks[0].saved_bytes == 2 * median.blocks[0].saved_bytes
    assert doubled.outside_bytes == 2 * median.outside_bytes
    with pytest.raises(ValueError, match="different blocks"):
        StepProfile.median([chain(n=2), chain(n=3)])


def test_profile_from_records_orders_by_forward_time_and_computes_staleness():
    records = [
        BlockRecord("second", 2.0, 3.0, 5.0, 6.0, saved_bytes=10, boundary_bytes=2),
        BlockRecord("first", 0.0, 1.0, 7.0, None, saved_bytes=20, boundary_bytes=4),
        BlockRecord("never_ran"),
    ]
    profile = profile_from_records(records, outside_bytes=3)
    assert profile.names == ("first", "second")
    first, second = profile.blocks
    assert first.stale_s == 6.0 and first.backward_s == 2.0  # no backward end: 2 x forward
    assert second.stale_s == 2.0 and second.backward_s == 1.0


def test_ranks_agree_on_the_lowest_rank_profile_of_their_stage():
    gathered = [(("l0", "l1"), "rank0"), (("l2", "l3"), "rank1"), (("l0", "l1"), "rank2"), (("l2", "l3"), "rank3")]
    assert [agree_profile(gathered, r) for r in range(4)] == ["rank0", "rank1", "rank0", "rank1"]


def test_ledger_counts_each_storage_once_and_tracks_the_peak():
    ledger = ResidentLedger()
    ledger.start_step()
    ledger.acquire("s1", 100)
    ledger.acquire("s1", 100)
    ledger.acquire("s2", 50)
    assert ledger.resident_bytes == 150
    ledger.release("s1")
    assert ledger.resident_bytes == 150
    ledger.release("s1")
    ledger.adjust(30, "recompute")
    assert ledger.resident_bytes == 80 and ledger.peak_bytes == 150
    ledger.start_step()
    assert ledger.peak_bytes == 80 and ledger.timeline[0].label == "step start"


def test_simulation_follows_recorded_events_so_micro_batches_in_flight_add_up():
    blocks = (BlockProfile("a", 0.01, 0.02, 10, 2, 1.0), BlockProfile("b", 0.01, 0.02, 10, 2, 1.0))
    one_at_a_time = StepProfile(blocks, 0, (("F", 0), ("F", 1), ("B", 1), ("B", 0)) * 2)
    two_in_flight = StepProfile(blocks, 0, (("F", 0), ("F", 1)) * 2 + (("B", 1), ("B", 0)) * 2)
    keep = {"a": Action.KEEP, "b": Action.KEEP}
    assert max(b for _, b in simulate_timeline(one_at_a_time, keep)) == 20
    assert max(b for _, b in simulate_timeline(two_in_flight, keep)) == 40
    assert simulate_timeline(two_in_flight, keep)[-1][1] == 0
    plan = plan_memory(two_in_flight, settings(budget=30))
    assert plan.unmanaged_peak_bytes == 40 and plan.fits
    with pytest.raises(ValueError, match="names no forward"):
        StepProfile(blocks, 0, (("F", 2),))


def test_profile_from_records_averages_micro_batches_and_keeps_the_event_order():
    records = [
        BlockRecord("a", 0.0, 1.0, 4.0, 5.0, saved_bytes=10),
        BlockRecord("a", 2.0, 3.0, 6.0, 7.0, saved_bytes=30),
    ]
    profile = profile_from_records(records, outside_bytes=0)
    (a,) = profile.blocks
    assert a.saved_bytes == 20 and a.stale_s == 3.0
    assert profile.events == (("F", 0), ("F", 0), ("B", 0), ("B", 0))


def test_outside_bytes_are_calibrated_to_the_measured_peak():
    profile = chain(n=3, saved=10 * MIB, outside=0)
    keep = {b.name: Action.KEEP for b in profile.blocks}
    calibrated = calibrate_outside(profile, keep, measured_peak_bytes=34 * MIB)
    assert calibrated.outside_bytes == 4 * MIB
    assert max(b for _, b in simulate_timeline(calibrated, keep)) == 34 * MIB
    assert calibrate_outside(profile, keep, measured_peak_bytes=MIB).outside_bytes == 0


def test_plan_table_logs_every_block_with_its_action_and_reason():
    plan = plan_memory(chain(), settings(45 * MIB, overrides={"layer5": Action.SWAP}))
    rows = plan.table().splitlines()
    assert len(rows) == 1 + 6 + 1
    for decision, row in zip(plan.decisions, rows[1:-1]):
        assert row.split()[:2] == [decision.name, decision.action.value]
        assert row.endswith(decision.reason)
    assert "user override" in rows[6] and "fits budget" in rows[4]
