"""The online plan check (issue #25): predictions corrected by measured layer time, bounded exploration.

Pure: synthetic timings in, choices out. Each arm has a "true" cost the test makes up; the
check only ever sees the cost model's prediction and that measured time.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from lightning_merak.plugins.moe import Padding, PlanCheck, step_candidates
from lightning_merak.plugins.moe.core.plan_check import Candidate


def _run(check: PlanCheck, predicted: dict[str, float], true_s: dict[str, float], calls: int) -> list[str]:
    """Select, then observe the chosen arm's true time, ``calls`` times; the arms run in order."""
    ran = []
    candidates = [Candidate(arm, seconds) for arm, seconds in predicted.items()]
    for _ in range(calls):
        picked = check.select(candidates)
        arm = candidates[picked.index].arm
        ran.append(arm)
        check.observe(arm, predicted[arm], true_s[arm])
    return ran


def _noisy_run(check: PlanCheck, predicted: dict[str, float], true_s: dict[str, float], calls: int,
               scatter: float, seed: int, spikes: bool = False, explored: list[int] | None = None) -> list[str]:
    """As :func:`_run`, on a shared machine: each call's time is the arm's true time × the load of the moment
    (a slow random walk, with optional 2–3× spikes a few calls long) × the call's own scatter (routing)."""
    rng = random.Random(seed)
    load, spike_left, ran = 1.0, 0, []
    candidates = [Candidate(arm, seconds) for arm, seconds in predicted.items()]
    for _ in range(calls):
        load = min(2.0, max(0.6, load * math.exp(rng.gauss(0.0, 0.05))))
        if spikes and spike_left == 0 and rng.random() < 0.08:
            spike_left = rng.randint(1, 4)
        factor = rng.uniform(2.0, 3.0) if spike_left else 1.0
        spike_left = max(0, spike_left - 1)
        picked = check.select(candidates)
        arm = candidates[picked.index].arm
        if picked.explored and explored is not None:
            explored.append(len(ran))
        ran.append(arm)
        check.observe(arm, predicted[arm], true_s[arm] * load * factor * math.exp(rng.gauss(0.0, scatter)))
    return ran


def test_the_truly_faster_arm_wins_most_calls_under_a_changing_load() -> None:
    """Three arms the model prices alike; measured, one is 8 % and one 15 % faster than the third, under a
    drifting load (with and without 2–3× spikes) and 10 % per-call scatter: over 20 seeded runs of 64 calls
    the fastest runs most calls (per-arm medians of raw ratios read 0.81 and 0.47 here)."""
    predicted = {"dropless/current": 1.0, "shadowing/current": 1.0, "pro_prophet/current": 1.0}
    true_s = {"dropless/current": 1.0, "shadowing/current": 0.92, "pro_prophet/current": 0.85}
    for spikes, share in ((False, 0.8), (True, 0.6)):
        runs = [_noisy_run(PlanCheck(), predicted, true_s, 64, 0.1, seed, spikes) for seed in range(20)]
        assert statistics.median(ran.count("pro_prophet/current") / len(ran) for ran in runs) >= share


def test_a_plan_that_runs_slower_than_predicted_loses_to_the_one_that_keeps_its_promise() -> None:
    """The model prices replicas far below dropless; measured, they are the slowest: the check moves to dropless."""
    predicted = {"dropless/current": 2.3, "shadowing/current": 1.8, "pro_prophet/current": 1.0}
    true_s = {"dropless/current": 2.0, "shadowing/current": 2.4, "pro_prophet/current": 3.5}
    ran = _run(PlanCheck(explore_every=0), predicted, true_s, 8)
    assert ran[:3] == ["pro_prophet/current", "shadowing/current", "dropless/current"]  # model's pick, then each once
    assert ran[3:] == ["dropless/current"] * 5


