"""The pure parts of ``python -m benchmarks.sharding``: ideals, ratios against the baselines, the goals, the table."""

import pytest

from benchmarks._sharding_ranks import Job, job_entries
from benchmarks._sharding_rows import activation_bytes, compare, shard_fractions
from benchmarks.results_table import sharding as sharding_table
from benchmarks.sharding import QUICK, goals_met, summary

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


def _row(name: str, kind: str, mode: str | None, step_ms: float, optimizer: int, exposed: float | None,
         overlap: bool = True, losses: tuple[float, ...] = (2.0, 1.0),
         gather_overlap: bool = False) -> dict:
    return {"section": "modes", "name": name, "layout": "dp2", "ranks": 2, "kind": kind, "mode": mode,
            "overlap": overlap, "param_gather_overlap": gather_overlap, "error": None, "refused": False,
            "step_ms": step_ms, "losses": list(losses),
            "optimizer_bytes": [optimizer, optimizer], "exposed_ms": exposed, "worst_rank": 0, "used_mb": [50.0, 40.0],
            "peak_over_ideal": 1.5}


def test_the_top_level_figures_come_from_the_rows():
    rows = [_row("merak3d dp2 none", "merak3d", "none", 100.0, 800, 30.0),
            _row("merak3d dp2 optimizer", "merak3d", "optimizer", 108.0, 400, 20.0, losses=(2.0, 1.00001)),
            _row("merak3d dp2 optimizer gather-overlap", "merak3d", "optimizer", 103.0, 400, 20.0, gather_overlap=True),
            _row("merak3d dp2 none no-overlap", "merak3d", "none", 120.0, 800, 100.0, overlap=False),
            _row("merak3d dp2 optimizer no-overlap", "merak3d", "optimizer", 125.0, 400, 50.0, overlap=False),
            _row("DDP dp2", "ddp", None, 90.0, 800, None)]
    compare(rows)
    largest = [{"kind": "fsdp2", "params_m": 10.0, "name": "FSDP2"},
               {"kind": "merak3d", "params_m": 15.0, "name": "merak3d pp2xdp2 full"}]
    top = summary(rows, largest, QUICK)
    assert top["optimizer_state_ratio"] == 0.5 and top["optimizer_state_ratio_layout"] == "dp2"
    assert top["zero1_step_over_ddp"] == pytest.approx(1.03)  # with the parameters gathered during the forward
    assert top["zero1_default_step_over_merak3d_none"] == pytest.approx(1.08)
    assert top["zero1_step_over_lightning_ddp"] == pytest.approx(103 / 90)
    assert top["exposed_grad_comm_fraction"] == pytest.approx(0.4)  # optimizer's 20/50, worse than none's 30/100
    assert top["loss_max_rel_diff"] == pytest.approx(1e-5)
    assert top["largest_model_ratio_vs_fsdp2"] == 1.5
    met = goals_met(top)
    assert met["optimizer_state_ratio"] and met["zero1_step_over_ddp"] and not met["exposed_grad_comm_fraction"]
    assert rows[0]["step_over_ddp"] == pytest.approx(100 / 90)


def test_the_table_shows_ratios_and_a_refused_baseline():
    rows = [_row("merak3d dp2 optimizer", "merak3d", "optimizer", 103.0, 400, 20.0),
            {"section": "modes", "name": "DeepSpeed ZeRO-2 dp2", "layout": "dp2", "error": "RuntimeError: no CPU op. X",
             "refused": True},
            {"section": "largest", "name": "FSDP2", "largest_layers": 8, "params_m": 4.0, "error": None}]
    rows[0].update(step_over_merak3d_none=1.03, step_over_ddp=1.1, step_over_fsdp2=0.9, optimizer_state_ratio=0.5,
                   exposed_grad_comm_fraction=0.25, loss_max_rel_diff_vs_ddp=0.0)
    data = {"rows": rows, "workload": "llama", "steps": 8, "network": "1Gbit (emulated)", "cap_mb": 300.0,
            "search_workload": "llama", "goals": {"loss_max_rel_diff": "<= 1e-5"}, "loss_max_rel_diff": 0.0,
            "goals_met": {"loss_max_rel_diff": True}}
    table = sharding_table(data)
    assert table.rows[0][2:] == ["103", "1.03×", "1.10×", "0.90×", "0.50×", "0.25", "0.0e+00", "50 (1.50×)"]
    assert table.rows[1][2] == "refused: RuntimeError: no CPU op"
    assert "loss_max_rel_diff 0 (<= 1e-5: met)" in table.notes[1]
    assert "FSDP2 8 layers (4.0 M)" in table.notes[2]


