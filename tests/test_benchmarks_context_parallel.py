"""The context-parallel benchmark: its baseline, rows, goal statistics and verdicts from rank results (no processes)."""

from __future__ import annotations

import json

import pytest

from benchmarks._context_parallel_ranks import (
    ALL_TO_ALL,
    LADDER,
    RING,
    SDPA,
    TORCH,
    Job,
    Workload,
    build_model,
    rank_file,
)
from benchmarks.context_parallel import (
    ACTIVATION,
    EFFICIENCY,
    FULL,
    LONGEST,
    LOSS,
    PLANNER_REGRET,
    QUICK,
    RATES_MBIT,
    VARIABLE_SPEEDUP,
    Setting,
    check_setting,
    compare,
    failures,
    goal_figures,
    job_row,
    longest_rung,
    longest_sequence_leg,
    plan_jobs,
    read_outcomes,
)
from benchmarks.goals import combine_runs
from benchmarks.results_table import context_parallel as table

TEN, ONE = "10Gbit", "1Gbit"


def _rank(method: str, seq: int, steps: list[tuple[float, float]], saved: int, cp: int = 2) -> dict:
    """A rank's result: per step (step_s, loss); ``saved`` its saved bytes, also the worst over the ranks."""
    return {"method": method, "seq": seq, "cp": cp, "saved_bytes": saved, "saved_bytes_worst": saved,
            "steps": [{"step_s": step, "cpu_s": step / 2, "loss": loss} for step, loss in steps]}


def _idle(seq: int, saved: int) -> dict:
    return {"method": SDPA, "seq": seq, "cp": 1, "idle": True, "saved_bytes": 0, "saved_bytes_worst": saved,
            "steps": []}


def _row(method: str, seq: int, step_s: float, saved: int, loss: float = 2.0, network: str = TEN,
         world_size: int = 2) -> dict:
    """A finished row of one step on every rank (no warm-up)."""
    cp = 1 if method == SDPA else world_size
    outcome = [_rank(method, seq, [(step_s, loss)], saved, cp)]
    if method == SDPA:
        outcome += [_idle(seq, saved)] * (world_size - 1)
    else:
        outcome *= world_size
    return job_row(world_size, network, 1.0, Job(method, seq, 1), outcome, warmup=0)


def test_the_baseline_is_transformers_sdpa_on_one_rank_without_context_parallelism():
    from lightning_merak.parallel.context.model import ContextParallelForward

    small = Workload(max_positions=256)
    for method in (SDPA, TORCH):  # torch's baseline wraps the model as transformers builds it
        model = build_model(small, method)
        assert model.config._attn_implementation == "sdpa"
        assert not isinstance(model.forward, ContextParallelForward)
        assert not any(hasattr(module, "_merak_context") for module in model.modules())
    # cp=1 runs before ours at every sequence, on the goal rate's run only (rank 0 alone), torch's baseline last
    jobs = plan_jobs(FULL, 4, RATES_MBIT[0])
    trained = [job for job in jobs if job.method in (SDPA, RING, ALL_TO_ALL)]
    assert [(job.method, job.seq) for job in trained] == [
        (method, seq) for seq in FULL.sequences for method in (SDPA, RING, ALL_TO_ALL)]
    assert [job.method for job in jobs[-len(FULL.sequences):]] == [TORCH] * len(FULL.sequences)
    assert {job.ladder_method for job in jobs if job.method == LADDER} == {SDPA, RING, ALL_TO_ALL}
    assert all(job.method in (RING, ALL_TO_ALL) for job in plan_jobs(FULL, 4, RATES_MBIT[1]))
    assert not any(job.method == LADDER for job in plan_jobs(FULL, 2, RATES_MBIT[0]))


def test_settings_are_valid_and_bad_ones_are_refused_before_any_rank_starts():
    for setting in (QUICK, FULL):
        check_setting(setting, Workload())
    assert FULL.context_parallel == (2, 4) and FULL.sequences == (4096, 8192, 16384)
    assert QUICK.context_parallel == (2,) and QUICK.sequences == (1024, 2048)
    with pytest.raises(ValueError, match="key/value heads"):
        check_setting(FULL, Workload(kv_heads=2))
    with pytest.raises(ValueError, match="multiple of 2 x cp=4"):
        check_setting(Setting((4,), (4100,), 3, 1, 4100, 8200, 60.0), Workload())
    with pytest.raises(ValueError, match="must exceed warmup"):
        check_setting(Setting((2,), (1024,), 1, 1, 1024, 4096, 60.0), Workload())
    with pytest.raises(ValueError, match="cap_sequence"):
        check_setting(Setting((2,), (1024,), 3, 1, 2048, 4096, 60.0), Workload())


