"""Sharded data parallelism in merak3d on an emulated 1 Gbit/s network: memory, step time, loss, largest model.

Run from the repo root, as root (the shaped links need network namespaces)::

    python -m benchmarks.sharding [--quick] [--out PATH] [--legs LAYOUT ...] [--device cpu|cuda]

(``--legs dp2 pp2xdp2``: only merak3d's modes at those layouts, no baselines or largest-model search, into
``sharding.legs.json``, and the overlap measurement only if ``dp2-long`` is named; ``--device cuda``: the one-GPU
precision leg of ``benchmarks/_sharding_gpu.py``.)

Every job trains a randomly initialised transformers Llama (built from its config, fp32) on gloo
ranks, one compute thread each, each rank in its own network namespace on a tbf-shaped 1 Gbit/s
veth link (``lightning_merak.testing.netem.EmulatedCluster``; where this host cannot emulate it,
on ``LoopbackCluster``, and the JSON says so in ``network``). The ranks of one cluster run all of
its jobs in turn (``benchmarks._sharding_ranks``; memory is reset and measured per job). Per
layout (dp=2, dp=4, pp=2 × dp=2) and per ``data_parallel_sharding`` mode (none, optimizer,
gradients, full), on the same model, batch and seed:

* *memory*, per rank: peak resident size above the rank's resident size when the job began
  (``used_mb``; every rank builds the whole seeded model first, so that losses compare, and its peak
  includes that model once; the largest-model search below builds on the meta device instead), next
  to the rank's *ideal* (its parameters, the gradients and AdamW state its mode keeps, and the
  activations of its in-flight micro-batches, measured per sample with ``saved_activation_bytes``);
  optimizer-state bytes counted in the optimizer, against the ideal (AdamW's two moments of the
  rank's share of the parameters);
* *step time*: median over the timed steps (warm-up dropped) of the slowest rank's step, against
  merak3d with ``none`` on the same layout, Lightning's DDPStrategy, Lightning's
  ModelParallelStrategy (FSDP2 ``fully_shard``) and DeepSpeed ZeRO stage 1 and 2 (driven by
  ``deepspeed.initialize``: Lightning's DeepSpeedStrategy refuses CPU) at the same world size;
* *loss equality*: the largest relative difference of the global loss from Lightning DDP's at the
  same world size over every step;
* *exposed gradient communication*: the strategy's ``reduction_stats["exposed_s_mean"]`` (seconds a
  step waited for gradient reduction after its backward) with ``overlap_grad_reduce=True`` over the
  same with ``False`` (then the whole reduction), worst rank;
* *largest model under a cap* at 4 ranks: per candidate, the largest rung of a ladder of decoder
  layer counts whose worst rank stays within ``cap_mb`` (bisection, meta-device construction).

JSON top level (goals of issue #29): ``optimizer_state_ratio`` (optimizer bytes with ``optimizer``
sharding over ``none``'s, worst rank, at the largest data-parallel degree run; goal ≤ 1/dp + 5 %),
``zero1_step_over_ddp`` (step with ``optimizer`` and ``overlap_param_gather=True`` over plain data parallelism,
merak3d's ``none``, worst layout; ≤ 1.05; ``zero1_default_step_over_merak3d_none`` is the same without overlapped
gathering, ``zero1_step_over_lightning_ddp`` the overlapped one over Lightning's DDPStrategy),
``exposed_grad_comm_fraction`` (worst mode of dp=2 on 4× longer sequences, where a backward outlasts the
reduction; ≤ 0.3; the short-sequence layouts' worst is ``exposed_grad_comm_fraction_short_sequences``),
``loss_max_rel_diff`` (worst merak3d run; ≤ 1e-5), ``largest_model_ratio_vs_fsdp2`` (merak3d's best
candidate's parameters over FSDP2's; ≥ 1.0); per-layout detail in ``targets``. ``exposed_s_mean`` is
the mean over the steps after the first (which runs without overlap while it confirms the averaged
parameters). A bar chart of per-rank memory per mode is written
beside the JSON (``NAME_memory.png``). ``load_average`` (1-minute, at start and end) says whether other
work shared the machine: step times and exposed fractions mean something only on a quiet one. A merak3d
mode the strategy does not offer yet is reported with its error; any error except a DeepSpeed baseline
refusing this machine makes the command exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

from benchmarks import report
from benchmarks._scale_ranks import Workload, measure_activations
from benchmarks._sharding_ranks import Job, job_entries
from lightning_merak.testing.netem import (
    EmulatedCluster,
    LinkSpec,
    LoopbackCluster,
    RankFailure,
    RankTimeout,
    emulation_available,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
RATE_MBIT = 1000.0
CLUSTER_TIMEOUT_S = 1200.0
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MODES = ("none", "optimizer", "gradients", "full")
"""merak3d's ``data_parallel_sharding`` modes, each run on every layout."""
REDUCING_MODES = ("none", "optimizer", "gradients")
"""Modes whose gradients merak3d's own buckets reduce (``full`` leaves it to FSDP2)."""
LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "dp2": (2, {"data_parallel": 2}), "dp4": (4, {"data_parallel": 4}),
    "pp2xdp2": (4, {"data_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2})}
BASELINES = {"ddp": "DDP", "fsdp2": "FSDP2 (ModelParallelStrategy)", "zero1": "DeepSpeed ZeRO-1",
             "zero2": "DeepSpeed ZeRO-2"}
"""Step-time columns ``step_over_KEY``: this run's step over the baseline's of that name at the same world size."""
MAY_REFUSE = {"zero"}
"""Baselines whose refusal to run on this machine is a result, not a failure."""
GOALS = {"optimizer_state_ratio": "<= 1/dp + 0.05 on each layout", "zero1_step_over_ddp": "<= 1.05",
         "exposed_grad_comm_fraction": "<= 0.3", "loss_max_rel_diff": "<= 1e-5",
         "largest_model_ratio_vs_fsdp2": ">= 1.0"}
"""Issue #29's goals for the top-level figures (``goals_met`` judges them)."""


@dataclass(frozen=True)
class Candidate:
    """One contender of the largest-model search at 4 ranks."""

    name: str
    kind: str
    mode: str = "none"
    layout: str = "dp4"


CANDIDATES = (
    Candidate("FSDP2 (ModelParallelStrategy) dp4", "fsdp2"),
    Candidate("merak3d dp4 full", "merak3d", "full"),
    Candidate("merak3d dp4 gradients", "merak3d", "gradients"),
    Candidate("merak3d pp2xdp2 full", "merak3d", "full", "pp2xdp2"),
    Candidate("merak3d pp2xdp2 gradients", "merak3d", "gradients", "pp2xdp2"),
)


@dataclass(frozen=True)
class Setting:
    """What one run measures: the model and steps of the mode comparison, and the largest-model search."""

    workload: Workload
    steps: int
    warmup: int
    layouts: tuple[str, ...]
    overlap_off_modes: tuple[str, ...]
    zero_stages: tuple[int, ...]
    search_workload: Workload
    ladder: tuple[int, ...]
    cap_mb: float
    search_steps: int
    candidates: tuple[Candidate, ...]
    overlap_seq: int
    """Sequence length of the overlap measurement: the same model on longer sequences, so that a rank's backward
    takes longer than reducing its gradients at 1 Gbit/s (otherwise no schedule can hide the reduction)."""
    bucket_mb: float
    """merak3d's ``grad_bucket_mb`` (and DeepSpeed's reduce bucket): many buckets, so that reduction can overlap."""
    legs_only: bool = False
    """Only merak3d's mode comparison (``--legs``): no baselines or largest-model search; the overlap measurement
    only with ``overlap_leg`` (``--legs`` names ``OVERLAP_LEG``)."""
    overlap_leg: bool = False


QUICK = Setting(Workload(hidden=128, layers=8, vocab=1024, seq=64, global_batch=8), steps=8, warmup=2,
                layouts=("dp2", "pp2xdp2"), overlap_off_modes=("none", "optimizer"), zero_stages=(1, 2),
                search_workload=Workload(hidden=256, layers=0, vocab=2048, seq=64, global_batch=8),
                ladder=(8, 16, 24, 32), cap_mb=300.0, search_steps=2, overlap_seq=256, bucket_mb=0.5,
                candidates=tuple(c for c in CANDIDATES if c.mode != "gradients"))
FULL = Setting(Workload(hidden=256, layers=8, vocab=2048, seq=64, global_batch=8), steps=20, warmup=3,
               layouts=("dp2", "dp4", "pp2xdp2"), overlap_off_modes=REDUCING_MODES, zero_stages=(1, 2),
               search_workload=Workload(hidden=256, layers=0, vocab=2048, seq=64, global_batch=8),
               ladder=(8, 12, 16, 24, 32, 40, 48), cap_mb=400.0, search_steps=2, candidates=CANDIDATES,
               overlap_seq=256, bucket_mb=2.0)


# Jobs ------------------------------------------------------------------------------------------


def ladder_description(setting: Setting) -> str:
    """The search's model without its layer count, which the ladder sets."""
    w = setting.search_workload
    return (f"llama hidden {w.hidden}, vocab {w.vocab}, seq {w.seq}, global batch {w.global_batch}, "
            f"{setting.search_steps} steps; decoder layers {list(setting.ladder)}")


def mode_jobs(setting: Setting, world_size: int) -> list[Job]:
    """The mode comparison at ``world_size`` ranks: merak3d per layout and mode (overlap on, and off for some
    modes), then the baselines."""
    workload = asdict(setting.workload)
    jobs = []
    for layout in (name for name in setting.layouts if LAYOUTS[name][0] == world_size):
        degrees = LAYOUTS[layout][1]
        jobs += [Job(f"merak3d {layout} {mode}", "merak3d", workload, setting.steps, mode=mode, layout=degrees,
                     bucket_mb=setting.bucket_mb) for mode in MODES]
        jobs += [Job(f"merak3d {layout} {mode} no-overlap", "merak3d", workload, setting.steps, mode=mode,
                     layout=degrees, overlap=False, bucket_mb=setting.bucket_mb) for mode in setting.overlap_off_modes]
        jobs.append(Job(f"merak3d {layout} optimizer gather-overlap", "merak3d", workload, setting.steps,
                        mode="optimizer", layout=degrees, param_gather_overlap=True, bucket_mb=setting.bucket_mb))
    if not jobs or setting.legs_only:
        return jobs
    jobs += [Job(f"DDP dp{world_size}", "ddp", workload, setting.steps),
             Job(f"FSDP2 (ModelParallelStrategy) dp{world_size}", "fsdp2", workload, setting.steps)]
    jobs += [Job(f"DeepSpeed ZeRO-{stage} dp{world_size}", "zero", workload, setting.steps, stage=stage,
                 bucket_mb=setting.bucket_mb)
             for stage in setting.zero_stages]
    return jobs


OVERLAP_LAYOUT = "dp2 long sequences"
OVERLAP_LEG = "dp2-long"
OVERLAP_MODES = ("none", "optimizer")


def overlap_jobs(setting: Setting) -> list[Job]:
    """The exposed-communication measurement at dp=2 on ``overlap_seq``-token sequences: overlap on and off."""
    workload = asdict(replace(setting.workload, seq=setting.overlap_seq))
    return [Job(f"merak3d {OVERLAP_LAYOUT} {mode}{'' if overlap else ' no-overlap'}", "merak3d", workload,
                setting.steps, mode=mode, layout=LAYOUTS["dp2"][1], overlap=overlap, bucket_mb=setting.bucket_mb)
            for mode in OVERLAP_MODES for overlap in (True, False) if setting.overlap_leg or not setting.legs_only]


def search_jobs(setting: Setting) -> list[Job]:
    workload = asdict(setting.search_workload)
    return [Job(candidate.name, candidate.kind, workload, setting.search_steps, mode=candidate.mode,
                layout=LAYOUTS[candidate.layout][1], meta_init=True, ladder=setting.ladder, cap_mb=setting.cap_mb)
            for candidate in setting.candidates]


def refused_before_launch(job: Job) -> Optional[str]:
    """The error merak3d's constructor raises for ``job``'s options, if it does: no rank starts for it."""
    if job.kind != "merak3d":
        return None
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    try:
        Merak3DStrategy(**job.layout, data_parallel_sharding=job.mode, overlap_grad_reduce=job.overlap,
                        grad_bucket_mb=job.bucket_mb)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _error_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in reversed(lines) if "Error" in line), lines[0] if lines else type(error).__name__)