def test_each_kind_of_job_is_warmed_up_once_before_the_measured_ones():
    jobs = [(0, _job("merak3d")), (1, _job("merak3d", "optimizer")), (2, _job("ddp"))]
    entries = job_entries(jobs)
    assert [entry["index"] for entry in entries] == [-1, -2, 0, 1, 2]
    assert [entry["job"]["kind"] for entry in entries[:2]] == ["merak3d", "ddp"]


def test_the_zero1_ratio_is_the_median_of_back_to_back_pairs():
    from benchmarks.sharding import FULL, mode_jobs, paired_ratios, paired_repeat_jobs

    modes = mode_jobs(FULL, 4)
    repeats = paired_repeat_jobs(FULL, modes)
    assert [job.name for job in repeats[:4]] == [
        "merak3d dp4 none (repeat 2)", "merak3d dp4 optimizer gather-overlap (repeat 2)",
        "merak3d pp2xdp2 none (repeat 2)", "merak3d pp2xdp2 optimizer gather-overlap (repeat 2)"]
    assert len(repeats) == 2 * 2 * (FULL.paired_repeats - 1)
    steps = {"merak3d dp2 none": 100.0, "merak3d dp2 optimizer gather-overlap": 130.0,
             "merak3d dp2 none (repeat 2)": 100.0, "merak3d dp2 optimizer gather-overlap (repeat 2)": 95.0,
             "merak3d dp2 none (repeat 3)": 200.0, "merak3d dp2 optimizer gather-overlap (repeat 3)": 200.0}
    paired = paired_ratios(steps, ("dp2",), 3)
    assert paired == {"dp2": pytest.approx([1.3, 0.95, 1.0])}
    rows = [_row("merak3d dp2 none", "merak3d", "none", 100.0, 800, 30.0),
            _row("merak3d dp2 optimizer gather-overlap", "merak3d", "optimizer", 130.0, 400, 20.0,
                 gather_overlap=True)]
    compare(rows)
    top = summary(rows, [], QUICK, paired)
    assert top["zero1_step_over_ddp"] == pytest.approx(1.0)  # the median pair, not the first pair's 1.3
    assert top["targets"]["dp2"]["zero1_step_over_ddp_pairs"] == pytest.approx([1.3, 0.95, 1.0])


def test_the_exposed_fraction_is_each_modes_median_over_its_runs():
    from benchmarks.sharding import FULL, overlap_jobs, overlap_summary

    names = [job.name for job in overlap_jobs(FULL)]
    assert names[:5] == ["merak3d dp2 long sequences none", "merak3d dp2 long sequences none no-overlap",
                         "merak3d dp2 long sequences optimizer", "merak3d dp2 long sequences optimizer no-overlap",
                         "merak3d dp2 long sequences none (repeat 2)"]
    rows = [{**_row("merak3d dp2 long sequences none", "merak3d", "none", 900.0, 800, 90.0),
             "layout": "dp2 long sequences", "exposed_grad_comm_fraction": 0.36}]
    repeats = [{"name": "merak3d dp2 long sequences none (repeat 2)", "error": None, "exposed_ms": 40.0},
               {"name": "merak3d dp2 long sequences none no-overlap (repeat 2)", "error": None, "exposed_ms": 200.0},
               {"name": "merak3d dp2 long sequences none (repeat 3)", "error": None, "exposed_ms": 50.0},
               {"name": "merak3d dp2 long sequences none no-overlap (repeat 3)", "error": None, "exposed_ms": 250.0}]
    top = overlap_summary(rows, FULL, repeats)
    assert top["exposed_grad_comm_fraction_runs"] == {"none": pytest.approx([0.36, 0.2, 0.2])}
    assert top["exposed_grad_comm_fraction"] == pytest.approx(0.2)  # not the first run's 0.36