def test_rows_take_the_slowest_rank_and_the_worst_ranks_bytes():
    # step 0 is warm-up; rank 1 is slower on step 2
    ranks = [_rank(RING, 1024, [(9.0, 2.0), (1.0, 1.9), (1.0, 1.8)], saved=100),
             _rank(RING, 1024, [(9.0, 2.0), (1.0, 1.9), (1.4, 1.8)], saved=120)]
    for rank in ranks:
        rank["saved_bytes_worst"] = 120
    row = job_row(2, TEN, 1.0, Job(RING, 1024, 3), ranks, warmup=1)
    assert row["step_ms"] == pytest.approx(1200.0) and row["timed_steps"] == 2
    assert row["saved_bytes"] == 120 and row["losses"] == [2.0, 1.9, 1.8]
    # cp=1 runs on rank 0 alone: the idle ranks' (empty) results are not steps
    alone = job_row(4, TEN, 0.5, Job(SDPA, 1024, 1), [_rank(SDPA, 1024, [(3.0, 2.0)], 400, 1), *[_idle(1024, 400)] * 3],
                    warmup=0)
    assert (alone["cp"], alone["step_ms"], alone["saved_bytes"], alone["core_share"]) == (1, 3000.0, 400, 0.5)
    assert job_row(2, TEN, 1.0, Job(RING, 1024, 1), "RuntimeError: boom", 0)["error"] == "RuntimeError: boom"


def test_context_parallel_rows_are_compared_with_cp1_of_their_cluster_at_the_same_sequence():
    rows = [_row(SDPA, 1024, 2.0, 1000, loss=2.0), _row(RING, 1024, 1.25, 560, loss=2.0 * (1 + 2e-6)),
            _row(ALL_TO_ALL, 1024, 1.0, 500, network=ONE),  # the 1 Gbit/s run has no cp=1 of its own
            _row(SDPA, 1024, 4.0, 1000, world_size=4), _row(RING, 1024, 1.25, 300, world_size=4),
            _row(RING, 2048, 1.0, 500)]  # no cp=1 at 2048
    compare(rows)
    ring = rows[1]
    assert ring["activation_ratio"] == pytest.approx(0.56) and ring["ideal_ratio"] == 0.5
    assert ring["activation_excess"] == pytest.approx(0.06)
    assert ring["efficiency"] == pytest.approx(2.0 / (2 * 1.25))
    assert ring["loss_max_rel_diff"] == pytest.approx(2e-6)
    assert rows[2]["efficiency"] == pytest.approx(1.0)
    # cp=4's baseline is cp=1 of the 4-rank cluster (its CPU share per rank)
    assert rows[4]["efficiency"] == pytest.approx(4.0 / (4 * 1.25))
    assert rows[4]["activation_excess"] == pytest.approx(0.05)
    assert rows[5]["efficiency"] is None and rows[5]["activation_ratio"] is None
    assert "activation_ratio" not in rows[0]


def _ladder(method: str, rungs: dict[int, int]) -> dict:
    return {"method": LADDER, "ladder_method": method,
            "rungs": [{"seq": seq, "saved_bytes_worst": saved} for seq, saved in rungs.items()]}