def test_a_uniformly_slow_machine_changes_no_ranking() -> None:
    """A 3× slower machine: each arm runs once to be measured, then the model's choice holds."""
    predicted = {"dropless/current": 1.0, "pro_prophet/current": 0.7}
    true_s = {arm: 3.0 * seconds for arm, seconds in predicted.items()}
    check = PlanCheck(explore_every=0)
    ran = _run(check, predicted, true_s, 6)
    assert ran == ["pro_prophet/current", "dropless/current"] + ["pro_prophet/current"] * 4
    assert check.correction("dropless/current") == pytest.approx(3.0)
    assert PlanCheck().correction("never-ran") == 1.0


def test_exploration_stops_where_the_measurements_settle_it_and_stays_seeded() -> None:
    """Noiseless, a 5× slower arm runs once and never again, a 10 % slower one (within ``max_regret``) runs
    ``confident`` times, its first run being no proof, and then never again; with scatter the close arm is
    re-run now and then (a seeded schedule, the same on every rank), the far one still never."""
    predicted = {"a": 1.0, "b": 1.1, "c": 5.0}
    ran = _run(PlanCheck(explore_every=4), predicted, predicted, 40)
    assert ran[:3] == ["a", "b", "c"] and ran.count("c") == 1
    assert ran.count("b") == PlanCheck().confident and ran[12:] == ["a"] * 28
    explorations: list[list[int]] = [[], [], []]
    runs = [_noisy_run(PlanCheck(explore_every=4, max_regret=0.25, seed=seed), predicted, predicted, 60, 0.1, 1,
                       explored=explored) for seed, explored in zip((3, 3, 4), explorations)]
    assert runs[0] == runs[1] and explorations[0] == explorations[1]
    assert explorations[0] != explorations[2]
    for ran, explored in zip(runs, explorations):
        assert ran.count("c") == 1
        again = [i for i in explored if i > 2]  # after each arm's first run
        assert 1 <= len(again) <= 60 // 2
        assert all(later - earlier >= 2 for earlier, later in zip(again, again[1:]))


def test_one_lucky_run_does_not_make_a_slower_arm_the_choice() -> None:
    """Sets ran once in a quiet moment (0.5 s), then as slow as they are (1.2 s): chosen on their worst ratio
    until measured ``confident`` times, they lose to shadowing after one bad run instead of two."""
    predicted = {"shadowing/current": 1.0, "pro_prophet/current": 0.6}
    candidates = [Candidate(arm, seconds) for arm, seconds in predicted.items()]

    def run(check: PlanCheck) -> list[str]:
        ran, sets_runs = [], 0
        for _ in range(8):
            arm = candidates[check.select(candidates).index].arm
            if arm == "pro_prophet/current":
                measured, sets_runs = (0.5 if sets_runs == 0 else 1.2), sets_runs + 1
            else:
                measured = 1.0
            check.observe(arm, predicted[arm], measured)
            ran.append(arm)
        return ran

    assert run(PlanCheck(explore_every=0)).count("pro_prophet/current") == 2
    with pytest.raises(ValueError, match="confident"):
        PlanCheck(window=3, confident=4)


def test_exploration_finds_an_arm_the_model_overprices() -> None:
    """Chunks promised a saving that the machine does not deliver: one run of the unchunked arm shows it, and
    once the chunked arm has run ``confident`` times (its first could have been cold) it is not run again."""
    predicted = {"dropless/current/chunked": 1.0, "dropless/current": 1.2}
    true_s = {"dropless/current/chunked": 2.0, "dropless/current": 1.2}
    ran = _run(PlanCheck(explore_every=2, max_regret=0.5, seed=0), predicted, true_s, 12)
    assert ran[1] == "dropless/current"
    assert ran.count("dropless/current/chunked") == PlanCheck().confident
    assert ran[6:] == ["dropless/current"] * 6


