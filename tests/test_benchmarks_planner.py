"""The planner benchmark's rows from several rounds of planning and measuring."""

from __future__ import annotations

import pytest

from benchmarks.planner import Measured, combine_rounds


def _prediction(dp: int, pp: int, tp: int, step_s: float, samples: int) -> dict:
    return {"layout": {"dp": dp, "pp": pp, "tp": tp, "micro_batches": 1 if pp == 1 else 4, "overlap": 1},
            "step_s": step_s, "samples": samples, "components": {"compute": step_s}}


def test_rows_take_median_predictions_and_measurements_and_rank_per_sample():
    # Round 2 planned in another order and on a slower machine; round 3 on a faster one.
    plans = [
        [_prediction(2, 1, 1, 0.20, 16), _prediction(1, 2, 1, 0.15, 8)],
        [_prediction(1, 2, 1, 0.18, 8), _prediction(2, 1, 1, 0.24, 16)],
        [_prediction(2, 1, 1, 0.18, 16), _prediction(1, 2, 1, 0.14, 8)],
    ]
    measured = [[Measured(0.22, 0.21), Measured(0.16, 0.16)], [Measured(0.25, 0.20), Measured(0.19, 0.17)],
                [Measured(0.19, 0.20), Measured(0.15, 0.16)]]
    rows = combine_rounds(plans, measured)
    assert [row["layout"] for row in rows] == ["dp2 pp1 tp1 M1 k1", "dp1 pp2 tp1 M4 k1"]
    data_parallel, pipeline = rows
    assert data_parallel["predicted_s"] == pytest.approx(0.20)
    assert data_parallel["predicted_rounds_s"] == [0.20, 0.24, 0.18]
    assert data_parallel["measured_s"] == pytest.approx(0.22)
    assert data_parallel["error"] == pytest.approx(0.20 / 0.22 - 1)
    assert data_parallel["measured_per_sample_ms"] == pytest.approx(1e3 * 0.22 / 16)
    # each run against its own plan: -4.5%, -20%, +5.3% -> the median round
    assert data_parallel["paired_error"] == pytest.approx(0.21 / 0.22 - 1)
    assert data_parallel["paired_predicted_rounds_s"] == [0.21, 0.20, 0.20]
    assert pipeline["predicted_s"] == pytest.approx(0.15)
    assert pipeline["measured_rounds_s"] == [0.16, 0.19, 0.15]
    assert pipeline["predicted_components_s"] == {"compute": 0.15}


def test_a_failed_run_marks_the_layout_and_other_layouts_are_refused():
    plans = [[_prediction(2, 1, 1, 0.2, 16), _prediction(1, 1, 2, 0.3, 8)]] * 2
    rows = combine_rounds(plans, [[Measured(0.2, 0.2), Measured(0.3, 0.3)],
                                  [Measured(0.21, 0.2), "rank 1 ran out of memory"]])
    failed = next(row for row in rows if row["layout"] == "dp1 pp1 tp2 M1 k1")
    assert failed["measured_s"] == "rank 1 ran out of memory" and "error" not in failed
    assert failed["measured_rounds_s"] == [0.3]
    with pytest.raises(ValueError, match="round 2 planned other layouts"):
        combine_rounds([plans[0], [_prediction(2, 1, 1, 0.2, 16)]],
                       [[Measured(0.2, 0.2), Measured(0.3, 0.3)], [Measured(0.2, 0.2)]])


def test_rows_keep_each_runs_pipeline_split():
    plans = [[_prediction(1, 2, 1, 0.15, 8)]] * 2
    rows = combine_rounds(plans, [[Measured(0.16, 0.15, [3, 1])], [Measured(0.17, 0.15, [2, 2])]])
    assert rows[0]["stage_blocks_rounds"] == [[3, 1], [2, 2]]


