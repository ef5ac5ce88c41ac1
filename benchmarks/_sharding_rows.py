"""The rows of ``python -m benchmarks.sharding``: each job's figures against its ideal and the baselines, the
largest-model search's rows, and the per-rank memory chart (pure: results in, rows out)."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks._scale_ranks import Workload
from benchmarks._sharding_ranks import Job

MIB = 2**20
LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "dp2": (2, {"data_parallel": 2}), "dp4": (4, {"data_parallel": 4}),
    "pp2xdp2": (4, {"data_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2})}
BASELINES = {"ddp": "DDP", "ddp_default": "DDP default buckets", "fsdp2": "FSDP2 (ModelParallelStrategy)",
             "zero1": "DeepSpeed ZeRO-1", "zero2": "DeepSpeed ZeRO-2"}
"""Step-time columns ``step_over_KEY``: this run's step over the baseline's of that name at the same world size
(``DDP``: Lightning's DDPStrategy with merak3d's default bucket size; ``DDP default buckets``: at its own 25 MB)."""
MAY_REFUSE = {"zero"}
"""Baselines whose refusal to run on this machine is a result, not a failure."""


def shard_fractions(job: Job, shards: int) -> tuple[float, float]:
    """The share of its parameters' gradients and AdamW state a rank must keep under ``job``'s sharding
    (parameters sharded themselves, as under FSDP2, are already counted as this rank's share)."""
    if job.kind == "zero":
        return (1 / shards if job.stage >= 2 else 1.0), 1 / shards
    if job.kind == "merak3d" and job.mode in ("optimizer", "gradients"):
        return (1 / shards if job.mode == "gradients" else 1.0), 1 / shards
    return 1.0, 1.0


def activation_bytes(rank: dict[str, Any], per_sample: dict[str, float]) -> float:
    """Activations this rank holds at once: its in-flight micro-batches through the layers (and head) it computes."""
    pp, micro_batches = rank["pipeline_parallel"], rank["micro_batches"]
    in_flight = min(pp - rank["pipeline_rank"], micro_batches) if pp > 1 else 1
    sample = len(rank["layers_held"]) * per_sample["per_layer"] + (per_sample["head"] if rank["has_head"] else 0)
    return rank["local_batch"] // micro_batches * in_flight * sample


def median_slowest(ranks: list[dict[str, Any]], warmup: int) -> float:
    slowest = [max(step) for step in zip(*(rank["step_s"] for rank in ranks))]
    return statistics.median(slowest[warmup:] or slowest)


def job_row(job: Job, layout: str, world_size: int, outcome: list[dict[str, Any]] | str,
            memory: list[dict[str, Any]] | str, warmup: int, per_sample: dict[str, float]) -> dict[str, Any]:
    """One report row of the mode comparison: memory against the ideal per rank (from ``memory``, the job's short
    run on a heap that returns freed tensors), step time, losses and exposure (from ``outcome``, the timed run)."""
    row: dict[str, Any] = {"section": "modes", "name": job.name, "layout": layout, "ranks": world_size,
                           "kind": job.kind, "mode": job.mode if job.kind == "merak3d" else None,
                           "stage": job.stage or None, "overlap": job.overlap,
                           "param_gather_overlap": job.param_gather_overlap, "skip_grad_comm": job.skip_grad_comm,
                           "error": None, "refused": False}
    if isinstance(outcome, str) or isinstance(memory, str):
        error = outcome if isinstance(outcome, str) else f"memory run: {memory}"
        row.update(error=error, refused=job.kind in MAY_REFUSE)
        return row
    grad_share, optimizer_share = shard_fractions(job, outcome[0]["data_parallel"])
    ideal, grad_ideal, optimizer_ideal, activations = [], [], [], []
    for rank in outcome:
        activations.append(activation_bytes(rank, per_sample))
        grad_ideal.append(rank["param_bytes"] * grad_share)
        optimizer_ideal.append(2 * rank["param_bytes"] * optimizer_share)
        ideal.append(rank["param_bytes"] + grad_ideal[-1] + optimizer_ideal[-1] + activations[-1])
    used = [rank["used_mb"] for rank in memory]
    worst = max(range(world_size), key=lambda i: used[i] * MIB / ideal[i])
    exposed = [rank["reduction_stats"].get("exposed_s_mean") for rank in outcome if rank["reduction_stats"]]
    row.update(
        step_ms=1e3 * median_slowest(outcome, warmup), losses=outcome[0]["losses"],
        job_s=round(max(rank["wall_s"] for rank in outcome), 1),
        used_mb=[round(u, 1) for u in used], ideal_mb=[round(i / MIB, 1) for i in ideal],
        used_mb_default_heap=[round(rank["used_mb"], 1) for rank in outcome],
        peak_over_ideal=used[worst] * MIB / ideal[worst], worst_rank=worst,
        param_mb=[round(rank["param_bytes"] / MIB, 2) for rank in outcome],
        grad_ideal_mb=[round(g / MIB, 2) for g in grad_ideal],
        grad_at_step_mb=[round(rank["grad_bytes"] / MIB, 2) for rank in outcome],
        optimizer_bytes=[rank["optimizer_bytes"] for rank in outcome],
        optimizer_mb=[round(rank["optimizer_bytes"] / MIB, 2) for rank in outcome],
        optimizer_ideal_mb=[round(i / MIB, 2) for i in optimizer_ideal],
        optimizer_over_ideal=max(rank["optimizer_bytes"] / i for rank, i in zip(outcome, optimizer_ideal)),
        activation_mb=[round(a / MIB, 2) for a in activations],
        exposed_ms=1e3 * max(exposed) if exposed and None not in exposed else None,
        reduction_stats=[rank["reduction_stats"] for rank in outcome],
    )
    return row


def _max_rel_diff(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, reference))


