"""Goals a benchmark is judged by, the worst case over its leg, and the spread over repeated full runs.

A goal is fixed by the issue that set it: its JSON key, target, direction, the workload it runs, the baseline
it is compared with and the statistic. Each run reports a goal's **worst case** over every configuration of
its leg (:func:`worst_case`); the full benchmark runs at least three times, and :func:`combine_runs` gives the
spread (min / median / max over runs) and how many runs met the goal. Means of ratios are never goal figures.

A full run writes ``results/runs/NAME.K.json`` (:func:`write_run`, ``K`` counting up) and then ``results/NAME.json``:
the latest run's payload plus ``goal_runs``, every goal over every run so far (:func:`combine_runs`). Every file
records the code's revision (:func:`benchmarks.report.code_revision`). A ``--quick``
run writes ``results/NAME.quick.json`` only, with its one run in ``goal_runs``. ``benchmarks.results_table``
shows ``goal_runs`` under each area and in the goals table at the top of ``docs/results.md``.

Importing this module does not import torch.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from benchmarks.report import RESULTS_DIR, Label, write_json

Direction = Literal["<=", ">="]
RUNS_DIR = RESULTS_DIR / "runs"
FULL_RUNS = 3
"""How many full runs a goal's figure is taken over (the rules of ``docs/results.md``)."""

RULES = """\
1. **The baseline is what our user would otherwise run, at its defaults**: transformers' default experts
   implementation, Lightning's `DDPStrategy` / `ModelParallelStrategy`, DeepSpeed with the same clipping and
   precision, torch's own tools. Where ours gets a tuned knob (bucket size, threads), the baseline gets the same
   knob, or both run at defaults; both are reported where they differ.
2. **Ours runs at its defaults.** A non-default option is a separate, labelled row.
3. **A goal's figure is the worst case** over the configurations of its leg (every rung, layout, family, width),
   and each full benchmark is run at least 3 times: the table gives min / median / max over the runs that
   measured the goal (a run whose leg did not run is not counted) and how many met it. Every run records its code
   revision, and an area whose runs come from different revisions says so. Means of ratios are not goal statistics.
4. **Goals are fixed by the issue that set them.** A miss is reported as a miss, with its measured cause; the
   workload, baseline and statistic never change after a failing run. A new workload is a new leg beside the old.
5. **Benchmark ranks run in the environment the product gives a user's ranks** (the launcher's settings, the
   same for the baselines); no benchmark-only heap or pinning for ours alone.
6. **Predictions are held out**: a replay predicts a run it was not calibrated on, and the planner's error is
   leave-one-layout-out.
7. Misses are shown as misses, with their spread, and each goal's definition stands next to its figure."""