def test_a_calibration_run_reports_its_traced_window_and_untraced_median():
    import dataclasses

    from benchmarks.planner import _calibration_run
    from tests.test_profiler_calibration import _dp2_trace

    trace = dataclasses.replace(_dp2_trace(), meta={"untraced_step_s": [0.09, 0.08, 0.07, 0.30]})
    run = _calibration_run("dp2", trace)
    assert run["traced_step_s"] == pytest.approx(0.100)
    assert run["untraced_median_s"] == pytest.approx(0.085)
    assert run["untraced_steps_s"] == [0.09, 0.08, 0.07, 0.30]
    assert _calibration_run("dp2", _dp2_trace())["untraced_median_s"] is None


def test_split_agreement_counts_the_pipeline_runs_priced_at_their_own_split():
    from benchmarks.planner import split_agreement

    rows = [{"stage_blocks_rounds": [None, None], "replay_stage_blocks_rounds": [None, None]},
            {"stage_blocks_rounds": [[3, 1], [2, 2], [3, 1]], "replay_stage_blocks_rounds": [[3, 1], [3, 1], [3, 1]]},
            {"stage_blocks_rounds": [[2, 2]], "replay_stage_blocks_rounds": [[2, 2]]}]
    assert split_agreement(rows) == pytest.approx(3 / 4)
    assert split_agreement(rows[:1]) is None


def test_calibration_groups_price_every_layout_once_base_first():
    from benchmarks.planner import PROBE_LAYERS, calibration_groups

    plan = [_prediction(2, 1, 1, 0.2, 16), _prediction(1, 2, 1, 0.15, 8), _prediction(1, 1, 2, 0.3, 8)]
    plan[1]["layout"]["micro_batches"] = 8
    plan += [{**_prediction(1, 2, 1, 0.15, 8), "layout": {**plan[1]["layout"], "micro_batches": 2}},
             {**_prediction(1, 1, 2, 0.3, 8), "layout": {**plan[2]["layout"], "overlap": 4}}]
    groups = calibration_groups(plan)
    assert [g.name for g in groups] == ["dp2", "pp2 M2", "tp2 k1 probe", "tp2 k4 probe"]
    assert [g.layouts for g in groups] == [["dp2 pp1 tp1 M1 k1"], ["dp1 pp2 tp1 M8 k1", "dp1 pp2 tp1 M2 k1"],
                                           ["dp1 pp1 tp2 M1 k1"], ["dp1 pp1 tp2 M1 k4"]]
    assert groups[1].merak["micro_batches"] == 2 and groups[1].spec.micro_batches == 2 and groups[1].layers == 0
    assert groups[3].merak["tp_overlap"] == 4 and groups[3].layers == PROBE_LAYERS and groups[3].spec.overlap == 4
    # a grid without pipelines or data-parallel layouts still traces the base run every probe borrows links from
    assert [(g.name, g.layouts) for g in calibration_groups(plan[2:3])] == [
        ("dp2", []), ("tp2 k1 probe", ["dp1 pp1 tp2 M1 k1"])]


def _row(layout: str, predicted_s: float, measured_s: float | str, samples: int, **extra: float) -> dict:
    row = {"layout": layout, "predicted_s": predicted_s, "measured_s": measured_s, "samples": samples, **extra}
    if isinstance(measured_s, float):
        row.update(error=predicted_s / measured_s - 1.0, measured_per_sample_ms=1e3 * measured_s / samples)
    return row


def test_the_error_goal_is_the_worst_layout_and_a_failed_layout_leaves_no_figure():
    from benchmarks.planner import planner_goals

    rows = [_row("dp2", 0.20, 0.21, 16), _row("pp2 M4", 0.15, 0.10, 8), _row("tp2", 0.30, 0.31, 8)]
    error, _ = planner_goals(rows)
    assert error["key"] == "error_max_leave_one_out" and error["target"] == 0.10
    assert error["value"] == pytest.approx(0.5) and error["worst_config"] == "pp2 M4" and error["met"] is False
    failed, _ = planner_goals([*rows[:1], _row("tp2", 0.30, "rank 1 ran out of memory", 8)])
    assert failed["value"] is None and failed["missing"] == ["tp2"]


