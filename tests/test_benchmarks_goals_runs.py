"""Goals over repeated full runs: which runs count for a goal, which run files belong to a benchmark, the code
revision each run records, and the results page built from the run files."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import goals as goals_module
from benchmarks import report
from benchmarks.goals import Goal, combine_runs, goal_line, worst_case, write_run

REGRET = Goal("regret_max", 0.05, "<=", "chosen over best minus 1, worst configuration", 52)


def _not_measured(goal: Goal) -> dict:
    """A goal record of a run whose leg did not run (as benchmarks.context_parallel.not_measured writes it)."""
    return {**worst_case(goal, {"only": 1.0}), "value": None, "worst_config": None, "met": None, "by_config": {},
            "note": "not built yet"}


@pytest.fixture
def results_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(goals_module, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(goals_module, "RESULTS_DIR", tmp_path)
    return tmp_path


def test_a_run_without_a_figure_for_a_goal_is_not_a_run_of_that_goal() -> None:
    runs = [{"goals": [_not_measured(REGRET)]} for _ in range(3)] + [{"goals": [worst_case(REGRET, {"a": 0.01})]}]
    entry = combine_runs(runs)["regret_max"]
    assert (entry["runs"], entry["unmeasured_runs"], entry["runs_meeting_goal"]) == (1, 3, "1/1")
    assert (entry["median"], entry["min"], entry["max"]) == (0.01, 0.01, 0.01)
    assert entry["met"] is None  # one measured run: undecided, not missed
    line = goal_line(entry)
    assert "undecided (1 of 3 runs measured it)" in line and "3 runs without a figure not counted" in line


def test_a_failed_configuration_still_counts_as_a_run_that_missed_and_a_vacuous_goal_as_met() -> None:
    failed = {"goals": [worst_case(REGRET, {"a": 0.01, "broken": None})]}
    vacuous = {"goals": [worst_case(REGRET, {}, vacuous="no configuration applies")]}
    entry = combine_runs([failed, vacuous, {"goals": [worst_case(REGRET, {"a": 0.01})]}])["regret_max"]
    assert (entry["runs"], entry["unmeasured_runs"], entry["runs_meeting_goal"], entry["met"]) == (3, 0, "2/3", False)


@pytest.mark.parametrize("name", ["float8.gpu", "moe_families.gpu"])
def test_full_runs_of_a_dotted_name_accumulate(results_dir: Path, name: str) -> None:
    speedup = Goal("speedup_min", 1.25, ">=", "ours over the baseline", 51)
    for value in (1.1, 1.3, 1.5):
        path = write_run(name, [], "measured", [worst_case(speedup, {"only": value})], quick=False)
    data = json.loads(path.read_text())
    assert data["run_files"] == [f"runs/{name}.{k}.json" for k in (1, 2, 3)]
    assert data["goal_runs"]["speedup_min"]["values"] == [1.1, 1.3, 1.5]


def test_run_files_of_another_benchmark_sharing_a_prefix_are_not_its_runs(results_dir: Path) -> None:
    (results_dir / "runs").mkdir()
    for file in ("moe.1.json", "moe.gpu.1.json", "moe.x.json", "moe.2.json"):
        (results_dir / "runs" / file).write_text("{}")
    assert [p.name for p in goals_module.run_paths("moe")] == ["moe.1.json", "moe.2.json"]
    assert [p.name for p in goals_module.run_paths("moe.gpu")] == ["moe.gpu.1.json"]


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


def test_the_code_revision_is_dirty_only_for_uncommitted_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.report import code_revision, revision_text

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "bench.py").write_text("x = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "one")
    monkeypatch.setattr(report, "REPO_ROOT", tmp_path)
    clean = code_revision()
    assert clean is not None and len(str(clean["commit"])) == 40 and clean["dirty"] is False
    (tmp_path / "benchmarks" / "results" / "bench.json").write_text("{}")
    assert code_revision() == clean  # a results file is not code
    (tmp_path / "benchmarks" / "bench.py").write_text("x = 2\n")
    assert code_revision() == {**clean, "dirty": True}
    assert revision_text(code_revision()) == f"{str(clean['commit'])[:10]} dirty"
    monkeypatch.setattr(report, "REPO_ROOT", tmp_path / "benchmarks" / "results")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path / "benchmarks"))
    assert code_revision() is None  # not a checkout


def test_every_run_file_records_the_code_revision(results_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    revision = {"commit": "a" * 40, "dirty": True}
    monkeypatch.setattr(report, "code_revision", lambda: revision)
    path = write_run("area", [], "measured", [worst_case(REGRET, {"a": 0.01})], quick=False)
    assert json.loads((results_dir / "runs" / "area.1.json").read_text())["revision"] == revision
    assert json.loads(path.read_text())["revision"] == revision
    quick = write_run("area", [], "measured", [worst_case(REGRET, {"a": 0.01})], quick=True)
    assert json.loads(quick.read_text())["revision"] == revision


def _area_files(results_dir: Path, runs: list[dict]) -> Path:
    (results_dir / "runs").mkdir(exist_ok=True)
    for index, run in enumerate(runs, start=1):
        (results_dir / "runs" / f"area.{index}.json").write_text(json.dumps(run))
    stale = combine_runs(runs[:1])  # a combination stored by an older writer: the page must not show it
    area = {**runs[-1], "run_files": [f"runs/area.{k}.json" for k in range(1, len(runs) + 1)], "goal_runs": stale}
    path = results_dir / "area.json"
    path.write_text(json.dumps(area))
    return path


def _run(revision: dict | None, goal: dict) -> dict:
    machine = {"cpu_count": 2, "usable_cpus": 2, "arch": "x86_64", "kernel": "k", "python": "3", "torch": "2"}
    return {"label": "measured", "machine": machine, "revision": revision, "goals": [goal], "rows": []}


def test_the_page_combines_the_run_files_and_names_runs_of_several_revisions(tmp_path: Path) -> None:
    from benchmarks.results_table import load, machine_line, with_runs

    one, two = {"commit": "1" * 40, "dirty": False}, {"commit": "2" * 40, "dirty": True}
    runs = [_run(one, _not_measured(REGRET)), _run(one, _not_measured(REGRET)),
            _run(two, worst_case(REGRET, {"a": 0.2}))]
    result = with_runs(load(_area_files(tmp_path, runs)), tmp_path)
    entry = result.data["goal_runs"]["regret_max"]
    assert (entry["runs"], entry["unmeasured_runs"], entry["met"]) == (1, 2, None)
    line = machine_line(result, tmp_path / "results.md")
    assert "**runs from 2 code revisions**: runs 1, 2: 1111111111; run 3: 2222222222 dirty" in line
    same = with_runs(load(_area_files(tmp_path, [_run(one, worst_case(REGRET, {"a": 0.01}))] * 3)), tmp_path)
    assert machine_line(same, tmp_path / "results.md").endswith("; code 1111111111 (all 3 runs).")
    old = load(_area_files(tmp_path, [_run(None, worst_case(REGRET, {"a": 0.01}))]))
    assert machine_line(with_runs(old, tmp_path), tmp_path / "results.md").endswith("; code revision not recorded.")