def test_longest_sequence_is_the_last_rung_within_the_cap():
    assert longest_rung({4096: 10, 5120: 20, 6144: 30}, cap=25, start=4096) == 5120  # steps of 4096 / 4
    assert longest_rung({4096: 10, 6144: 20}, cap=25, start=4096) == 4096  # 5120 unmeasured: no claim beyond
    assert longest_rung({4096: 30}, cap=25, start=4096) == 0
    setting = Setting((2, 4), (4096, 8192, 16384), 3, 1, 4096, 65536, 60.0)
    per_1024 = {RING: 65, ALL_TO_ALL: 66}  # saved bytes per 1024 tokens: the cap (1050) holds 16384 and 15360
    trained = (4096, 8192, 16384)
    rows = [_row(SDPA, 4096, 1.0, 1000, world_size=4), _row(SDPA, 8192, 1.0, 2000, world_size=4),
            _row(SDPA, 16384, 1.0, 4000, world_size=4),
            *(_row(method, seq, 1.0, per_1024[method] * seq // 1024, world_size=4) for method in (RING, ALL_TO_ALL)
              for seq in trained),
            _row(RING, 16384, 1.0, 9999, world_size=4, network=ONE),  # not the ladder's run
            _row(RING, 16384, 1.0, 9999, world_size=2)]  # not the ladder's cluster
    ladders = [_ladder(SDPA, {5120: 1250}),
               *(_ladder(method, {seq: per_1024[method] * seq // 1024 for seq in range(5120, 17409, 1024)
                                  if seq not in trained}) for method in (RING, ALL_TO_ALL))]
    leg = longest_sequence_leg(rows, ladders, setting)
    assert leg["cap_mib"] == pytest.approx(1050 / 2**20)
    assert leg["longest"] == {SDPA: 4096, RING: 16384, ALL_TO_ALL: 15360}
    assert leg["ratio"] == {RING: 4.0, ALL_TO_ALL: 3.75} and leg["at_top"] == []
    goal = goal_figures(rows, leg)[1]
    assert goal["key"] == LONGEST.key and goal["value"] == 3.75 and goal["worst_config"] == "cp4 all_to_all"
    assert goal["met"] is True
    failed = longest_sequence_leg(rows, [*ladders[:2], "RuntimeError: boom"], setting)
    assert failed["error"] == "RuntimeError: boom" and goal_figures(rows, failed)[1]["value"] is None
    assert failures(rows, failed) == ["longest-sequence ladder: RuntimeError: boom"]


def test_a_run_without_cp4_has_no_longest_sequence_figure():
    setting = Setting((2,), (1024, 2048), 3, 1, 1024, 8192, 60.0)
    rows = [_row(SDPA, 1024, 1.0, 1000), _row(SDPA, 2048, 1.0, 2000),
            _row(RING, 1024, 1.0, 520), _row(RING, 2048, 1.0, 1040),
            _row(ALL_TO_ALL, 1024, 1.0, 520), _row(ALL_TO_ALL, 2048, 1.0, 1040)]
    compare(rows)
    rungs = {1280: 650, 1536: 780, 1792: 910, 2304: 1170}  # steps of 1024 / 4; 2304 is over the cap (1050)
    leg = longest_sequence_leg(rows, [_ladder(SDPA, {1280: 1250}), _ladder(RING, rungs), _ladder(ALL_TO_ALL, rungs)],
                               setting)
    assert leg["ratio"] == {RING: 2.0, ALL_TO_ALL: 2.0}
    goal = goal_figures(rows, leg)[1]
    assert goal["value"] is None and goal["met"] is None and "largest cp is 2, not 4" in goal["note"]


def test_goals_are_the_worst_case_over_their_legs():
    rows = [_row(SDPA, 1024, 2.0, 1000), _row(RING, 1024, 1.25, 560, loss=2.0 * (1 + 3e-6)),
            _row(ALL_TO_ALL, 1024, 1.0, 520),
            _row(RING, 1024, 4.0, 580, network=ONE, loss=2.0 * (1 + 1e-6)),
            _row(ALL_TO_ALL, 1024, 2.0, 520, network=ONE),
            _row(TORCH, 1024, 9.0, 9000)]  # a baseline: never a goal's configuration
    compare(rows)
    leg = {"cp": 2, "start": 1024, "ratio": {}}
    goals = {goal["key"]: goal for goal in goal_figures(rows, leg)}
    assert list(goals) == [ACTIVATION.key, LONGEST.key, EFFICIENCY.key, LOSS.key, PLANNER_REGRET.key,
                           VARIABLE_SPEEDUP.key]
    for goal, (target, direction) in {ACTIVATION: (0.10, "<="), LONGEST: (3.5, ">="), EFFICIENCY: (0.8, ">="),
                                      LOSS: (1e-5, "<="), PLANNER_REGRET: (0.05, "<="),
                                      VARIABLE_SPEEDUP: (1.2, ">=")}.items():
        assert (goals[goal.key]["target"], goals[goal.key]["direction"], goals[goal.key]["issue"]) == (
            target, direction, 52)
        assert goal.definition and goals[goal.key]["definition"] == goal.definition
    activation = goals[ACTIVATION.key]
    assert activation["value"] == pytest.approx(0.08) and activation["worst_config"] == "cp2 ring seq 1024 1Gbit"
    assert len(activation["by_config"]) == 4 and activation["met"] is True
    efficiency = goals[EFFICIENCY.key]  # 10 Gbit/s only
    assert set(efficiency["by_config"]) == {"cp2 ring seq 1024 10Gbit", "cp2 all_to_all seq 1024 10Gbit"}
    assert efficiency["value"] == pytest.approx(0.8) and efficiency["met"] is True
    loss = goals[LOSS.key]
    assert loss["value"] == pytest.approx(3e-6) and loss["worst_config"] == "cp2 ring seq 1024 10Gbit"
    assert len(loss["by_config"]) == 4


def test_goals_not_built_have_no_figure_and_never_read_met():
    rows = [_row(SDPA, 1024, 2.0, 1000), _row(RING, 1024, 1.0, 500), _row(ALL_TO_ALL, 1024, 1.0, 500)]
    compare(rows)
    goals = {goal["key"]: goal for goal in goal_figures(rows, {"cp": 2, "start": 1024, "ratio": {}})}
    for key in (PLANNER_REGRET.key, VARIABLE_SPEEDUP.key):
        assert goals[key]["value"] is None and goals[key]["met"] is None
        assert goals[key]["note"].startswith("not built yet")
    combined = combine_runs([{"goals": list(goals.values())}] * 3)
    assert combined[PLANNER_REGRET.key]["met"] is False and combined[PLANNER_REGRET.key]["median"] is None


def test_a_failed_row_leaves_its_goals_without_a_figure_and_fails_the_run_but_a_refusing_baseline_does_not():
    rows = [_row(SDPA, 1024, 2.0, 1000), _row(RING, 1024, 1.0, 500),
            job_row(2, TEN, 1.0, Job(ALL_TO_ALL, 1024, 1), "RuntimeError: boom", 0),
            job_row(2, TEN, 1.0, Job(TORCH, 1024, 1), [{"refused": "NotImplementedError: no CPU rule"}] * 2, 0)]
    compare(rows)
    goals = {goal["key"]: goal for goal in goal_figures(rows, {"cp": 2, "start": 1024, "ratio": {}})}
    for key in (ACTIVATION.key, EFFICIENCY.key, LOSS.key):
        assert goals[key]["value"] is None and goals[key]["missing"] == ["cp2 all_to_all seq 1024 10Gbit"]
    assert rows[3]["refused"] == "NotImplementedError: no CPU rule" and "error" not in rows[3]
    assert failures(rows, {"cp": 2}) == ["cp2 all_to_all seq 1024 10Gbit: RuntimeError: boom"]


def test_outcomes_are_read_from_the_ranks_files_and_unfinished_jobs_get_the_error(tmp_path):
    out = tmp_path / "results.jsonl"
    jobs = [Job(SDPA, 128, 1), Job(RING, 128, 1)]
    for rank in range(2):
        lines = [{"index": 0, "rank": rank, **_rank(SDPA, 128, [(1.0, 2.0)], 10, 1)}]
        if rank == 0:
            lines.append({"index": 1, "rank": rank, **_rank(RING, 128, [(1.0, 2.0)], 5)})
        rank_file(out, rank).write_text("".join(json.dumps(line) + "\n" for line in lines))
    outcomes = read_outcomes(out, 2, jobs, "RankTimeout: ranks [1] still running")
    assert [entry["rank"] for entry in outcomes[0]] == [0, 1]
    assert outcomes[1] == "RankTimeout: ranks [1] still running"


def test_results_table_shows_refusals_and_the_ladder():
    rows = [_row(SDPA, 1024, 2.0, 2**20), _row(RING, 1024, 1.25, 2**19),
            job_row(2, TEN, 1.0, Job(TORCH, 1024, 1), [{"refused": "NotImplementedError: no CPU rule"}] * 2, 0)]
    compare(rows)
    data = {"rows": rows, "baseline": "cp=1", "rank_cpu": {"2": {"emulation": "no quota needed"}},
            "longest_sequence_leg": {"cp": 4, "cap_rule": "1.05 x cp=1's saved bytes at 4096",
                                     "longest": {SDPA: 4096, RING: 16384}, "ratio": {RING: 4.0}}}
    rendered = table(data)
    assert rendered.rows[1][5:] == ["1250", "0.5", "50.0% (ideal 50.0%)", "80.0%", "0.0e+00"]
    assert rendered.rows[2][-1] == "refused: NotImplementedError: no CPU rule"
    assert "ring 16384; over cp=1: ring 4.00×" in rendered.notes[0]