def exposed_fraction(overlapped_ms: float, serial_ms: float, removed_ms: float) -> float | None:
    """The share of a step's gradient communication left exposed by overlap: (step with overlap − step with the
    communication removed) over (step without overlap − the same); ``None`` where removing it saved nothing."""
    if serial_ms <= removed_ms:
        return None
    return (overlapped_ms - removed_ms) / (serial_ms - removed_ms)


def _variant(rows: list[dict[str, Any]], like: dict[str, Any], overlap: bool, skip: bool) -> dict[str, Any] | None:
    """merak3d's run of ``like``'s layout and mode with overlap ``overlap`` and communication skipped or not."""
    return next((row for row in rows if row["kind"] == "merak3d" and row["layout"] == like["layout"]
                 and row["mode"] == like["mode"] and row["param_gather_overlap"] is None
                 and (row["overlap"], row["skip_grad_comm"]) == (overlap, skip)), None)


def compare(rows: list[dict[str, Any]]) -> None:
    """Add to each row its ratios against merak3d ``none`` on its layout and the baselines at its world size, and to
    merak3d's default runs their exposed communication."""
    ok = [row for row in rows if row["error"] is None]
    plain = {row["layout"]: row for row in ok if row["kind"] == "merak3d" and row["mode"] == "none" and row["overlap"]
             and not row["skip_grad_comm"] and row["param_gather_overlap"] is None}
    baseline = {(row["ranks"], row["name"].rsplit(" ", 1)[0]): row for row in ok if row["kind"] != "merak3d"}
    for row in ok:
        mine = plain.get(row["layout"]) if row["kind"] == "merak3d" else None
        row["step_over_merak3d_none"] = row["step_ms"] / mine["step_ms"] if mine else None
        for key, name in BASELINES.items():
            other = baseline.get((row["ranks"], name))
            row[f"step_over_{key}"] = row["step_ms"] / other["step_ms"] if other else None
        ddp = baseline.get((row["ranks"], "DDP"))
        trains_together = not row.get("skip_grad_comm")  # without communication the replicas drift apart
        row["loss_max_rel_diff_vs_ddp"] = (_max_rel_diff(row["losses"], ddp["losses"]) if ddp and trains_together
                                           else None)
        if mine and row["mode"] == "optimizer":
            row["optimizer_state_ratio"] = max(a / b for a, b in zip(row["optimizer_bytes"], mine["optimizer_bytes"]))
        if row["kind"] == "merak3d" and row is _variant(ok, row, overlap=True, skip=False):
            serial, removed = _variant(ok, row, overlap=False, skip=False), _variant(ok, row, overlap=True, skip=True)
            if serial and removed:
                row["exposed_grad_comm_fraction"] = exposed_fraction(row["step_ms"], serial["step_ms"],
                                                                     removed["step_ms"])
                row["step_ms_without_overlap"] = serial["step_ms"]
                row["step_ms_without_grad_comm"] = removed["step_ms"]


