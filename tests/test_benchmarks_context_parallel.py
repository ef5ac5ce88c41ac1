"""The context-parallel benchmark: its baseline, rows, goal statistics and verdicts from rank results (no processes)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from benchmarks._context_parallel_ranks import (
    ALL_TO_ALL,
    LADDER,
    MERAK3D,
    PLAN,
    RING,
    SDPA,
    TORCH,
    Job,
    Workload,
    build_model,
    rank_file,
)
from benchmarks._context_parallel_regret import (
    average_ranks,
    kendall_tau_b,
    planner_candidates,
    planner_group,
    spearman,
    split_outcomes,
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
    main,
    plan_jobs,
    planner_setting,
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
    # (but for the planner leg)
    jobs = [job for job in plan_jobs(FULL, 4, RATES_MBIT[0]) if job.method not in (PLAN, MERAK3D)]
    trained = [job for job in jobs if job.method in (SDPA, RING, ALL_TO_ALL)]
    assert [(job.method, job.seq) for job in trained] == [
        (method, seq) for seq in FULL.sequences for method in (SDPA, RING, ALL_TO_ALL)]
    assert [job.method for job in jobs[-len(FULL.sequences):]] == [TORCH] * len(FULL.sequences)
    assert {job.ladder_method for job in jobs if job.method == LADDER} == {SDPA, RING, ALL_TO_ALL}
    assert all(job.method in (RING, ALL_TO_ALL, PLAN, MERAK3D) for job in plan_jobs(FULL, 4, RATES_MBIT[1]))
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


def test_a_full_run_with_part_of_the_planner_leg_is_refused_before_any_rank_starts(capsys):
    for choice in ("goal-link", "off"):
        with pytest.raises(SystemExit) as refused:
            main(["--planner", choice])
        assert refused.value.code == 2
        assert f"--planner {choice} leaves links out" in capsys.readouterr().err


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


def test_goals_without_a_leg_have_no_figure_and_never_read_met():
    rows = [_row(SDPA, 1024, 2.0, 1000), _row(RING, 1024, 1.0, 500), _row(ALL_TO_ALL, 1024, 1.0, 500)]
    compare(rows)
    goals = {goal["key"]: goal for goal in goal_figures(rows, {"cp": 2, "start": 1024, "ratio": {}})}
    for key in (PLANNER_REGRET.key, VARIABLE_SPEEDUP.key):
        assert goals[key]["value"] is None and goals[key]["met"] is None
    assert goals[VARIABLE_SPEEDUP.key]["note"].startswith("measured by `--leg variable`")
    assert goals[PLANNER_REGRET.key]["note"] == "this run has no planner leg (no planner_sequences)"
    combined = combine_runs([{"goals": list(goals.values())}] * 3)
    entry = combined[PLANNER_REGRET.key]  # runs without a figure are not runs of the goal: undecided, not missed
    assert entry["met"] is None and entry["runs"] == 0 and entry["unmeasured_runs"] == 3 and entry["median"] is None


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


# The planner leg ------------------------------------------------------------------------


def test_the_planner_leg_trains_every_layout_the_planner_weighs_on_the_largest_cluster():
    from lightning_merak.planning.planner import ContextAttention

    assert planner_candidates(4, 4096, Workload()) == [(1, None), (2, RING), (2, ALL_TO_ALL), (4, RING),
                                                       (4, ALL_TO_ALL)]
    assert planner_candidates(2, 1024, Workload()) == [(1, None), (2, RING), (2, ALL_TO_ALL)]
    # all-to-all scatters the key/value heads: cp=4 cannot split 2 of them; a sequence not in 2 x 4 chunks: no cp=4
    shape = ContextAttention(4096, 64, 4, 2, 16, 4)
    assert shape.methods(4, 1) == (RING,)
    assert planner_candidates(4, 4096, Workload(kv_heads=2)) == [(1, None), (2, RING), (2, ALL_TO_ALL), (4, RING)]
    assert [cp for cp, _ in planner_candidates(4, 4100, Workload())] == [1, 2, 2]
    jobs = plan_jobs(FULL, 4, RATES_MBIT[1])
    planned = [job for job in jobs if job.method in (PLAN, MERAK3D)]
    assert jobs[-len(planned):] == planned  # last: a failure there loses no other job
    for seq in FULL.planner_sequences:
        at = [job for job in planned if job.seq == seq]
        assert at[0].method == PLAN and at[0].batch == 4
        candidates = planner_candidates(4, seq, Workload())  # two rounds, the second in reverse order
        assert FULL.planner_rounds == 2
        assert [(job.context_parallel, job.context_attention) for job in at[1:]] == candidates + candidates[::-1]
        assert all(job.batch == 4 and job.steps == FULL.planner_steps for job in at[1:])
    assert not any(job.method in (PLAN, MERAK3D) for job in plan_jobs(FULL, 2, RATES_MBIT[0]))
    goal_link = planner_setting(FULL, "goal-link")
    assert not any(job.method == PLAN for job in plan_jobs(goal_link, 4, RATES_MBIT[1]))
    assert any(job.method == PLAN for job in plan_jobs(goal_link, 4, RATES_MBIT[0]))
    assert planner_setting(QUICK, "off").planner_sequences == () and QUICK.planner_sequences == (1024, 2048)
    with pytest.raises(ValueError, match="planner_rounds=0"):
        check_setting(Setting((2,), (1024,), 3, 1, 1024, 4096, 60.0, planner_sequences=(1024,), planner_rounds=0),
                      Workload())
    with pytest.raises(ValueError, match="planner sequence 1026"):
        check_setting(Setting((2,), (1024,), 3, 1, 1024, 4096, 60.0, planner_sequences=(1026,)), Workload())


def test_rank_agreement_statistics():
    assert average_ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau_b([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # one swapped pair of five: 9 concordant, 1 discordant; d^2 = 2 -> rho = 1 - 6 * 2 / (5 * 24)
    predicted, measured = [1, 2, 3, 4, 5], [1, 3, 2, 4, 5]
    assert kendall_tau_b(predicted, measured) == pytest.approx(0.8)
    assert spearman(predicted, measured) == pytest.approx(0.9)
    # ties: tau-b = (C - D) / sqrt((C + D + T_a)(C + D + T_b)); here C=2, D=3, one pair tied on the left only
    assert kendall_tau_b([1, 1, 2, 3], [1, 2, 3, 0]) == pytest.approx(-1 / 30 ** 0.5)
    assert spearman([1.0], [2.0]) is None and spearman([1, 1], [1, 2]) is None
    assert kendall_tau_b([1, 1], [1, 2]) is None


def _plan(ranked: list[tuple[int, str | None, float]], rejected: list[tuple[int, str | None]] = (),
          batch: int = 4) -> list[dict]:
    """A plan job's outcome on 2 ranks: ``ranked`` (cp, method, time per sample) fastest first, the first chosen."""
    entries = [{"cp": cp, "method": method, "dp": batch // cp, "step_s": per_sample * batch * (batch // cp),
                "samples": batch * (batch // cp), "time_per_sample_s": per_sample, "memory_bytes": 1e6,
                "components": {"context_exchange": 0.01 * cp}} for cp, method, per_sample in ranked]
    result = {"method": PLAN, "seq": 1024, "batch": batch, "ranked": entries, "plan_s": 12.0,
              "rejected": [{"cp": cp, "method": method, "reason": "needs 9 bytes > memory_limit_bytes=5"}
                           for cp, method in rejected],
              "chosen": {"cp": ranked[0][0], "method": ranked[0][1]}}
    return [result, result]


def _regret_goal(groups: list[dict]) -> dict:
    """The regret goal of a run whose other legs measured one cp=2 row per method."""
    rows = [_row(SDPA, 1024, 2.0, 1000), _row(RING, 1024, 1.0, 500), _row(ALL_TO_ALL, 1024, 1.0, 500)]
    compare(rows)
    return next(goal for goal in goal_figures(rows, {"cp": 2, "start": 1024, "ratio": {}}, groups)
                if goal["key"] == PLANNER_REGRET.key)


def _trained(cp: int, method: str | None, steps: list[float], batch: int = 4) -> tuple[Job, list[dict]]:
    """A merak3d job and its outcome on 2 ranks (rank 1 slower by 10% on every step)."""
    job = Job(MERAK3D, 1024, len(steps), batch=batch, context_parallel=cp, context_attention=method)
    ranks = [{"method": MERAK3D, "steps": [{"step_s": step * scale, "loss": 6.0} for step in steps]}
             for scale in (1.0, 1.1)]
    return job, ranks


def test_the_planner_leg_compares_predicted_and_measured_rankings_and_takes_the_regret_of_the_choice():
    plan_job = Job(PLAN, 1024, batch=4)
    plan = _plan([(1, None, 0.10), (2, RING, 0.11), (2, ALL_TO_ALL, 0.12), (4, RING, 0.13), (4, ALL_TO_ALL, 0.14)])
    trained = [_trained(1, None, [9.0, 0.5, 0.5, 0.5]), _trained(2, RING, [9.0, 0.4, 0.4, 0.6]),
               _trained(2, ALL_TO_ALL, [9.0, 0.45, 0.45, 0.45]), _trained(4, RING, [9.0, 0.6, 0.6, 0.6]),
               _trained(4, ALL_TO_ALL, [9.0, 0.7, 0.7, 0.7])]
    group = planner_group("10Gbit", plan_job, plan, trained, warmup=1)
    rows = {row["layout"]: row for row in group["candidates"]}
    assert list(rows) == ["cp1", "cp2 ring", "cp2 all_to_all", "cp4 ring", "cp4 all_to_all"]
    # predicted: time per sample x the global batch; measured: slowest rank, median after warm-up
    assert rows["cp1"]["predicted_step_ms"] == pytest.approx(400.0) and rows["cp1"]["batch_replicas"] == 4
    assert (rows["cp1"]["planner_step_s"], rows["cp1"]["planner_samples"]) == (pytest.approx(1.6), 16)
    assert rows["cp4 ring"]["planner_components"] == {"context_exchange": 0.04}
    assert rows["cp2 ring"]["measured_step_ms"] == pytest.approx(440.0)
    assert rows["cp2 ring"]["slowest_steps_ms"] == [pytest.approx([440.0, 440.0, 660.0])]
    assert [rows[name]["predicted_rank"] for name in rows] == [1, 2, 3, 4, 5]
    assert [rows[name]["measured_rank"] for name in rows] == [3, 1, 2, 4, 5]
    assert (group["chosen"], group["best_measured"]) == ("cp1", "cp2 ring")
    assert group["regret"] == pytest.approx(550 / 440 - 1)
    assert group["kendall_tau_b"] == pytest.approx(0.6) and group["spearman"] == pytest.approx(0.7)
    assert rows["cp4 ring"]["loss_max_rel_diff_vs_cp1"] == 0.0
    goal = _regret_goal([group, {**group, "network": "1Gbit", "regret": 0.01}])
    assert goal["key"] == PLANNER_REGRET.key and goal["value"] == pytest.approx(0.25)
    assert goal["worst_config"] == "seq 1024 10Gbit" and goal["met"] is False
    assert "seq 1024 10Gbit Spearman 0.70, Kendall 0.60" in goal["note"]


def test_a_layouts_measured_step_is_the_median_over_its_rounds():
    plan = _plan([(1, None, 0.1), (2, RING, 0.2)], batch=2)
    first, second = _trained(1, None, [9.0, 1.0, 1.0, 1.0], 2), _trained(1, None, [9.0, 2.0, 2.0, 4.0], 2)
    ring = _trained(2, RING, [9.0, 1.5, 1.5, 1.5], 2)
    group = planner_group("10Gbit", Job(PLAN, 1024, batch=2), plan, [first, ring, ring, second], warmup=1)
    cp1 = group["candidates"][0]
    assert [row["layout"] for row in group["candidates"]] == ["cp1", "cp2 ring"]
    assert cp1["slowest_steps_ms"] == [pytest.approx([1100.0] * 3), pytest.approx([2200.0, 2200.0, 4400.0])]
    assert cp1["round_steps_ms"] == pytest.approx([1100.0, 2200.0])
    assert cp1["measured_step_ms"] == pytest.approx(1650.0)
    assert group["best_measured"] == "cp1" and group["regret"] == 0.0
    failed = planner_group("10Gbit", Job(PLAN, 1024, batch=2), plan, [first, ring, ring, (second[0], "boom")], 1)
    assert failed["candidates"][0]["error"] == "boom" and failed["regret"] is None


def test_a_refused_layout_is_recorded_and_a_failed_one_leaves_no_regret():
    plan_job = Job(PLAN, 1024, batch=2)
    plan = _plan([(2, RING, 0.1), (2, ALL_TO_ALL, 0.2)], rejected=[(1, None)], batch=2)
    refused = (Job(MERAK3D, 1024, 3, batch=2), [{"method": MERAK3D, "refused": "the planner refused it"}] * 2)
    trained = [refused, _trained(2, RING, [1.0, 0.5, 0.5], batch=2), _trained(2, ALL_TO_ALL, [1.0, 0.4, 0.4], batch=2)]
    group = planner_group("1Gbit", plan_job, plan, trained, warmup=1)
    assert group["rejected_for_memory"] == {"cp1": "needs 9 bytes > memory_limit_bytes=5"}
    assert group["candidates"][0]["refused"] == "the planner refused it"
    assert group["regret"] == pytest.approx(0.25) and group["best_measured"] == "cp2 all_to_all"
    assert failures([], {"cp": 2}, [group]) == []
    failed = planner_group("1Gbit", plan_job, plan, [refused, trained[1], (trained[2][0], "RankFailure: boom")], 1)
    assert failed["regret"] is None and failed["error"] == "no measured step for cp2 all_to_all"
    assert failures([], {"cp": 2}, [failed]) == [
        "planner leg seq 1024 1Gbit: no measured step for cp2 all_to_all",
        "planner leg seq 1024 1Gbit cp2 all_to_all: RankFailure: boom"]
    assert _regret_goal([failed])["missing"] == ["seq 1024 1Gbit"]
    # the leg must train exactly what the planner weighed
    mismatch = planner_group("1Gbit", plan_job, plan, trained[1:], 1)
    assert "the planner weighed ['cp1', 'cp2 all_to_all', 'cp2 ring']" in mismatch["error"]
    assert planner_group("1Gbit", plan_job, "RankTimeout: boom", trained, 1)["error"] == "plan: RankTimeout: boom"


def test_planner_jobs_are_grouped_per_plan():
    jobs = [Job(SDPA, 128, 1), Job(PLAN, 128, batch=2), Job(MERAK3D, 128, 2, batch=2),
            Job(MERAK3D, 128, 2, batch=2, context_parallel=2, context_attention=RING), Job(PLAN, 256, batch=2),
            Job(MERAK3D, 256, 2, batch=2)]
    outcomes = {index: f"outcome {index}" for index in range(len(jobs))}
    groups = split_outcomes(jobs, outcomes)
    assert [(plan_job.seq, plan, [outcome for _, outcome in trained]) for plan_job, plan, trained in groups] == [
        (128, "outcome 1", ["outcome 2", "outcome 3"]), (256, "outcome 4", ["outcome 5"])]


def test_results_table_shows_the_planner_leg():
    plan_job = Job(PLAN, 1024, batch=2)
    plan = _plan([(1, None, 0.1), (2, RING, 0.2), (2, ALL_TO_ALL, 0.3)], batch=2)
    trained = [_trained(1, None, [1.0, 0.5, 0.5], 2), _trained(2, RING, [1.0, 0.4, 0.4], 2),
               _trained(2, ALL_TO_ALL, [1.0, 0.45, 0.45], 2)]
    group = planner_group("10Gbit", plan_job, plan, trained, warmup=1)
    data = {"rows": [], "baseline": "cp=1", "rank_cpu": {},
            "longest_sequence_leg": {"cp": 2, "cap_rule": "x", "longest": {}, "ratio": {}},
            "planner_leg": {"world_size": 2, "global_batch": 2, "groups": [group]}}
    notes = table(data).notes
    line = next(note for note in notes if note.startswith("planner leg"))
    assert "seq 1024 10Gbit: chose cp1, fastest measured cp2 ring, regret +25.0%" in line
    assert "cp1 200/550 ms (#1/#3)" in line and "Spearman -0.50, Kendall -0.33" in line


def test_the_variable_leg_compares_the_best_fixed_degree_the_cap_allows_with_the_per_sample_one():
    from benchmarks._auxiliary_lines import context_parallel_variable
    from benchmarks._context_parallel_variable import VARIABLE_FULL, VARIABLE_QUICK, Mix, modes, speedup_by_run

    assert modes(VARIABLE_FULL) == [2, 4, "per_micro_batch"]  # an 8192-token sample exceeds 4096 tokens at cp=1
    assert modes(replace(VARIABLE_QUICK, mix=Mix(long_length=1024, token_cap=1024))) == [1, 2, 4, "per_micro_batch"]
    lengths = Mix().batches(2, seed=1)
    assert all(len(batch) == 32 and batch.count(8192) == 2 for batch in lengths) and lengths == Mix().batches(2, 1)
    rows = [{"run": run, "mode": mode, "step_s": step, "degrees": {}}
            for run, steps in enumerate(((2.0, 3.0, 1.25), (1.5, 3.0, 1.5))) for mode, step in zip(modes(
                VARIABLE_FULL), steps)]
    assert speedup_by_run(rows) == {"run0": pytest.approx(1.6), "run1": pytest.approx(1.0)}
    line = context_parallel_variable({"rows": rows, "mix": Mix().describe(), "goal_runs": {}})
    assert "fixed cp=2 2000 ms" in line and "per_micro_batch 1500 ms" in line
