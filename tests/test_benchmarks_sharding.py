"""The pure parts of ``python -m benchmarks.sharding``: ideals, baselines pinned to their defaults, ratios, the goals
as worst cases, the table."""

import pytest

from benchmarks._sharding_ranks import NO_CLIPPING, Job, deepspeed_config, job_entries, strategy_for
from benchmarks._sharding_rows import activation_bytes, compare, exposed_fraction, shard_fractions
from benchmarks._table_sharding import sharding as sharding_table
from benchmarks.sharding import (
    CANDIDATES,
    FSDP2_CHECKPOINTED,
    FULL,
    PLANNED,
    QUICK,
    REDUCING_MODES,
    context_figures,
    goal_figures,
    merak3d_default_bucket_mb,
    mode_jobs,
    search_jobs,
)

WORKLOAD = {"hidden": 32, "layers": 2, "vocab": 64}
PER_SAMPLE = {"per_layer": 10.0, "head": 100.0}


def _job(kind: str, mode: str = "none", stage: int = 0) -> Job:
    return Job("x", kind, WORKLOAD, 2, mode=mode, stage=stage)


def test_each_mode_keeps_its_share_of_gradients_and_optimizer_state():
    assert shard_fractions(_job("merak3d"), 4) == (1.0, 1.0)
    assert shard_fractions(_job("merak3d", "optimizer"), 4) == (1.0, 0.25)
    assert shard_fractions(_job("merak3d", "gradients"), 4) == (0.25, 0.25)
    assert shard_fractions(_job("merak3d", "full"), 4) == (1.0, 1.0)  # its parameters are already the share
    assert shard_fractions(_job("zero", stage=1), 2) == (1.0, 0.5)
    assert shard_fractions(_job("zero", stage=2), 2) == (0.5, 0.5)


def test_a_first_stage_holds_its_micro_batches_in_flight_without_the_head():
    first = {"pipeline_parallel": 2, "pipeline_rank": 0, "micro_batches": 2, "local_batch": 4,
             "layers_held": [0, 1], "has_head": False}
    assert activation_bytes(first, PER_SAMPLE) == 2 * 2 * 20.0
    last = {**first, "pipeline_rank": 1, "has_head": True}
    assert activation_bytes(last, PER_SAMPLE) == 2 * 1 * 120.0


def test_merak3d_runs_at_its_defaults_and_lightning_ddp_gets_its_bucket_size():
    from lightning_merak.strategies.merak3d.options import Merak3DOptions

    ours = merak3d_default_bucket_mb(FULL.workload)
    jobs = {job.name: job for job in mode_jobs(FULL, 4, ours)}
    zero1 = jobs["merak3d dp4 optimizer"]
    defaults = Merak3DOptions()
    assert (zero1.bucket_mb, zero1.overlap, zero1.param_gather_overlap) == (
        defaults.grad_bucket_mb, defaults.overlap_grad_reduce, defaults.overlap_param_gather)
    assert strategy_for(jobs["DDP dp4"], 4)._ddp_kwargs == {"bucket_cap_mb": ours}
    assert strategy_for(jobs["DDP default buckets dp4"], 4)._ddp_kwargs == {}  # Lightning's (torch's 25 MB)
    assert {job.name for job in jobs.values() if job.kind == "ddp"} == {"DDP dp4", "DDP default buckets dp4"}


def test_deepspeed_neither_clips_nor_changes_precision_and_uses_our_bucket():
    config = deepspeed_config(Job("z", "zero", WORKLOAD, 2, stage=1, bucket_mb=2.0), 4)
    assert config["gradient_clipping"] == NO_CLIPPING == 0.0
    assert not {"fp16", "bf16", "amp"} & set(config)
    assert config["zero_optimization"]["reduce_bucket_size"] * 4 == 2 * 2**20


def test_fsdp2_baseline_checkpoints_every_block_and_the_ladder_steps_by_two_layers():
    jobs = {job.name: job for job in search_jobs(FULL)}
    assert jobs[FSDP2_CHECKPOINTED].checkpointing and jobs[FSDP2_CHECKPOINTED].kind == "fsdp2"
    assert jobs[PLANNED].layout == {"data_parallel": "auto", "pipeline_parallel": "auto"}
    assert {j.cap_mb for j in jobs.values()} == {FULL.cap_mb} and len(jobs) == len(CANDIDATES)
    assert {b - a for a, b in zip(FULL.ladder, FULL.ladder[1:])} == {2}