def run_cluster(world_size: int, jobs: list[tuple[int, Job]], emulated: bool,
                work: Path) -> dict[int, list[dict[str, Any]] | str]:
    """Every job on ``world_size`` ranks: by index, the ranks' results or the error that stopped the job.

    A rank that fails ends the cluster; it is started again on the jobs after the failed one."""
    outcomes: dict[int, list[dict[str, Any]] | str] = {}
    pending = list(jobs)
    while pending:
        jobs_file = work / f"jobs-{world_size}-{pending[0][0]}.json"
        jobs_file.write_text(json.dumps(job_entries(pending)))
        argv = [sys.executable, "-m", "benchmarks._sharding_ranks", str(jobs_file), str(work)]
        cluster = (EmulatedCluster(world_size, LinkSpec(rate_mbit=RATE_MBIT)) if emulated
                   else LoopbackCluster(world_size))
        error: Optional[Exception] = None
        started = time.monotonic()
        try:
            with cluster:
                cluster.run(argv, timeout_s=CLUSTER_TIMEOUT_S, extra_env=RANK_ENV, cwd=REPO_ROOT)
        except (RankFailure, RankTimeout) as failure:
            error = failure
        finished = []
        for index, _ in pending:
            files = [work / f"{index}-{rank}.json" for rank in range(world_size)]
            if all(file.exists() for file in files):
                outcomes[index] = [json.loads(file.read_text()) for file in files]
                finished.append(index)
        remaining = [(index, job) for index, job in pending if index not in finished]
        print(f"  {world_size} ranks: {len(finished)} jobs in {time.monotonic() - started:.0f} s", flush=True)
        if error is None or not remaining:
            break
        failed_index, failed_job = remaining[0]
        outcomes[failed_index] = _error_line(error)
        print(f"  {failed_job.name}: failed: {outcomes[failed_index]}", flush=True)
        pending = remaining[1:]
    return outcomes


