"""The Muon benchmark's rows and goals from the ranks' results (no cluster): the slowest rank per step, warm-up
dropped, the port and AdamW compared at the same layout, a failed job failing its goals."""

from __future__ import annotations

import pytest

from benchmarks._muon_ranks import OPTIMIZERS, Job
from benchmarks.muon import FULL, LAYOUTS, QUICK, goal_figures, job_rows, plan_jobs
from benchmarks.results_table import cpu_features
from benchmarks.results_table import muon as table


def _result(job: Job, step_s: list[float], loss: float = 7.0) -> dict:
    return {"job": job, "step_s": step_s, "optimizer_s": [s / 10 for s in step_s], "losses": [loss] * len(step_s)}


def test_every_layout_runs_adamw_ours_and_the_port_after_a_warm_up_job() -> None:
    jobs = plan_jobs(QUICK)
    assert jobs[0].name == "warm-up"
    assert [(job.name.split("/")[0], job.optimizer) for job in jobs[1:]] == [
        (layout, optimizer) for layout in LAYOUTS for optimizer in OPTIMIZERS]
    assert LAYOUTS["dp4-zero1"] == {"data_parallel": 4, "data_parallel_sharding": "optimizer"}
    assert FULL.steps > FULL.warmup and QUICK.steps > QUICK.warmup


def test_rows_take_the_slowest_rank_and_goals_the_worst_layout() -> None:
    jobs = plan_jobs(QUICK)
    speeds = {"adamw": 1.0, "muon": 1.1, "muon_naive": 1.3, "muon_float32": 1.05}  # float32: no goal reads it
    by_rank = []
    for rank in range(4):
        results = [_result(jobs[0], [9.0, 9.0])]
        for job in jobs[1:]:
            base = speeds[job.optimizer] * (1.2 if job.name.startswith("pp2") else 1.0)
            slow = 0.1 if rank == 3 else 0.0  # the slowest rank sets each step
            results.append(_result(job, [5.0, 5.0] + [base + slow] * 3))
        by_rank.append(results)
    rows = job_rows(jobs, by_rank, warmup=2, error=None)
    assert len(rows) == 8 and rows[1]["step_ms"] == pytest.approx(1200.0)
    goals = {goal["key"]: goal for goal in goal_figures(rows)}
    assert goals["muon_step_over_adamw"]["value"] == pytest.approx(max(1.2 / 1.1, 1.42 / 1.3), rel=1e-6)
    assert goals["muon_step_over_adamw"]["worst_config"] == "pp2-dp2"
    assert goals["muon_naive_over_ours"]["value"] == pytest.approx(min(1.4 / 1.2, 1.66 / 1.42), rel=1e-6)
    assert goals["muon_loss_max_rel_diff"]["value"] == 0.0
    assert table({"rows": rows, "workload_description": "w", "baseline": "b",
                  "rank_cpu": {"emulation": "quota"}, "network_note": "tbf"}).rows[1][4] == "1.09×"


def test_a_job_that_did_not_finish_fails_its_goals() -> None:
    jobs = plan_jobs(QUICK)
    by_rank = [[_result(job, [1.0] * 5) for job in jobs[:-2]] for _ in range(4)]  # the last two never finished
    rows = job_rows(jobs, by_rank, warmup=2, error="RuntimeError: boom")
    assert [row["error"] for row in rows[-2:]] == ["RuntimeError: boom"] * 2
    goals = {goal["key"]: goal for goal in goal_figures(rows)}
    assert goals["muon_naive_over_ours"]["value"] is None and goals["muon_naive_over_ours"]["missing"] == ["pp2-dp2"]


def test_the_machine_line_says_whether_the_cpu_multiplies_bfloat16() -> None:
    assert cpu_features({"cpu_capability": "AVX2", "cpu_bfloat16": False}) == " (AVX2, no native bfloat16 products)"
    assert cpu_features({"cpu_capability": "AVX512", "cpu_bfloat16": True}) == " (AVX512, native bfloat16 products)"
    assert cpu_features({}) == ""  # records from before the field


def test_the_muon_table_says_when_the_cpu_multiplies_bfloat16_without_native_support() -> None:
    data = {"rows": [], "workload_description": "w", "baseline": "b", "rank_cpu": {"emulation": "quota"},
            "network_note": "tbf"}
    assert not any("without native support" in note for note in table(data).notes)
    slow = table({**data, "machine": {"cpu_bfloat16": False}}).notes
    assert any("without native support" in note and "data-parallel-sharding.md" in note for note in slow)