def _row(name: str, mode: str | None, step_ms: float, layout: str = "dp2", kind: str = "merak3d",
         overlap: bool = True, skip: bool = False, gather: bool | None = None,
         losses: tuple[float, ...] = (2.0, 1.0)) -> dict:
    return {"section": "modes", "name": name, "layout": layout, "ranks": 4 if layout != "dp2" else 2, "kind": kind,
            "mode": mode, "overlap": overlap, "param_gather_overlap": gather, "skip_grad_comm": skip, "error": None,
            "refused": False, "step_ms": step_ms, "losses": list(losses), "optimizer_bytes": [800, 800],
            "worst_rank": 0, "used_mb": [50.0, 40.0], "peak_over_ideal": 1.5}


def _layout_rows(layout: str, zero1_ms: float, none_ms: tuple[float, float, float]) -> list[dict]:
    """merak3d's runs at ``layout``: ``none`` and ``optimizer`` each with overlap, without, and without
    communication (``none_ms``; ZeRO-1's 100, 200 and 50 ms, so its exposed fraction is 1/3)."""
    on, off, removed = none_ms
    return [_row(f"merak3d {layout} none", "none", on, layout),
            _row(f"merak3d {layout} none no-overlap", "none", off, layout, overlap=False),
            _row(f"merak3d {layout} none no-grad-comm", "none", removed, layout, skip=True),
            _row(f"merak3d {layout} optimizer", "optimizer", zero1_ms, layout),
            _row(f"merak3d {layout} optimizer no-overlap", "optimizer", 200.0, layout, overlap=False),
            _row(f"merak3d {layout} optimizer no-grad-comm", "optimizer", 50.0, layout, skip=True, losses=(2.0, 9.0)),
            _row(f"merak3d {layout} optimizer gather-after-step", "optimizer", 90.0, layout, gather=False)]


def _rows() -> list[dict]:
    rows = [*_layout_rows("dp2", 100.0, (60.0, 120.0, 50.0)), *_layout_rows("pp2xdp2", 130.0, (70.0, 90.0, 60.0)),
            _row("DDP dp2", None, 95.0, kind="ddp"), _row("DDP default buckets dp2", None, 80.0, kind="ddp"),
            _row("DDP dp4", None, 100.0, "dp4", kind="ddp"),
            _row("DDP default buckets dp4", None, 100.0, "dp4", kind="ddp")]
    compare(rows)
    return rows


def test_the_exposed_fraction_removes_the_step_without_communication():
    assert exposed_fraction(70.0, 130.0, 50.0) == pytest.approx(0.25)
    assert exposed_fraction(70.0, 50.0, 50.0) is None  # no communication to expose: no figure
    rows = _rows()
    assert rows[0]["exposed_grad_comm_fraction"] == pytest.approx(10 / 70)
    assert rows[3]["exposed_grad_comm_fraction"] == pytest.approx(50 / 150)
    assert "exposed_grad_comm_fraction" not in rows[6]  # gathering right after the step is not the default


def test_each_goal_is_its_worst_configuration():
    largest = [{"name": FSDP2_CHECKPOINTED, "params_m": 10.0}, {"name": "FSDP2 (ModelParallelStrategy) dp4",
                                                                "params_m": 5.0},
               {"name": PLANNED, "params_m": 12.0}, {"name": "merak3d dp4 full, recompute full", "params_m": 30.0}]
    goals = {goal["key"]: goal for goal in goal_figures(_rows(), largest, QUICK)}
    zero1 = goals["zero1_default_over_lightning_ddp"]
    assert zero1["value"] == pytest.approx(1.3) and zero1["worst_config"] == "pp2xdp2"  # over DDP dp4 (4 ranks)
    assert zero1["by_config"]["dp2"] == pytest.approx(100 / 95) and not zero1["met"]
    exposed = goals["exposed_grad_comm_fraction"]
    assert exposed["value"] == pytest.approx(80 / 150) and exposed["worst_config"] == "pp2xdp2 optimizer"
    assert exposed["by_config"]["dp2 none"] == pytest.approx(10 / 70)
    assert set(exposed["by_config"]) == {f"{layout} {mode}" for layout in QUICK.layouts
                                         for mode in QUICK.reducing_modes}
    ratio = goals["largest_model_ratio_vs_fsdp2"]  # the planned layout, not the best labelled row
    assert ratio["value"] == pytest.approx(1.2) and not ratio["met"]
    assert goals["loss_max_rel_diff"]["value"] == 0.0  # the run without communication does not count
    assert set(REDUCING_MODES) >= set(QUICK.reducing_modes)