def search_rows(jobs: list[Job], outcomes: dict[int, Any], offset: int) -> list[dict[str, Any]]:
    rows = []
    for index, job in enumerate(jobs, start=offset):
        outcome = outcomes.get(index, "not run")
        row: dict[str, Any] = {"section": "largest", "name": job.name, "kind": job.kind, "mode": job.mode,
                               "ranks": 4, "cap_mb": job.cap_mb, "ladder": list(job.ladder), "error": None,
                               "refused": False}
        if isinstance(outcome, str):
            row.update(error=outcome, largest_layers=None, params_m=None)
        else:
            result = outcome[0]
            largest = result["largest_layers"]
            params = replace(Workload(**job.workload), layers=largest).parameters() if largest else None
            row.update(largest_layers=largest, params_m=params / 1e6 if params else None,
                       attempts=result["attempts"])
        rows.append(row)
    return rows


def plot_memory(rows: list[dict[str, Any]], layouts: tuple[str, ...], path: Path, title: str) -> Path:
    """Per layout, each run's worst rank: its ideal as stacked parts, and what it measured above its baseline."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    parts = (("param_mb", "parameters", "#4c72b0"), ("grad_ideal_mb", "gradients", "#55a868"),
             ("optimizer_mb", "optimizer state", "#c44e52"), ("activation_mb", "activations", "#8172b2"))
    figure = Figure(figsize=(5.0 * len(layouts), 5.0))
    FigureCanvasAgg(figure)
    axes_list = figure.subplots(1, len(layouts), squeeze=False)[0]
    for axes, layout in zip(axes_list, layouts):
        ranks = LAYOUTS[layout][0]
        shown = [row for row in rows if row["error"] is None and row["overlap"]
                 and row.get("param_gather_overlap") is None and not row.get("skip_grad_comm")
                 and (row["layout"] == layout or (row["kind"] != "merak3d" and row["ranks"] == ranks))]
        labels = [row["mode"] if row["kind"] == "merak3d" else row["name"].replace(" (ModelParallelStrategy)", "")
                  .replace("DeepSpeed ", "") for row in shown]
        for position, row in enumerate(shown):
            rank, bottom = row["worst_rank"], 0.0
            for key, name, colour in parts:
                value = row[key][rank]
                axes.bar(position, value, bottom=bottom, color=colour, width=0.6, label=name if position == 0 else None)
                bottom += value
            axes.plot(position, row["used_mb"][rank], marker="_", markersize=22, markeredgewidth=2.5, color="black",
                      label="measured peak − baseline" if position == 0 else None)
        axes.set_xticks(range(len(shown)), labels, rotation=35, ha="right", fontsize=8)
        axes.set_title(f"{layout} ({ranks} ranks): worst rank per run", fontsize=10)
        axes.set_ylabel("MiB")
    axes_list[0].legend(fontsize=8, loc="upper left")
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    return path