def test_one_chunked_run_teaches_every_kinds_chunked_correction() -> None:
    """Chunks cost twice what the model says: measured once on dropless, shadowing's chunked arm is not run."""
    check = PlanCheck(explore_every=0)
    check.observe("dropless/current", 1.0, 1.0)
    check.observe("shadowing/current", 1.0, 1.5)
    chunked = [Candidate("dropless/current", 1.0), Candidate("dropless/current/chunked", 0.8, "dropless/current")]
    assert chunked[check.select(chunked).index].arm == "dropless/current/chunked"  # never ran: explored once
    check.observe("dropless/current/chunked", 0.8, 1.6, "dropless/current")
    assert check.correction("shadowing/current/chunked", "shadowing/current") == pytest.approx(1.5 * 2.0)
    offers = [Candidate("shadowing/current", 1.0), Candidate("shadowing/current/chunked", 0.8, "shadowing/current")]
    assert [check.select(offers).index for _ in range(5)] == [0] * 5


def test_corrections_are_relative_to_the_load_and_ignore_empty_ones() -> None:
    """One arm slows 4× (the machine got busier: it is the only arm running, so nothing says otherwise):
    its factor stays, the load level takes the change; a new arm measured then is compared with that level."""
    check = PlanCheck(window=3, explore_every=0)
    for measured in [1.0] * 3 + [4.0] * 8:
        check.observe("x", 1.0, measured)
    assert check.correction("x") < 2.0
    check.observe("y", 1.0, 4.0)  # as slow as x under the same load: as fast as x
    check.observe("x", 1.0, 4.0)
    assert check.correction("y") == pytest.approx(check.correction("x"), rel=0.05)
    check.observe("z", 0.0, 1.0)
    check.observe("z", 1.0, 0.0)
    assert check.samples("z") == 0
    with pytest.raises(ValueError, match="explore_every"):
        PlanCheck(explore_every=-1)
    with pytest.raises(ValueError, match="level_smoothing"):
        PlanCheck(level_smoothing=0.0)
    with pytest.raises(ValueError, match="at least one candidate"):
        check.select([])


def test_step_candidates_are_what_the_planner_chooses_from() -> None:
    from lightning_merak.plugins.moe import CommCurve, CostModel, choose_step_plan

    cost = CostModel(CommCurve.from_bandwidth(1e6), CommCurve.from_bandwidth(1e8), 1e7, 64, 4096, 1)
    counts = [[400 if e == 0 else 10 for e in range(4)] for _ in range(4)]
    candidates = step_candidates(counts, cost, Padding())
    kinds = [c.kind for c in candidates]
    assert kinds[0] == "dropless" and {"shadowing", "pro_prophet"} <= set(kinds)
    chosen = choose_step_plan(counts, cost, Padding())
    assert chosen.predicted_s == min(c.predicted_s for c in candidates)
    assert chosen.arm == f"{chosen.kind}/current" and chosen.chunks is None


def _settle(check: PlanCheck, measured: dict[str, list[float]]) -> None:
    """Feed each arm its measured seconds against a prediction of 1 s, interleaved as calls would."""
    for round_ in zip(*measured.values()):
        for arm, seconds in zip(measured, round_):
            check.observe(arm, 1.0, seconds)


def test_arms_within_the_measured_noise_run_the_more_balanced_plan() -> None:
    """Shadowing and Pro-Prophet's sets both measure ~1 s ± 5 %: the sets (max/mean 1.02 vs 1.30) run."""
    offers = [Candidate("dropless/current", 1.0, max_over_mean=1.45),
              Candidate("shadowing/current", 1.0, max_over_mean=1.30, replicates=True),
              Candidate("pro_prophet/current", 1.0, max_over_mean=1.02, replicates=True)]
    check = PlanCheck(explore_every=0)
    _settle(check, {"dropless/current": [1.3] * 5, "shadowing/current": [0.95, 1.05, 0.95, 1.05, 1.0],
                    "pro_prophet/current": [1.01, 1.06, 0.97, 1.03, 1.01]})
    assert check.noise("shadowing/current") == pytest.approx(0.05, abs=0.02)
    assert offers[check.select(offers).index].arm == "pro_prophet/current"
    speed_only = PlanCheck(explore_every=0, balance_tolerance=0.0)
    _settle(speed_only, {"dropless/current": [1.3] * 5, "shadowing/current": [0.95, 1.05, 0.95, 1.05, 1.0],
                         "pro_prophet/current": [1.01, 1.06, 0.97, 1.03, 1.01]})
    assert offers[speed_only.select(offers).index].arm == "shadowing/current"


