"""The replay benchmark's statistics: a run's periods, rows and runs merged over repeats, the held-out runs, the
ranks' heap and the goals' worst cases (no processes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks._replay_microbatch import GUESSED_KIND, LINE_KIND, microbatch_rows, probe_sizes
from benchmarks.replay import (
    BASE,
    FULL,
    HELDOUT,
    PARTITIONED,
    QUICK,
    REPLAY_KIND,
    RUN_TO_RUN_KIND,
    SELF_REPLAY_KIND,
    WORKLOAD,
    Job,
    _row,
    _step_deltas,
    jobs_by_name,
    merge_rows,
    merge_runs,
    rank_environment,
    replay_goal,
    replay_rows,
    stage_blocks,
    summarize_run,
    whatif_goal,
)
from lightning_merak.planning.measure.probe import ProbedCurves
from lightning_merak.planning.replay.call_curve import CallCurve


def test_a_run_is_the_median_of_its_untraced_steps_after_warm_up() -> None:
    job = Job("pp2_m2", 1, 2, 1, 2, True, steps=10)  # warm-up 2, traced batches 2..4 (periods 1..3)
    periods = [9.0, 5.0, 5.0, 6.0, 1.0, 2.0, 3.0, 4.0, 100.0]
    waits = [0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 96.0]
    run = summarize_run(periods, waits, job)
    assert run["measured_steps"] == [4, 5, 6, 7, 8]
    assert run["period_s"] == 3.0
    assert run["traced_period_s"] == 5.0  # the last traced batch (it writes the trace) is left out
    assert run["cpu_wait_share"] == pytest.approx(0.5)
    assert run["period_less_cpu_wait_s"] == pytest.approx(1.5)
    untraced = summarize_run(periods, None, Job("tp2", 1, 1, 2, 1, False, steps=10))
    assert untraced["measured_steps"] == list(range(1, 9)) and untraced["traced_period_s"] is None
    assert "cpu_wait_share" not in untraced


def test_a_run_without_an_untraced_step_is_refused() -> None:
    with pytest.raises(ValueError, match="more steps"):
        summarize_run([1.0, 1.0, 1.0], None, Job("dp2", 2, 1, 1, 1, True, steps=4))


def test_step_deltas_take_the_slowest_rank_and_need_every_sample() -> None:
    sched = [[(0.0, 0.0), (1.0, 0.5), (2.0, 0.6)], [(0.0, 0.0), (0.5, 0.1), (1.5, 0.9)]]
    assert _step_deltas(sched, 1) == pytest.approx([0.5, 0.8])
    assert _step_deltas(sched, 0) == pytest.approx([1.0, 1.0])
    assert _step_deltas([[(0.0, 0.0), None]], 1) is None


def test_rows_merge_to_medians_and_keep_every_repeat_and_the_first_alone() -> None:
    repeats = [[_row("what-if", "a", 0.10, 0.20, overhead=0.1), _row("simulated", "b", 1.0, None, label="simulated")],
               [_row("what-if", "a", 0.12, 0.10, overhead=0.3), _row("simulated", "b", 2.0, None, label="simulated")],
               [_row("what-if", "a", 0.11, 0.11, overhead=0.2), _row("simulated", "b", 3.0, None, label="simulated")]]
    measured, simulated = merge_rows(repeats)
    assert measured["predicted_ms"] == pytest.approx(110.0) and measured["measured_ms"] == pytest.approx(110.0)
    assert measured["error"] == pytest.approx(0.0)
    assert measured["error_first_repeat"] == pytest.approx(-0.5)
    assert measured["errors_by_repeat"] == pytest.approx([-0.5, 0.2, 0.0])
    assert measured["error_paired"] == pytest.approx(0.0)  # the median of the repeats' own errors
    assert measured["measured_spread"] == pytest.approx(0.10 / 0.11)  # (max - min) / median
    assert measured["overhead"] == pytest.approx(0.2)
    assert simulated["predicted_ms"] == pytest.approx(2000.0) and simulated["measured_ms"] is None
    assert simulated["label"] == "simulated" and "error" not in simulated


def test_rows_of_repeats_must_agree() -> None:
    with pytest.raises(ValueError, match="disagree"):
        merge_rows([[_row("what-if", "a", 1.0, 1.0)], [_row("what-if", "b", 1.0, 1.0)]])
    with pytest.raises(ValueError, match="same rows"):
        merge_rows([[_row("what-if", "a", 1.0, 1.0)], []])


def test_runs_merge_to_the_median_period_beside_the_first_repeat() -> None:
    runs = merge_runs([{"dp2": {"period_s": 0.3, "trace": "/tmp/x"}}, {"dp2": {"period_s": 0.1, "trace": None}},
                       {"dp2": {"period_s": 0.2, "trace": None}}])
    assert runs["dp2"]["period_s"] == pytest.approx(0.2)
    assert runs["dp2"]["period_s_first_repeat"] == pytest.approx(0.3)
    assert runs["dp2"]["period_spread"] == pytest.approx(1.0)
    assert all("trace" not in run for run in runs["dp2"]["repeats"])


def test_every_mode_runs_valid_pipelines_with_untraced_steps_to_measure() -> None:
    from lightning_merak.parallel.layout import schedule_problem

    for mode in (QUICK, FULL):
        for job in jobs_by_name(mode).values():
            assert job.pp == 1 or schedule_problem(job.micro_batches, job.pp, "1f1b") is None, job
            assert WORKLOAD.global_batch % job.micro_batches == 0, job
            summarize_run([1.0] * (job.steps - 1), None, job)



def test_stage_blocks_from_a_partitions_graph_nodes() -> None:
    # node 0 is the embedding, nodes 1-4 the blocks, node 5 the head
    assert stage_blocks([0, 5], 4) == (4, 0)
    assert stage_blocks([0, 2], 4) == (1, 3)
    assert stage_blocks([0, 2, 4], 4) == (1, 2, 1)
    assert stage_blocks(None, 4) == ()


def _merged(kind: str, what: str, error: float, **extra: float) -> dict:
    return {"kind": kind, "what": what, "measured_ms": 10.0, "error": error, **extra}


def test_every_measured_what_if_row_counts_towards_the_what_if_goal() -> None:
    rows = [_merged("what-if link", "a", -0.1, error_first_repeat=0.3),
            _merged("what-if layout", "tp2 and a probe", 0.05),
            _merged("what-if layout (no probe)", "tp2 alone", 0.4),
            _merged(PARTITIONED, "pp2", -0.8), _merged(LINE_KIND, "pp2 M=4", 0.2),
            _merged(GUESSED_KIND, "pp2 M=4", 0.3),
            _merged(REPLAY_KIND, "dp2", 0.9), {"kind": "what-if (not measured)", "what": "dp2", "measured_ms": None}]
    goal = whatif_goal(rows)
    # the partition row (-80%) is the worst: no kind is left out, nor a row above the target; replay rows are not
    # what-ifs, and a row with nothing measured has no error
    assert goal["value"] == pytest.approx(0.8) and goal["worst_config"] == f"{PARTITIONED}: pp2"
    assert goal["met"] is False and len(goal["by_config"]) == 6
    assert whatif_goal([rows[0], {**rows[1], "error_first_repeat": 0.01}], "error_first_repeat")["value"] == (
        pytest.approx(0.3))


def test_the_replay_goal_is_the_worst_held_out_layout_never_the_traced_steps() -> None:
    rows = [_merged(REPLAY_KIND, "dp2", 0.02), _merged(REPLAY_KIND, "pp2_m2", -0.07),
            _merged(SELF_REPLAY_KIND, "dp2", 0.0), _merged(RUN_TO_RUN_KIND, "pp2_m2", 0.5)]
    goal = replay_goal(rows)
    assert goal["value"] == pytest.approx(0.07) and goal["worst_config"] == f"{REPLAY_KIND}: pp2_m2"
    assert goal["key"] == "replay_heldout_error_max" and goal["target"] == 0.05 and goal["met"] is False
    assert replay_goal(rows[:1])["met"] is True


def test_replay_rows_predict_the_held_out_run_from_the_trace_of_another() -> None:
    from lightning_merak.planning.replay.engine import measured_step_time, replay_trace
    from tests.test_profiler_calibration import _dp2_trace, _pp2_trace

    traces = {"dp2": _dp2_trace(), "pp2_m2": _pp2_trace()}
    traced = {"period_s": 0.2, "traced_period_s": 0.22}
    measured = {BASE: {"dp2": traced, "pp2_m2": traced},
                HELDOUT: {"dp2": {"period_s": 0.5}, "pp2_m2": {"period_s": 0.25, "cpu_wait_share": 0.1}}}
    rows = {(r["kind"], r["what"].split()[0]): r for r in replay_rows(measured, traces)}
    for name, held_out in (("dp2", 0.5), ("pp2_m2", 0.25)):
        replay = rows[(REPLAY_KIND, name)]
        assert replay["predicted_s"] == pytest.approx(replay_trace(traces[name]).step_time)
        assert replay["measured_s"] == held_out  # the other run's untraced steps, not the traced ones
        assert rows[(RUN_TO_RUN_KIND, name)]["predicted_s"] == 0.2 and rows[(RUN_TO_RUN_KIND, name)]["measured_s"] == (
            held_out)
        assert rows[(SELF_REPLAY_KIND, name)]["measured_s"] == pytest.approx(measured_step_time(traces[name]))
    assert rows[(REPLAY_KIND, "pp2_m2")]["measured_cpu_wait_share"] == 0.1


def test_the_held_out_runs_are_untraced_runs_of_the_traced_layouts_in_a_cluster_of_their_own() -> None:
    from benchmarks.replay import clusters_of, jobs_by_name

    for mode in (QUICK, FULL):
        clusters = {name: jobs for name, _, jobs in clusters_of(mode)}
        traced = {job.name: job for job in clusters[BASE] if job.traced}
        held_out = {job.name: job for job in clusters[HELDOUT]}
        assert set(held_out) == {"dp2", "pp2_m2"} <= set(traced) and not any(j.traced for j in held_out.values())
        assert all(held_out[n].layout() == traced[n].layout() == jobs_by_name(mode)[n].layout() for n in held_out)


def test_ranks_start_on_the_heap_merak3ds_launcher_gives_a_users_ranks() -> None:
    import os

    from lightning_merak.distributed.host_memory import HEAP_TUNABLES, export_heap_tunables

    env = rank_environment()
    launcher = dict(os.environ)
    export_heap_tunables(launcher)  # what merak3d's launcher sets for the ranks it starts
    assert env["GLIBC_TUNABLES"] == launcher["GLIBC_TUNABLES"]
    assert {f"{k}={v}" for k, v in HEAP_TUNABLES.items()} <= set(env["GLIBC_TUNABLES"].split(":"))
    assert not any(key.startswith("MALLOC_") for key in env)  # no benchmark-only heap
    assert "GLIBC_TUNABLES" not in rank_environment(default_heap=True)


def test_the_probe_sizes_are_the_traced_call_and_each_predicted_one() -> None:
    assert probe_sizes(8, (4, 8)) == (1, 2, 4)
    assert probe_sizes(8, (4,)) == (2, 4)


def test_micro_batch_rows_report_every_model_and_the_what_if_goal_counts_them_all() -> None:
    from tests.test_profiler_calibration import DP2, PP2, SHAPE, _dp2_trace, _pp2_trace

    curves = ProbedCurves(*(CallCurve((1.0, 2.0), (0.0015, 0.002), (0.002, 0.004)),) * 2,
                          CallCurve((1.0, 2.0), (0.0004, 0.0005), (0.0001, 0.0002)),
                          CallCurve((1.0, 2.0), (0.0002, 0.0004), (0.0003, 0.0006)))
    layouts = {"dp2": DP2, "pp2_m2": PP2, "pp2_m4": replace(PP2, micro_batches=4)}

    def rows_for(counts: tuple[int, ...]) -> list[dict]:
        runs = {"pp2_m2": {"period_s": 0.05, "partition": [0, 2]}, "pp2_m4": {"period_s": 0.06, "partition": [0, 2]}}
        return microbatch_rows({"dp2": _dp2_trace(), "pp2_m2": _pp2_trace()}, runs, layouts, counts, SHAPE, curves,
                               _row, PARTITIONED, lambda costs, name: replace(costs, stage_blocks=(1, 1)),
                               lambda costs, name: costs)[0]

    rows = rows_for((4,))
    assert [r["kind"] for r in rows] == ["what-if micro-batches", GUESSED_KIND, LINE_KIND, PARTITIONED]
    assert rows[0]["call_model"] == rows[3]["call_model"] != rows[1]["call_model"] != rows[2]["call_model"]
    assert rows[3]["predicted_s"] == pytest.approx(rows[0]["predicted_s"])  # the traced partition again
    # the trace's chunks hold 1 ms beyond their blocks: priced at 2x in backward it costs more micro-batches more
    # than the prefix's measured 0.1-0.2 ms
    assert rows[0]["predicted_s"] < rows[1]["predicted_s"]
    # asked for the traced count, the curve models give the traced run's period; the line re-derives the step
    traced = rows_for((2,))
    assert [r["predicted_s"] for r in traced[:2]] == pytest.approx([0.05, 0.05])
    assert traced[2]["predicted_s"] != pytest.approx(0.05, rel=0.01)
    scored = [{**r, "error": r["predicted_s"] / r["measured_s"] - 1, "measured_ms": 1e3 * r["measured_s"]}
              for r in rows]
    assert whatif_goal(scored)["value"] == pytest.approx(max(abs(r["error"]) for r in scored))


def test_micro_batch_rows_price_the_split_the_partitioner_is_expected_to_choose() -> None:
    from tests.test_profiler_calibration import DP2, PP2, SHAPE, _dp2_trace, _pp2_trace

    curves = ProbedCurves(*(CallCurve((1.0, 2.0), (0.0015, 0.002), (0.002, 0.004)),) * 4)
    layouts = {"dp2": DP2, "pp2_m2": PP2, "pp2_m4": replace(PP2, micro_batches=4)}
    runs = {"pp2_m2": {"period_s": 0.05, "partition": [0, 2]}, "pp2_m4": {"period_s": 0.06, "partition": [0, 2]}}

    def split(blocks: tuple[int, ...]):
        return lambda costs, name: replace(costs, stage_blocks=blocks)

    def rows_with(expected: tuple[int, ...]) -> list[dict]:
        return microbatch_rows({"dp2": _dp2_trace(), "pp2_m2": _pp2_trace()}, runs, layouts, (4,), SHAPE, curves,
                               _row, PARTITIONED, split((2, 0)), split(expected))[0]

    traced, moved = rows_with((1, 1)), rows_with((2, 0))
    # the goal's row follows the expected split (here the measured run's), the comparison rows keep the traced one
    assert moved[0]["predicted_s"] == pytest.approx(moved[3]["predicted_s"])
    assert moved[0]["predicted_s"] != pytest.approx(traced[0]["predicted_s"])
    assert [r["predicted_s"] for r in moved[1:3]] == pytest.approx([r["predicted_s"] for r in traced[1:3]])


def test_the_expected_split_is_autopipes_on_a_profile_of_the_ranks_model() -> None:
    from benchmarks._replay_partition import expected_stage_blocks
    from tests.test_replay_call_curve import TINY_LLAMA

    split = expected_stage_blocks(TINY_LLAMA, 64, 8, micro_batch_samples=2, stages=2, micro_batches=4, profiles=1)
    assert len(split) == 2 and sum(split) == 2
    with pytest.raises(ValueError, match="at least 2 stages"):
        expected_stage_blocks(TINY_LLAMA, 64, 8, micro_batch_samples=2, stages=1, micro_batches=4)


def test_paired_error_is_the_median_of_each_repeats_own() -> None:
    # a slow spell moves one repeat's prediction and measurement together: paired it cancels, medians do not
    repeats = [[_row("what-if", "a", p, m)] for p, m in ((0.10, 0.10), (0.20, 0.20), (0.11, 0.10), (0.09, 0.10))]
    (row,) = merge_rows(repeats)
    assert row["error"] == pytest.approx(0.105 / 0.10 - 1.0)
    assert row["error_paired"] == pytest.approx(0.0)
