"""The goal statistics every benchmark reports: worst case over a leg, spread and runs meeting over full runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import goals as goals_module
from benchmarks.goals import Goal, combine_runs, goal_line, worst_case, write_run

SPEEDUP = Goal("speedup_min", 1.0, ">=", "ours over the baseline, worst configuration", 49)
OVERHEAD = Goal("overhead_max", 0.3, "<=", "exposed over total, worst configuration", 49)


def test_the_worst_configuration_is_the_figure_for_either_direction() -> None:
    speed = worst_case(SPEEDUP, {"narrow": 0.8, "wide": 1.4, "large": 1.1})
    overhead = worst_case(OVERHEAD, {"dp2": 0.1, "dp4": 0.45})
    assert (speed["value"], speed["worst_config"], speed["met"]) == (0.8, "narrow", False)
    assert (overhead["value"], overhead["worst_config"], overhead["met"]) == (0.45, "dp4", False)
    assert worst_case(SPEEDUP, {"narrow": 1.0})["met"] is True


def test_a_failed_configuration_leaves_the_run_without_a_figure() -> None:
    record = worst_case(SPEEDUP, {"narrow": 1.5, "broken": None})
    assert record["value"] is None and record["met"] is None and record["missing"] == ["broken"]
    with pytest.raises(ValueError, match="no configuration"):
        worst_case(SPEEDUP, {})


def _runs(*values: float | None) -> list[dict]:
    return [{"goals": [worst_case(SPEEDUP, {"only": value})]} for value in values]


def test_runs_give_median_spread_and_count_meeting() -> None:
    entry = combine_runs(_runs(1.2, 0.9, 1.1))["speedup_min"]
    assert (entry["min"], entry["median"], entry["max"]) == (0.9, 1.1, 1.2)
    assert entry["runs_meeting_goal"] == "2/3" and entry["met"] is False  # every run must meet it by default
    assert "MISSED" in goal_line(entry) and "2/3" in goal_line(entry)


def test_a_goal_may_require_fewer_runs_and_is_undecided_before_three() -> None:
    lenient = Goal("balance_max", 1.25, "<=", "worst step", 49, runs_required=2)
    runs = [{"goals": [worst_case(lenient, {"c": value})]} for value in (1.1, 1.3, 1.2)]
    assert combine_runs(runs)["balance_max"]["met"] is True
    assert combine_runs(runs[:2])["balance_max"]["met"] is None


def test_a_goal_changed_between_runs_is_refused() -> None:
    moved = Goal("speedup_min", 0.9, ">=", "ours over the baseline, worst configuration", 49)
    runs = [*_runs(1.2), {"goals": [worst_case(moved, {"only": 1.0})]}]
    with pytest.raises(ValueError, match="changed between runs"):
        combine_runs(runs)


def test_full_runs_accumulate_and_the_area_file_carries_every_run(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(goals_module, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(goals_module, "RESULTS_DIR", tmp_path)
    for value in (1.2, 0.9, 1.1):
        path = write_run("area", [{"config": "only", "value": value}], "measured",
                         [worst_case(SPEEDUP, {"only": value})], quick=False, workload="tiny")
    data = json.loads(path.read_text())
    assert path == tmp_path / "area.json" and data["rows"] == [{"config": "only", "value": 1.1}]
    assert data["run_files"] == ["runs/area.1.json", "runs/area.2.json", "runs/area.3.json"]
    assert data["goal_runs"]["speedup_min"]["values"] == [1.2, 0.9, 1.1] and data["workload"] == "tiny"
    quick = write_run("area", [], "measured", [worst_case(SPEEDUP, {"only": 2.0})], quick=True)
    assert quick == tmp_path / "area.quick.json" and len(goals_module.run_paths("area")) == 3


def test_the_results_page_lists_every_goal_with_its_definition_and_verdict() -> None:
    from benchmarks.results_table import Result, goals_section

    runs = _runs(1.2, 0.9, 1.1)
    result = Result(Path("area.json"), "area", False, {"goal_runs": combine_runs(runs)})
    text = "\n".join(goals_section({"area": result, "other": None}))
    assert "`speedup_min`" in text and SPEEDUP.definition in text
    assert "**missed**" in text and "2/3" in text and "0.9 – 1.2" in text


def test_a_goal_with_no_applicable_configuration_is_met_only_when_declared_vacuous() -> None:
    record = worst_case(SPEEDUP, {}, vacuous="auto picked S2 nowhere")
    assert record["met"] is True and record["value"] is None and "auto picked S2 nowhere" in record["note"]


def test_a_leg_run_on_its_own_decides_its_goal_over_the_main_runs_placeholder() -> None:
    """The main run records a goal it does not measure (no figure, with a note); the leg's own full runs carry the
    figure, and the goals table shows the leg's verdict."""
    from benchmarks.results_table import Result, _with_leg_goals, goals_section

    goal = Goal("leg_speedup", 1.2, ">=", "a leg's speedup", issue=52)
    placeholder = {**worst_case(goal, {"x": None}), "note": "not measured by this run"}
    main = {"goals": [placeholder], "goal_runs": combine_runs([{"goals": [placeholder]}] * 3)}
    leg_runs = combine_runs([{"goals": [worst_case(goal, {"mix": value})]} for value in (1.3, 1.25, 1.4)])
    merged = _with_leg_goals(main, leg_runs)
    assert merged["goals"] == [] and merged["goal_runs"]["leg_speedup"]["median"] == 1.3
    text = "\n".join(goals_section({"context_parallel": Result(Path("c.json"), "context_parallel", False, merged)}))
    assert "| 1.3 | 1.25 – 1.4 | 3/3 | met |" in text
