"""The goals of benchmarks.dynapipe and benchmarks.delta: the worst layout or leg of a run, recorded as goal records,
with the workload (attention implementation, DELTA's budget) in their text; and their results-page sections."""

from __future__ import annotations

from typing import Any

from benchmarks.goals import combine_runs

DELTA_BUDGET = "budget: 0.25 x the no-swap run's peak"


def _dynapipe_rows() -> list[dict[str, Any]]:
    speeds = {"dp1-pp2": {"pad": 1000.0, "pack": 4000.0, "dynamic": 10000.0},
              "dp2-pp2": {"pad": 2000.0, "pack": 8000.0, "dynamic": 10400.0}}
    return [{"layout": layout, "mode": mode, "step_ms": 1e6 / speed, "real_tokens_per_s": speed,
             "padding_fraction": 0.1, "bubble": 0.2, "micro_batches_per_replica": [4], "losses": [1.0]}
            for layout, by_mode in speeds.items() for mode, speed in by_mode.items()]


def test_dynapipe_goals_are_the_worst_layout_and_name_the_attention() -> None:
    from benchmarks.dynapipe import goal_figures

    vs_pack, vs_pad = goal_figures(_dynapipe_rows())
    assert (vs_pack["value"], vs_pack["worst_config"], vs_pack["met"]) == (1.3, "dp2-pp2", True)
    assert (vs_pad["value"], vs_pad["worst_config"]) == (5.2, "dp2-pp2")
    assert all("eager attention in every mode" in goal["definition"] for goal in (vs_pack, vs_pad))


def test_the_dynapipe_section_shows_every_layout_and_the_attention() -> None:
    from benchmarks.dynapipe import goal_figures, speedups_by_layout
    from benchmarks.results_table import dynapipe

    rows = _dynapipe_rows()
    data = {"rows": rows, "speedups_by_layout": speedups_by_layout(rows), "model": {"attn_implementation": "eager"},
            "loss_max_rel_diff": 1e-7, "note": "noisy", "goal_runs": combine_runs([{"goals": goal_figures(rows)}]),
            "settings": {"context": 1024, "batch": 32, "measured": 3}}
    notes = "\n".join(dynapipe(data).notes)
    assert "dp1-pp2: 2.50× / 10.00×; dp2-pp2: 1.30× / 5.20×" in notes
    assert "attention: eager in every mode" in notes and "headline" not in notes


def _delta_row(leg: str, config: str, activation: float, allocated: float, time: float) -> dict[str, Any]:
    return {"leg": leg, "config": config, "batch": 8, "activation_vs_none": activation,
            "allocated_vs_none": allocated, "time_vs_none": time, "budget_MiB": 63.9}


def _delta_rows() -> list[dict[str, Any]]:
    return [_delta_row("equal batch, glibc-default", "none", 1.0, 1.0, 1.0),
            _delta_row("equal batch, glibc-default", "delta", 0.26, 0.27, 1.0),
            _delta_row("equal batch, glibc-default", "delta-paper-rule", 0.5, 0.5, 2.0),
            _delta_row("equal batch, glibc-no-trim", "delta", 0.31, 0.27, 1.02),
            _delta_row("sweep hidden 128", "delta", 0.35, 0.26, 1.23),
            _delta_row("sweep hidden 512", "delta", 0.39, 0.27, 1.0),
            {"leg": "max batch", "config": "none", "batch": 8, "batch_vs_none": 1.0},
            {"leg": "max batch", "config": "delta", "batch": 32, "batch_vs_none": 4.0}]


def test_delta_targets_are_the_worst_delta_row_over_every_leg_with_the_budget_in_their_text() -> None:
    from benchmarks.delta import goal_figures

    rss, allocated, step, max_batch = goal_figures(_delta_rows(), 0.25)
    assert (rss["value"], rss["worst_config"], rss["met"]) == (0.39, "sweep hidden 512", True)
    assert allocated["value"] == 0.27
    assert (step["value"], step["worst_config"], step["met"]) == (1.23, "sweep hidden 128", False)
    assert (max_batch["value"], max_batch["met"]) == (4.0, True)
    assert all(DELTA_BUDGET in goal["definition"] for goal in (rss, allocated, step))


def test_the_delta_section_names_the_budget_on_each_budgeted_row() -> None:
    from benchmarks.results_table import delta

    table = delta({"rows": _delta_rows(), "delta_budget_fraction": 0.25, "memory_budget_MiB": 389.0,
                   "gpu_leg": "run separately"})
    budgeted = [row for row in table.rows if row[0] != "max batch"]
    assert budgeted and all(DELTA_BUDGET in row[1] and "63.9 MiB" in row[1] for row in budgeted)
    assert not any("targets" in note for note in table.notes)
