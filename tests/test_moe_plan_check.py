"""The online plan check (issue #25): predictions corrected by measured layer time, bounded exploration.

Pure: synthetic timings in, choices out. Each arm has a "true" cost the test makes up; the
check only ever sees the cost model's prediction and that measured time.
"""

from __future__ import annotations

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


def test_exploration_is_seeded_bounded_and_only_within_the_regret() -> None:
    predicted = {"a": 1.0, "b": 1.1, "c": 5.0}
    runs = [_run(PlanCheck(explore_every=4, max_regret=0.25, seed=seed), predicted, predicted, 40)
            for seed in (3, 3, 4)]
    assert runs[0] == runs[1]  # same seed, same measurements: same choices (as on every rank)
    assert runs[0] != runs[2]
    for ran in runs:
        assert ran.count("c") == 1  # measured once, 5× the best: beyond the regret from then on
        explored = [i for i, arm in enumerate(ran) if arm == "b"][1:]
        assert 40 // 7 <= len(explored) <= 40 // 2  # after its first run, once every 2–6 calls
        assert all(later - earlier >= 2 for earlier, later in zip(explored, explored[1:]))
    assert _run(PlanCheck(explore_every=0), predicted, predicted, 40)[3:] == ["a"] * 37


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
    assert run(PlanCheck(explore_every=0, confident=1)).count("pro_prophet/current") == 3  # the median alone
    with pytest.raises(ValueError, match="confident"):
        PlanCheck(window=3, confident=4)


def test_exploration_finds_an_arm_the_model_overprices() -> None:
    """Chunks promised a saving that the machine does not deliver: one run of the unchunked arm shows it."""
    predicted = {"dropless/current/chunked": 1.0, "dropless/current": 1.2}
    true_s = {"dropless/current/chunked": 2.0, "dropless/current": 1.2}
    ran = _run(PlanCheck(explore_every=2, max_regret=0.5, seed=0), predicted, true_s, 12)
    assert ran[1] == "dropless/current"
    assert ran[1:].count("dropless/current") >= len(ran) - 2


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


def test_corrections_follow_recent_measurements_and_ignore_empty_ones() -> None:
    check = PlanCheck(window=3, explore_every=0)
    for measured in (1.0, 1.0, 1.0, 4.0, 4.0):
        check.observe("x", 1.0, measured)
    assert check.correction("x") == pytest.approx(4.0)  # the window keeps the last three: 1, 4, 4
    check.observe("y", 0.0, 1.0)
    check.observe("y", 1.0, 0.0)
    assert check.samples("y") == 0
    with pytest.raises(ValueError, match="explore_every"):
        PlanCheck(explore_every=-1)
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
    assert check.noise("shadowing/current") == pytest.approx(0.05)
    assert offers[check.select(offers).index].arm == "pro_prophet/current"
    speed_only = PlanCheck(explore_every=0, balance_tolerance=0.0)
    _settle(speed_only, {"dropless/current": [1.3] * 5, "shadowing/current": [0.95, 1.05, 0.95, 1.05, 1.0],
                         "pro_prophet/current": [1.01, 1.06, 0.97, 1.03, 1.01]})
    assert offers[speed_only.select(offers).index].arm == "shadowing/current"


def test_balance_yields_to_speed_beyond_the_noise_and_to_the_guard() -> None:
    """Quiet measurements (no scatter) or a gap beyond the noise keep the faster plan; a replicating plan never
    displaces a faster arm that replicates nothing, however balanced."""
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
                      "pro_prophet/current": [1.02] * 5})
    assert offers[guarded.select(offers).index].arm == "dropless/current"
    with pytest.raises(ValueError, match="balance_tolerance"):
        PlanCheck(balance_tolerance=1.0)