@dataclass(frozen=True)
class Goal:
    """One goal: ``key`` (its JSON key) must be ``direction`` ``target`` in its worst configuration."""

    key: str
    target: float
    direction: Direction
    definition: str
    """Workload, baseline and statistic, in one sentence a reader can check against the code."""
    issue: int
    """The issue that fixed it."""
    runs_required: int | None = None
    """Runs (of the full runs) that must meet it; None: every run."""

    def meets(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value <= self.target if self.direction == "<=" else value >= self.target

    def worse(self, a: float, b: float) -> float:
        """The worse of two figures for this goal."""
        return max(a, b) if self.direction == "<=" else min(a, b)


def worst_case(goal: Goal, by_config: Mapping[str, float | None], note: str | None = None,
               vacuous: str | None = None) -> dict[str, Any]:
    """``goal``'s figure for one run: the worst value over ``by_config`` (configuration name → figure).

    A configuration with no figure (``None``: it failed or was refused) makes the run's figure ``None``, so a
    failing configuration can never be dropped to let the goal pass. A goal that applies only where a condition
    holds ("wherever auto picks S2") may have no configuration: ``vacuous`` then says why, and the goal is met
    with no figure; without it an empty leg is an error.
    """
    if not by_config and vacuous is not None:
        return {**asdict(goal), "value": None, "worst_config": None, "met": True, "missing": [], "by_config": {},
                "note": f"met vacuously: {vacuous}" + (f"; {note}" if note else "")}
    if not by_config:
        raise ValueError(f"goal {goal.key}: no configuration measured")
    missing = sorted(name for name, value in by_config.items() if value is None)
    measured = {name: float(value) for name, value in by_config.items() if value is not None}
    value: float | None = None
    worst: str | None = None
    if not missing:
        worst = max(measured, key=measured.__getitem__) if goal.direction == "<=" else min(
            measured, key=measured.__getitem__)
        value = measured[worst]
    return {**asdict(goal), "value": value, "worst_config": worst, "met": goal.meets(value),
            "missing": missing, "by_config": {name: by_config[name] for name in by_config}, "note": note}


def has_figure_or_verdict(goal: Mapping[str, Any]) -> bool:
    """Whether a run's goal record is a run of that goal: it has a figure, a verdict (met vacuously), or a
    configuration that failed (a failure is a run that missed). A record with none of them (its leg was not run,
    or not built then) is not a run of that goal."""
    return goal["value"] is not None or goal["met"] is not None or bool(goal.get("missing"))


def combine_runs(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every goal over ``runs`` (run payloads with a ``goals`` list from :func:`worst_case`).

    Only the runs that measured a goal count for it (:func:`has_figure_or_verdict`; ``unmeasured_runs`` counts
    the others). The median over those runs is the headline; min / max give the spread; ``met`` holds when at
    least ``runs_required`` of them (all by default) met the goal and at least :data:`FULL_RUNS` were made
    (fewer leave ``met`` None: not yet decided, not missed).
    """
    combined: dict[str, dict[str, Any]] = {}
    for index, run in enumerate(runs):
        for goal in run.get("goals", []):
            entry = combined.setdefault(goal["key"], {
                key: goal[key] for key in ("key", "target", "direction", "definition", "issue", "runs_required")})
            if (entry["target"], entry["direction"], entry["definition"]) != (
                    goal["target"], goal["direction"], goal["definition"]):
                raise ValueError(f"goal {goal['key']} changed between runs: run {index + 1} has target "
                                 f"{goal['direction']} {goal['target']} ({goal['definition']!r}); a changed goal is "
                                 "a new goal with its own key")
            entry.setdefault("unmeasured_runs", 0)
            if not has_figure_or_verdict(goal):
                entry["unmeasured_runs"] += 1
                continue
            entry.setdefault("values", []).append(goal["value"])
            entry.setdefault("worst_configs", []).append(goal["worst_config"])
            entry.setdefault("met_by_run", []).append(goal["met"])
    for entry in combined.values():
        measured = entry.setdefault("values", [])
        entry.setdefault("worst_configs", [])
        values = [v for v in measured if v is not None]
        meeting = sum(1 for met in entry.setdefault("met_by_run", []) if met)
        runs_made = len(measured)
        required = entry["runs_required"] or runs_made
        entry.update(
            runs=runs_made, runs_meeting_goal=f"{meeting}/{runs_made}",
            min=min(values) if values else None, max=max(values) if values else None,
            median=statistics.median(values) if len(values) == runs_made and values else None,
            met=None if runs_made < FULL_RUNS else meeting >= required)
    return combined


RUN_FILE = r"\.(\d+)\.json"
"""A full run's file name after the benchmark's name: ``NAME.<K>.json``."""


def _run_index(name: str, path: Path) -> int | None:
    match = re.fullmatch(re.escape(name) + RUN_FILE, path.name)
    return int(match.group(1)) if match else None


def run_paths(name: str) -> list[Path]:
    """The full runs of benchmark ``name`` so far (``results/runs/NAME.K.json``, ``name`` may hold dots), oldest
    first."""
    indexed = {path: _run_index(name, path) for path in RUNS_DIR.glob(f"{name}.*.json")}
    return sorted((path for path, index in indexed.items() if index is not None), key=indexed.__getitem__)


def write_run(name: str, rows: Sequence[Mapping[str, object]], label: Label, goals: Sequence[Mapping[str, Any]],
              quick: bool, out: Path | None = None, **context: object) -> Path:
    """Write one run of benchmark ``name`` with its ``goals`` (:func:`worst_case` results) and return the path
    of the file ``benchmarks.results_table`` reads.

    A quick run (or one with an explicit ``out``) writes that one file. A full run is saved as the next
    ``results/runs/NAME.K.json`` and ``results/NAME.json`` is rewritten: this run plus every goal over the runs.
    """
    goals = list(goals)
    if quick or out is not None:
        path = out or RESULTS_DIR / f"{name}.quick.json"
        return write_json(path, rows, label, **context, goals=goals, goal_runs=combine_runs([{"goals": goals}]))
    existing = run_paths(name)
    next_index = 1 + max((_run_index(name, path) or 0 for path in existing), default=0)
    run_path = write_json(RUNS_DIR / f"{name}.{next_index}.json", rows, label, **context, goals=goals)
    runs = [json.loads(path.read_text()) for path in run_paths(name)]
    latest = json.loads(run_path.read_text())
    return write_json(RESULTS_DIR / f"{name}.json", latest.pop("rows"), label,
                      **{k: v for k, v in latest.items() if k not in ("label", "machine", "revision")},
                      run_files=[str(p.relative_to(RESULTS_DIR)) for p in run_paths(name)],
                      goal_runs=combine_runs(runs))


def goal_line(entry: Mapping[str, Any]) -> str:
    """One goal over its runs, for a console or a page: key, median and spread, target, runs meeting it."""
    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    spread = "" if entry["runs"] < 2 else f" [{number(entry['min'])}–{number(entry['max'])}]"
    verdict = {True: "met", False: "MISSED", None: undecided(entry)}[entry["met"]]
    return (f"{entry['key']} {number(entry['median'])}{spread} (goal {entry['direction']} {entry['target']:g}; "
            f"{runs_meeting(entry)}): {verdict}")


def undecided(entry: Mapping[str, Any]) -> str:
    """Why a goal has no verdict yet: how many runs measured it, of the :data:`FULL_RUNS` a verdict needs."""
    return f"undecided ({entry['runs']} of {FULL_RUNS} runs measured it)"


def runs_meeting(entry: Mapping[str, Any]) -> str:
    """How many of the runs that measured a goal met it, and how many runs had no figure for it."""
    unmeasured = entry.get("unmeasured_runs", 0)
    return f"{entry['runs_meeting_goal']} runs meet it" + (
        f"; {unmeasured} run{'s' if unmeasured > 1 else ''} without a figure not counted" if unmeasured else "")


def print_goals(goals: Sequence[Mapping[str, Any]]) -> None:
    """This run's goals, worst configuration named, for the console."""
    for goal in goals:
        value = "-" if goal["value"] is None else f"{goal['value']:.3g}"
        where = f"failed: {', '.join(goal['missing'])}" if goal["missing"] else f"worst at {goal['worst_config']}"
        verdict = {True: "met", False: "MISSED", None: "no figure"}[goal["met"]]
        print(f"goal {goal['key']} {value} ({where}; goal {goal['direction']} {goal['target']:g}): {verdict}")