# Figures ---------------------------------------------------------------------------------------


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


def _median_slowest(ranks: list[dict[str, Any]], warmup: int) -> float:
    slowest = [max(step) for step in zip(*(rank["step_s"] for rank in ranks))]
    return statistics.median(slowest[warmup:] or slowest)


def job_row(job: Job, layout: str, world_size: int, outcome: list[dict[str, Any]] | str, warmup: int,
            per_sample: dict[str, float]) -> dict[str, Any]:
    """One report row of the mode comparison: memory against the ideal per rank, step time, losses, exposure."""
    row: dict[str, Any] = {"section": "modes", "name": job.name, "layout": layout, "ranks": world_size,
                           "kind": job.kind, "mode": job.mode if job.kind == "merak3d" else None,
                           "stage": job.stage or None, "overlap": job.overlap,
                           "param_gather_overlap": job.param_gather_overlap, "error": None, "refused": False}
    if isinstance(outcome, str):
        row.update(error=outcome, refused=job.kind in MAY_REFUSE)
        return row
    grad_share, optimizer_share = shard_fractions(job, outcome[0]["data_parallel"])
    ideal, grad_ideal, optimizer_ideal, activations = [], [], [], []
    for rank in outcome:
        activations.append(activation_bytes(rank, per_sample))
        grad_ideal.append(rank["param_bytes"] * grad_share)
        optimizer_ideal.append(2 * rank["param_bytes"] * optimizer_share)
        ideal.append(rank["param_bytes"] + grad_ideal[-1] + optimizer_ideal[-1] + activations[-1])
    used = [rank["used_mb"] for rank in outcome]
    worst = max(range(world_size), key=lambda i: used[i] * MIB / ideal[i])
    exposed = [rank["reduction_stats"].get("exposed_s_mean") for rank in outcome if rank["reduction_stats"]]
    row.update(
        step_ms=1e3 * _median_slowest(outcome, warmup), losses=outcome[0]["losses"],
        job_s=round(max(rank["wall_s"] for rank in outcome), 1),
        used_mb=[round(u, 1) for u in used], ideal_mb=[round(i / MIB, 1) for i in ideal],
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


def compare(rows: list[dict[str, Any]]) -> None:
    """Add to each row its ratios against merak3d ``none`` on its layout and the baselines at its world size."""
    ok = [row for row in rows if row["error"] is None]
    plain = {row["layout"]: row for row in ok if row["kind"] == "merak3d" and row["mode"] == "none" and row["overlap"]}
    baseline = {(row["ranks"], row["name"].rsplit(" ", 1)[0]): row for row in ok if row["kind"] != "merak3d"}
    for row in ok:
        mine = plain.get(row["layout"]) if row["kind"] == "merak3d" else None
        row["step_over_merak3d_none"] = row["step_ms"] / mine["step_ms"] if mine else None
        own_workload = row["layout"] != OVERLAP_LAYOUT  # the baselines ran the short sequences only
        for key, name in BASELINES.items():
            other = baseline.get((row["ranks"], name)) if own_workload else None
            row[f"step_over_{key}"] = row["step_ms"] / other["step_ms"] if other else None
        ddp = baseline.get((row["ranks"], "DDP")) if own_workload else None
        row["loss_max_rel_diff_vs_ddp"] = _max_rel_diff(row["losses"], ddp["losses"]) if ddp else None
        if mine and row["mode"] == "optimizer":
            row["optimizer_state_ratio"] = max(a / b for a, b in zip(row["optimizer_bytes"], mine["optimizer_bytes"]))
        if row["kind"] == "merak3d" and row["overlap"] and row["exposed_ms"] is not None:
            off = next((other for other in ok if other["layout"] == row["layout"] and other["mode"] == row["mode"]
                        and other["kind"] == "merak3d" and not other["overlap"]), None)
            if off and off["exposed_ms"]:
                row["exposed_grad_comm_fraction"] = row["exposed_ms"] / off["exposed_ms"]
                row["reduce_ms_without_overlap"] = off["exposed_ms"]


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


def summary(rows: list[dict[str, Any]], largest: list[dict[str, Any]], setting: Setting) -> dict[str, Any]:
    """The issue's top-level figures, and per layout the values and goals behind them."""
    merak = [row for row in rows if row["kind"] == "merak3d" and row["error"] is None]
    per_layout: dict[str, dict[str, Any]] = {}
    for layout in setting.layouts:
        dp = LAYOUTS[layout][1]["data_parallel"]
        zero1, gathered = (next((r for r in merak if r["layout"] == layout and r["mode"] == "optimizer"
                                 and r["overlap"] and r.get("param_gather_overlap", False) is variant), None)
                           for variant in (False, True))
        exposed = {r["mode"]: r.get("exposed_grad_comm_fraction") for r in merak
                   if r["layout"] == layout and r["overlap"] and r.get("exposed_grad_comm_fraction") is not None}
        ratio = zero1.get("optimizer_state_ratio") if zero1 else None
        per_layout[layout] = {
            "optimizer_state_ratio": ratio, "optimizer_state_goal": 1 / dp + 0.05,
            "optimizer_state_goal_met": None if ratio is None else ratio <= 1 / dp + 0.05,
            "zero1_default_step_over_merak3d_none": zero1.get("step_over_merak3d_none") if zero1 else None,
            "zero1_step_over_ddp": gathered.get("step_over_merak3d_none") if gathered else None,
            "zero1_step_over_lightning_ddp": gathered.get("step_over_ddp") if gathered else None,
            "exposed_grad_comm_fraction": exposed,
        }
    by_dp = sorted(setting.layouts, key=lambda name: -LAYOUTS[name][1]["data_parallel"])
    headline = next((name for name in by_dp if per_layout[name]["optimizer_state_ratio"] is not None), None)
    steps = [v["zero1_step_over_ddp"] for v in per_layout.values() if v["zero1_step_over_ddp"] is not None]
    exposed = [f for v in per_layout.values() for f in v["exposed_grad_comm_fraction"].values()]
    losses = [r["loss_max_rel_diff_vs_ddp"] for r in merak if r.get("loss_max_rel_diff_vs_ddp") is not None]
    fsdp2 = next((r["params_m"] for r in largest if r["kind"] == "fsdp2"), None)
    best = max((r for r in largest if r["kind"] == "merak3d" and r["params_m"]), key=lambda r: r["params_m"],
               default=None)
    return {
        "optimizer_state_ratio": per_layout[headline]["optimizer_state_ratio"] if headline else None,
        "optimizer_state_ratio_layout": headline,
        "zero1_step_over_ddp": max(steps) if steps else None,
        "zero1_step_over_ddp_config": "data_parallel_sharding='optimizer', overlap_param_gather=True",
        "zero1_default_step_over_merak3d_none": _worst(per_layout, "zero1_default_step_over_merak3d_none"),
        "zero1_step_over_lightning_ddp": _worst(per_layout, "zero1_step_over_lightning_ddp"),
        "exposed_grad_comm_fraction": max(exposed) if exposed else None,
        "loss_max_rel_diff": max(losses) if losses else None,
        "largest_model_ratio_vs_fsdp2": best["params_m"] / fsdp2 if best and fsdp2 else None,
        "largest_model_best": best["name"] if best else None,
        "targets": per_layout,
    }


def overlap_summary(rows: list[dict[str, Any]], setting: Setting) -> dict[str, Any]:
    """``exposed_grad_comm_fraction`` from the long-sequence measurement (worst mode), and the short-sequence
    layouts' worst as ``exposed_grad_comm_fraction_short_sequences``: there a rank's backward is shorter than
    reducing its gradients at 1 Gbit/s, so at least their difference stays exposed whatever the schedule."""
    fractions = {row["mode"]: row["exposed_grad_comm_fraction"] for row in rows
                 if row["layout"] == OVERLAP_LAYOUT and row["error"] is None and row["overlap"]
                 and row.get("exposed_grad_comm_fraction") is not None}
    short = [f for layout in setting.layouts for f in (row.get("exposed_grad_comm_fraction") for row in rows
             if row["layout"] == layout and row["error"] is None and row["overlap"]) if f is not None]
    return {
        "exposed_grad_comm_fraction": max(fractions.values()) if fractions else None,
        "exposed_grad_comm_fraction_by_mode": fractions,
        "exposed_grad_comm_fraction_workload": replace(setting.workload, seq=setting.overlap_seq).describe() + ", dp2",
        "exposed_grad_comm_fraction_short_sequences": max(short) if short else None,
    }


def _worst(per_layout: dict[str, dict[str, Any]], key: str) -> Optional[float]:
    values = [v[key] for v in per_layout.values() if v[key] is not None]
    return max(values) if values else None


def goals_met(top: dict[str, Any]) -> dict[str, Optional[bool]]:
    def check(value: Optional[float], ok: bool) -> Optional[bool]:
        return None if value is None else ok

    layouts = top["targets"].values()
    state = [v["optimizer_state_goal_met"] for v in layouts if v["optimizer_state_goal_met"] is not None]
    return {
        "optimizer_state_ratio": all(state) if state else None,
        "zero1_step_over_ddp": check(top["zero1_step_over_ddp"], (top["zero1_step_over_ddp"] or 0) <= 1.05),
        "exposed_grad_comm_fraction": check(top["exposed_grad_comm_fraction"],
                                            (top["exposed_grad_comm_fraction"] or 0) <= 0.3),
        "loss_max_rel_diff": check(top["loss_max_rel_diff"], (top["loss_max_rel_diff"] or 0) <= 1e-5),
        "largest_model_ratio_vs_fsdp2": check(top["largest_model_ratio_vs_fsdp2"],
                                              (top["largest_model_ratio_vs_fsdp2"] or 0) >= 1.0),
    }


# Chart -----------------------------------------------------------------------------------------


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
        shown = [row for row in rows if row["error"] is None and row["overlap"] and not row.get("param_gather_overlap")
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


# Driver ----------------------------------------------------------------------------------------


COLUMNS = ["layout", "name", "step_ms", "step_over_merak3d_none", *(f"step_over_{key}" for key in BASELINES),
           "optimizer_state_ratio", "optimizer_over_ideal", "exposed_grad_comm_fraction", "loss_max_rel_diff_vs_ddp",
           "peak_over_ideal", "error"]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="dp=2 and pp=2 × dp=2, fewer steps (under 4 minutes)")
    parser.add_argument("--out", type=Path, help=report.out_help("sharding"))
    parser.add_argument("--legs", nargs="+", choices=(*LAYOUTS, OVERLAP_LEG), help="only merak3d's modes at these "
                        f"layouts ({OVERLAP_LEG}: the overlap measurement)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the one-GPU precision leg (benchmarks/_sharding_gpu.py) instead of the CPU run")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        from benchmarks._sharding_gpu import gpu_main

        return gpu_main(args.out or report.default_out("sharding.gpu", args.quick), args.quick)
    args.out = args.out or report.default_out("sharding.legs" if args.legs else "sharding", args.quick)
    setting = QUICK if args.quick else FULL
    if args.legs:
        setting = replace(setting, layouts=tuple(leg for leg in args.legs if leg in LAYOUTS), candidates=(),
                          legs_only=True, overlap_leg=OVERLAP_LEG in args.legs)
    emulated = emulation_available()
    network = f"{RATE_MBIT / 1000:g}Gbit (emulated)" if emulated else "loopback (unshaped: emulation unavailable)"
    started, load_at_start = time.monotonic(), os.getloadavg()[0]
    print(f"{setting.workload.describe()}, {setting.steps} steps; network {network}", flush=True)
    per_sample = measure_activations(setting.workload)

    jobs: list[tuple[int, Job, str, int]] = []  # index, job, layout, world size
    for world_size in (2, 4):
        for job in mode_jobs(setting, world_size):
            layout = next((name for name, (_, degrees) in LAYOUTS.items()
                           if job.kind == "merak3d" and degrees == job.layout), f"dp{world_size}")
            jobs.append((len(jobs), job, layout, world_size))
    jobs += [(len(jobs) + i, job, OVERLAP_LAYOUT, 2) for i, job in enumerate(overlap_jobs(setting))]
    searches = search_jobs(setting)
    search_offset = len(jobs)
    jobs += [(search_offset + i, job, c.layout, 4)
             for i, (job, c) in enumerate(zip(searches, setting.candidates))]

    outcomes: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="merak-sharding-") as work:
        for world_size in (2, 4):
            runnable = []
            for index, job, _, _ in (entry for entry in jobs if entry[3] == world_size):
                if (refusal := refused_before_launch(job)) is not None:
                    outcomes[index] = refusal
                    print(f"  {job.name}: refused before launch: {refusal}", flush=True)
                else:
                    runnable.append((index, job))
            if runnable:
                print(f"{world_size} ranks: {len(runnable)} jobs", flush=True)
                outcomes.update(run_cluster(world_size, runnable, emulated, Path(work)))

    overlap_per_sample = measure_activations(replace(setting.workload, seq=setting.overlap_seq))
    rows = [job_row(job, layout, size, outcomes.get(index, "not run"), setting.warmup,
                    overlap_per_sample if layout == OVERLAP_LAYOUT else per_sample)
            for index, job, layout, size in jobs if index < search_offset]
    compare(rows)
    largest = search_rows(searches, outcomes, search_offset)
    top = summary(rows, largest, setting)
    top.update(overlap_summary(rows, setting))
    met = goals_met(top)

    print(f"\nSharded data parallelism ({network}; {setting.workload.describe()})")
    report.print_table(rows, COLUMNS)
    print(f"\nLargest model under {setting.cap_mb:.0f} MiB per rank above baseline, 4 ranks "
          f"({ladder_description(setting)})")
    report.print_table(largest, ["name", "largest_layers", "params_m", "error"])
    print("\n" + "\n".join(f"{key}: {top[key]} (goal {GOALS[key]}: {met[key]})" for key in GOALS))

    chart = args.out.with_name(f"{args.out.stem}_memory.png")
    if setting.layouts:  # not for the overlap measurement alone
        plot_memory(rows, setting.layouts, chart, f"per-rank memory by sharding mode ({network}, "
                                                  f"{setting.workload.describe()})")
    wall_s = round(time.monotonic() - started, 1)
    label: report.Label = "emulated" if emulated else "measured"
    out = report.write_json(
        args.out, [*rows, *largest], label=label, benchmark="sharding", quick=args.quick, backend="gloo",
        network=network, threads_per_rank=1, rank_env=RANK_ENV, workload=setting.workload.describe(),
        search_workload=ladder_description(setting), ladder_layers=list(setting.ladder),
        cap_mb=setting.cap_mb, steps=setting.steps, warmup_steps=setting.warmup, modes=list(MODES),
        activations_per_sample=per_sample, **{key: value for key, value in top.items()}, goals=GOALS,
        goals_met=met, memory_png=chart.name if setting.layouts else None, wall_s=wall_s,
        load_average={"start": load_at_start, "end": os.getloadavg()[0]},
        gpu_leg="not run: CPU/gloo ranks on an emulated network",
    )
    print(f"wrote {out} and {chart.name} in {wall_s:.0f} s")
    failed = [row for row in [*rows, *largest] if row["error"] and not row["refused"]]
    for row in failed:
        print(f"sharding: {row['name']} failed: {row['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