def test_balance_yields_to_speed_beyond_the_noise_and_to_the_guard() -> None:
    """Quiet measurements (no scatter) or a gap beyond the noise keep the faster plan; a replicating plan never
    displaces an arm that replicates nothing and measures faster by more than the noise, however balanced."""
    offers = [Candidate("dropless/current", 1.0, max_over_mean=1.45),
              Candidate("shadowing/current", 1.0, max_over_mean=1.30, replicates=True),
              Candidate("pro_prophet/current", 1.0, max_over_mean=1.02, replicates=True)]
    quiet = PlanCheck(explore_every=0)
    _settle(quiet, {"dropless/current": [1.3] * 5, "shadowing/current": [1.0] * 5,
                    "pro_prophet/current": [1.01] * 5})
    assert offers[quiet.select(offers).index].arm == "shadowing/current"
    apart = PlanCheck(explore_every=0)
    _settle(apart, {"dropless/current": [1.3] * 5, "shadowing/current": [0.95, 1.05, 0.95, 1.05, 1.0],
                    "pro_prophet/current": [1.12] * 5})
    assert offers[apart.select(offers).index].arm == "shadowing/current"
    guarded = PlanCheck(explore_every=0)
    _settle(guarded, {"dropless/current": [0.95, 1.05, 0.95, 1.05, 1.0], "shadowing/current": [1.2] * 5,
                      "pro_prophet/current": [1.08] * 5})
    assert guarded.noise("dropless/current") < 0.07
    assert offers[guarded.select(offers).index].arm == "dropless/current"
    with pytest.raises(ValueError, match="balance_tolerance"):
        PlanCheck(balance_tolerance=1.0)


def test_a_replicating_arm_within_the_noise_of_a_faster_plain_arm_runs_the_more_balanced_plan() -> None:
    """Dropless (replicates nothing, max/mean 1.45) measures ~1 s ± 5 %, the sets (replicate, 1.02) 1.00–1.02 s
    and score a little above it: within the noise, so the sets run; with ``balance_tolerance=0`` speed decides."""
    offers = [Candidate("dropless/current", 1.0, max_over_mean=1.45),
              Candidate("pro_prophet/current", 1.0, max_over_mean=1.02, replicates=True)]
    measured = {"dropless/current": [0.95, 1.05, 0.95, 1.05, 1.0]}
    for sets in (1.0, 1.02):
        check, speed_only = PlanCheck(explore_every=0), PlanCheck(explore_every=0, balance_tolerance=0.0)
        for each in (check, speed_only):
            _settle(each, {**measured, "pro_prophet/current": [sets] * 5})
        assert check.corrected(offers[1]) > check.corrected(offers[0])  # measured slower, within the noise
        assert offers[check.select(offers).index].arm == "pro_prophet/current"
        assert offers[speed_only.select(offers).index].arm == "dropless/current"