def test_regret_is_the_picks_measured_time_per_sample_over_the_best():
    from benchmarks.planner import planner_goals, regret_of

    # predicted per sample: dp2 0.0125 s, pp2 0.01875 s, so dp2 is picked; measured, pp2 is faster per sample
    rows = [_row("dp2", 0.20, 0.40, 16), _row("pp2 M4", 0.15, 0.16, 8)]
    pick, regret = regret_of(rows)
    assert pick["layout"] == "dp2"
    assert regret == pytest.approx((0.40 / 16) / (0.16 / 8) - 1.0)
    _, goal = planner_goals(rows)
    assert goal["key"] == "regret" and goal["value"] == pytest.approx(0.25) and goal["met"] is False
    replay_pick, replay_regret = regret_of([{**r, "loo": p} for r, p in zip(rows, (1.0, 0.1))], "loo")
    assert replay_pick["layout"] == "pp2 M4" and replay_regret == pytest.approx(0.0)


def test_a_held_out_replay_rests_on_no_calibration_run_of_its_layout():
    from benchmarks.planner import PROBE_LAYERS, calibration_groups, held_out_groups

    plan = [_prediction(2, 1, 1, 0.2, 16), _prediction(1, 2, 1, 0.15, 8), _prediction(1, 1, 2, 0.3, 8),
            {**_prediction(1, 2, 1, 0.15, 8), "layout": {"dp": 1, "pp": 2, "tp": 1, "micro_batches": 2,
                                                          "overlap": 1}}]
    groups = calibration_groups(plan)  # dp2, pp2 M2 (the middle count), tp2 k1 probe
    assert [g.name for g in held_out_groups(groups, "dp2 pp1 tp1 M1 k1")] == ["pp2 M2", "tp2 k1 probe"]
    assert [g.name for g in held_out_groups(groups, "dp1 pp2 tp1 M2 k1")] == ["dp2", "tp2 k1 probe"]
    assert [g.name for g in held_out_groups(groups, "dp1 pp2 tp1 M4 k1")] == ["dp2", "pp2 M2", "tp2 k1 probe"]
    # the probe is the tp2 layout on a model cut to PROBE_LAYERS blocks: still a run of that layout
    assert groups[2].layers == PROBE_LAYERS
    assert [g.name for g in held_out_groups(groups, "dp1 pp1 tp2 M1 k1")] == ["dp2", "pp2 M2"]
    assert held_out_groups(groups[:1], "dp2 pp1 tp1 M1 k1") is None


def test_the_goal_predicts_with_the_default_planner_calibration():
    import inspect

    from benchmarks.planner import _plan
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    # the goal's predictions are the default (analytic) planner's: its plan names no calibration traces
    assert inspect.signature(Merak3DStrategy).parameters["planner_calibration"].default == "analytic"
    assert "planner_calibration" not in inspect.getsource(_plan)


def test_ranks_start_on_the_heap_merak3ds_launcher_gives_a_users_ranks():
    import sys

    from benchmarks.planner import prepare_rank_heap
    from lightning_merak.distributed.host_memory import HEAP_TUNABLES, with_heap_tunables

    environ: dict[str, str] = {}
    described = prepare_rank_heap(False, environ)
    if sys.platform.startswith("linux"):
        assert environ == {"GLIBC_TUNABLES": with_heap_tunables({})} and described == environ["GLIBC_TUNABLES"]
        assert set(described.split(":")) == {f"{k}={v}" for k, v in HEAP_TUNABLES.items()}
    untouched: dict[str, str] = {}
    assert prepare_rank_heap(True, untouched) == "glibc defaults" and untouched == {}