def test_a_failed_configuration_leaves_its_goal_without_a_figure():
    rows = _rows()
    failed = next(row for row in rows if row["name"] == "merak3d pp2xdp2 optimizer")
    failed.update(error="RankFailure", step_over_ddp=None)
    goals = {goal["key"]: goal for goal in goal_figures(rows, [], QUICK)}
    assert goals["zero1_default_over_lightning_ddp"]["value"] is None
    assert goals["zero1_default_over_lightning_ddp"]["missing"] == ["pp2xdp2"]
    assert goals["largest_model_ratio_vs_fsdp2"]["value"] is None


def test_the_table_shows_ratios_a_refused_baseline_and_both_ddp_comparisons():
    rows = _rows()
    rows.append({"section": "modes", "name": "DeepSpeed ZeRO-2 dp2", "layout": "dp2",
                 "error": "RuntimeError: no CPU op. X", "refused": True})
    rows.append({"section": "largest", "name": FSDP2_CHECKPOINTED, "largest_layers": 8, "params_m": 4.0,
                 "error": None})
    data = {"rows": rows, "workload": "llama", "steps": 8, "network": "1Gbit (emulated)", "cap_mb": 300.0,
            "search_workload": "llama", "ddp_bucket_mb": 1.0, "memory_steps": 4, **context_figures(rows, QUICK)}
    table = sharding_table(data)
    zero1 = table.rows[3]
    assert zero1[:8] == ["dp2", "merak3d dp2 optimizer", "100", f"{100 / 60:.2f}×", f"{100 / 95:.2f}×", "1.25×",
                         "-", "-"]
    assert zero1[9] == "0.33"
    assert table.rows[-1][2] == "refused: RuntimeError: no CPU op"
    assert f"{FSDP2_CHECKPOINTED} 8 layers (4.0 M)" in table.notes[1]
    assert "dp2 1.25×" in table.notes[2] and "pp2xdp2 1.30×" in table.notes[2]


def test_each_kind_of_job_is_warmed_up_once_before_the_measured_ones():
    jobs = [(0, _job("merak3d")), (1, _job("merak3d", "optimizer")), (2, _job("ddp"))]
    entries = job_entries(jobs)
    assert [entry["index"] for entry in entries] == [-1, -2, 0, 1, 2]
    assert [entry["job"]["kind"] for entry in entries[:2]] == ["merak3d", "ddp"]


def test_skipping_gradient_communication_holds_only_inside():
    from lightning_merak.parallel.data.skipped_communication import (
        communication_skipped,
        gradient_communication_skipped,
    )

    assert not communication_skipped()
    with gradient_communication_skipped():
        assert communication_skipped()
    assert not communication_skipped()


def _scatter_rank(rank: int, world_size: int) -> tuple[list[float], list[float]]:
    """This rank's part of a bucket reduce-scattered for real, and with the communication skipped."""
    import torch
    import torch.distributed as dist

    from lightning_merak.parallel.data.reduce_scatter import ReduceScatterQueue
    from lightning_merak.parallel.data.skipped_communication import keep_own_part

    flat = torch.arange(4, dtype=torch.float32) + 10 * rank
    parts = []
    for start in ({}, {"start": keep_own_part}):
        out = torch.zeros(2)
        queue = ReduceScatterQueue(dist.group.WORLD, lambda index: None, **start)
        queue.submit(0, out, flat.clone())
        queue.drain()
        parts.append(out.tolist())
    return parts[0], parts[1]


@pytest.mark.distributed
def test_a_skipped_reduce_scatter_keeps_the_ranks_own_part_of_its_own_sums():
    from lightning_merak.testing import run_distributed

    (summed0, own0), (summed1, own1) = run_distributed(_scatter_rank, 2, timeout_s=120)
    assert (summed0, summed1) == ([10.0, 12.0], [14.0, 16.0])
    assert (own0, own1) == ([0.0, 1.0], [12.0, 13.0])