def _cold_start(check: PlanCheck, later_ratio: float, calls: int) -> tuple[list[str], list[bool]]:
    """Issue #49's warm-up at 4 ranks: the sets (predicted 119 ms) run first, cold, at 1.47× their prediction,
    then at ``later_ratio``; dropless (predicted 134 ms) measures 0.96–1.04× its prediction."""
    offers = [Candidate("dropless/current", 0.134, max_over_mean=1.77),
              Candidate("pro_prophet/current", 0.119, max_over_mean=1.02, replicates=True)]
    dropless_ratios = [1.0, 1.04, 0.97, 1.02, 0.96]
    ran: list[str] = []
    explored: list[bool] = []
    for _ in range(calls):
        picked = check.select(offers)
        offer = offers[picked.index]
        if offer.arm == "pro_prophet/current":
            ratio = 1.47 if "pro_prophet/current" not in ran else later_ratio
        else:
            ratio = dropless_ratios[ran.count("dropless/current") % len(dropless_ratios)]
        check.observe(offer.arm, offer.predicted_s, offer.predicted_s * ratio)
        ran.append(offer.arm)
        explored.append(picked.explored)
        if len(ran) == 2:  # each arm measured once: the sets' worst residual is beyond max_regret of dropless
            assert ran == ["pro_prophet/current", "dropless/current"]
            assert check.corrected(offers[1]) > check.corrected(offers[0]) * (1.0 + check.max_regret)
    return ran, explored


def test_an_arm_whose_first_run_was_cold_is_explored_again_and_becomes_the_choice() -> None:
    """One cold run at 1.47× prices the sets above ``max_regret`` of dropless, but an arm measured fewer than
    ``confident`` times is explored on its prediction: within a bounded number of calls the sets run again,
    measure 1.0×, and from their ``confident``-th run on they are the choice."""
    for seed in range(6):
        check = PlanCheck(seed=seed)
        ran, explored = _cold_start(check, 1.0, 100)
        runs = [i for i, arm in enumerate(ran) if arm == "pro_prophet/current"]
        assert runs[check.confident - 1] < 3 * check.explore_every
        assert all(explored[i] for i in runs[1:check.confident])
        settled = runs[check.confident - 1]
        assert all(arm == "pro_prophet/current" for arm, probe in zip(ran[settled:], explored[settled:])
                   if not probe)
        assert ran[-20:] == ["pro_prophet/current"] * 20
        assert ran == _cold_start(PlanCheck(seed=seed), 1.0, 100)[0]  # the same choices on every rank


def test_an_arm_that_stays_slow_is_explored_only_until_confident() -> None:
    """The same start, but the sets keep measuring 1.47×: they run ``confident`` times, then the regular
    ``max_regret`` bound holds and they never run again."""
    for seed in range(6):
        check = PlanCheck(seed=seed)
        ran, _ = _cold_start(check, 1.47, 150)
        assert ran.count("pro_prophet/current") == check.confident
        assert ran[3 * check.explore_every:] == ["dropless/current"] * (150 - 3 * check.explore_every)


def test_a_variant_is_explored_on_its_base_not_on_its_own_first_run() -> None:
    """The only chunked run so far measured 2× its prediction (cold): every other kind's chunked arm borrows
    that run's offset, but the chunked arm itself is explored on its base's factor until measured
    ``confident`` times; at 1.4× it is then left alone."""
    offers = [Candidate("dropless/current", 1.0), Candidate("dropless/current/chunked", 0.8, "dropless/current")]
    check = PlanCheck(explore_every=2, seed=0)
    for _ in range(3):
        check.observe("dropless/current", 1.0, 1.0)
    check.observe("dropless/current/chunked", 0.8, 1.6, "dropless/current")
    check.observe("shadowing/current", 1.0, 1.0)
    assert check.correction("shadowing/current/chunked", "shadowing/current") == pytest.approx(2.0)
    assert check.corrected(offers[1]) > check.corrected(offers[0]) * (1.0 + check.max_regret)  # its own run
    ran = []
    for _ in range(12):
        picked = check.select(offers)
        offer = offers[picked.index]
        check.observe(offer.arm, offer.predicted_s, 1.0 if offer.base is None else 0.8 * 1.4, offer.base)
        ran.append(offer.arm)
    assert ran.count("dropless/current/chunked") == check.confident - 1
    assert check.samples("dropless/current/chunked") == check.confident
    assert ran[-4:] == ["dropless/current"] * 4  # 1.4× its prediction, 12 % slower: not explored again
