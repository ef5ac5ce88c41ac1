"""``benchmarks.compile``'s rows and goals from ranks' results (no training): the slowest rank's median step after
warm-up, compiled over eager, over the bare block, and an errored job as an error row."""

from __future__ import annotations

import pytest

from benchmarks import compile as bench
from benchmarks._scale_ranks import Workload


def _result(steps: list[float], losses: list[float], breaks: int = 0) -> dict:
    counts = {"graphs": 1, "graph_breaks": breaks, "recompiles": 0}
    return {"step_s": steps, "losses": losses, "warmup_counts": counts, "later_counts": counts}


def test_rows_and_goals_take_the_slowest_rank_and_the_worst_layout():
    setting = bench.Setting(hiddens=(128,), layers=2, seq=8, global_batch=4, steps=3, warmup=1, timeout_s=1)
    jobs = bench.plan_jobs(setting)
    assert [job.name for job in jobs][:2] == ["h128/dp2/eager", "h128/dp2/compiled"]
    eager, compiled = _result([9.0, 2.0, 2.0], [3.0, 2.0, 1.0]), _result([9.0, 1.0, 1.0], [3.0, 2.0, 1.00001])
    slow = _result([9.0, 1.6, 1.6], [3.0, 2.0, 1.0], breaks=1)
    rank0 = [eager, compiled, eager, slow, eager, compiled]
    rank1 = [eager, compiled, eager, compiled, {"error": "RuntimeError: boom"}]
    rows = bench.job_rows(jobs, [rank0, rank1], setting.warmup, {128: {"speedup": 2.5}})
    dp2 = rows[1]
    assert dp2["speedup"] == pytest.approx(2.0) and dp2["efficiency"] == pytest.approx(0.8)
    assert dp2["tokens_per_s"] == pytest.approx(4 * 8 / 1.0)
    assert rows[3]["speedup"] == pytest.approx(2.0 / 1.6) and rows[3]["breaks"] == 1
    assert rows[4]["error"] == "RuntimeError: boom" and rows[5]["error"].startswith("not run")
    goals = {goal["key"]: goal for goal in bench.goal_figures(rows)}
    assert goals["compile_speedup_min"]["value"] is None, "a layout that failed leaves the goal without a figure"
    rows[5] = {**rows[3], "layout": "tp2"}
    goals = {goal["key"]: goal for goal in bench.goal_figures(rows)}
    assert goals["compile_speedup_min"]["value"] == pytest.approx(1.25)
    assert goals["compile_breaks_and_recompiles_after_warmup"]["value"] == 1
    assert goals["compile_loss_max_rel_diff"]["value"] == pytest.approx(1e-5)
    assert Workload(hidden=128, layers=2, vocab=2048, seq=8).config().num_attention_heads == 2
