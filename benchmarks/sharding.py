"""Sharded data parallelism in merak3d on an emulated 1 Gbit/s network: memory, step time, loss, largest model.

Run from the repo root, as root (the shaped links need network namespaces)::

    python -m benchmarks.sharding [--quick] [--out PATH] [--legs LAYOUT ...] [--device cpu|cuda]

(``--legs dp2 pp2xdp2``: only merak3d's modes at those layouts, no baselines or largest-model search, into
``sharding.legs.json``; ``--device cuda``: the one-GPU precision leg of ``benchmarks/_sharding_gpu.py``.)

Every job trains a randomly initialised transformers Llama (built from its config, fp32) on gloo
ranks, one compute thread each, each rank in its own network namespace on a tbf-shaped 1 Gbit/s
veth link (``lightning_merak.testing.netem.EmulatedCluster``; where this host cannot emulate it,
on ``LoopbackCluster``, and the JSON says so in ``network``). Every rank, ours and the baselines', starts with the
heap merak3d's launcher gives a user's ranks (``RANK_ENV``). The ranks of one cluster run all of
its jobs in turn (``benchmarks._sharding_ranks``; memory is reset and measured per job). Per
layout (dp=2, dp=4, pp=2 × dp=2) and per ``data_parallel_sharding`` mode (none, optimizer,
gradients, full), merak3d at its defaults, on the same model, batch and seed:

* *memory*, per rank: peak resident size above the rank's resident size when the job began, in a
  separate short run of the same job (``MEMORY_STEPS``, ``LIVE_HEAP_ENV``), next to the rank's *ideal* (its
  parameters, the gradients and AdamW state its mode keeps, and the activations of its in-flight micro-batches);
  optimizer-state bytes counted in the optimizer;
* *step time*: median over the timed steps (warm-up dropped) of the slowest rank's step, against
  merak3d with ``none`` on the same layout, Lightning's DDPStrategy with merak3d's default bucket size (``DDP``)
  and at its own 25 MB (``DDP default buckets``), Lightning's ModelParallelStrategy (FSDP2 ``fully_shard``) and
  DeepSpeed ZeRO stage 1 and 2 (``deepspeed.initialize``: Lightning's DeepSpeedStrategy refuses CPU; merak3d's
  bucket size, fp32, no clipping, like the others) at the same world size;
* *loss equality*: the largest relative difference of the global loss from Lightning DDP's at the same world size;
* *exposed gradient communication*, per reducing mode: (step with overlap − step with the gradient collectives
  removed) / (step without overlap − the same), the removed step run with
  ``lightning_merak.parallel.data.skipped_communication.gradient_communication_skipped``;
* *largest model under a cap* at 4 ranks: per candidate, the largest rung of a 2-layer ladder of decoder
  layer counts whose worst rank stays within ``cap_mb`` (bisection, meta-device construction).

The goals of issue #49 (``GOALS``; each the worst case over its configurations, written with
``benchmarks.goals.write_run``): ``zero1_default_over_lightning_ddp`` (≤ 1.05), ``exposed_grad_comm_fraction``
(≤ 0.3), ``largest_model_ratio_vs_fsdp2`` (≥ 1.25), and issue #29's ``loss_max_rel_diff`` (≤ 1e-5); per-layout
figures beside them in ``targets``. A bar chart of per-rank memory per mode is written beside the JSON
(``NAME_memory.png``). ``load_average`` (1-minute, at start and end) says whether other work shared the machine. A
merak3d mode the strategy does not offer yet is reported with its error; any error except a DeepSpeed baseline
refusing this machine makes the command exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

from benchmarks import report
from benchmarks._scale_ranks import Workload, measure_activations
from benchmarks._sharding_ranks import Job, job_entries
from benchmarks._sharding_rows import BASELINES, LAYOUTS, compare, job_row, plot_memory, search_rows
from benchmarks.goals import Goal, print_goals, worst_case, write_run
from lightning_merak.distributed.host_memory import with_heap_tunables
from lightning_merak.testing.cpu_quota import device_per_rank_quota, emulation_record
from lightning_merak.testing.netem import (
    EmulatedCluster,
    LinkSpec,
    LoopbackCluster,
    RankFailure,
    RankTimeout,
    emulation_available,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
RATE_MBIT = 1000.0
CLUSTER_TIMEOUT_S_PER_JOB = 240.0
"""A cluster runs a list of jobs: its time limit grows with the list (a full run's 33 timed jobs at 4 ranks take
about 25 minutes under one device per rank)."""
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLIBC_TUNABLES": with_heap_tunables(os.environ)}
"""Every rank's environment, ours and the baselines': one compute thread, and the heap merak3d's launcher gives a
user's ranks (``lightning_merak.distributed.host_memory.HEAP_TUNABLES``)."""
LIVE_HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
"""Added to ``RANK_ENV`` for the memory runs only (every kind alike; no goal is taken from them): glibc's mmap
threshold pinned at its 128 KiB default, so every tensor storage from 128 KiB up has its own mapping, unmapped when
freed, and the resident peak follows the tensors alive at once (``torch.cuda.max_memory_allocated``'s view on a
GPU). With glibc's dynamic threshold a freed bucket raises the threshold and later ones stay in the heap."""
MEMORY_STEPS = 4
"""Steps of a job's memory run: its resident peak no longer grows after the second with the pinned threshold."""
MODES = ("none", "optimizer", "gradients", "full")
"""merak3d's ``data_parallel_sharding`` modes, each run on every layout."""
REDUCING_MODES = ("none", "optimizer", "gradients")
"""Modes whose gradients merak3d's own buckets reduce: the ones whose reduction can run without overlap or without
its collectives (``full`` leaves it to FSDP2, which has neither)."""

ZERO1_OVER_DDP = Goal(
    "zero1_default_over_lightning_ddp", 1.05, "<=",
    "step time (median of the slowest rank, warm-up dropped) of merak3d with data_parallel_sharding='optimizer' and "
    "every other option at its default, over Lightning's DDPStrategy with bucket_cap_mb set to merak3d's default "
    "bucket for the whole model, at the same world size (pp2×dp2: DDP on 4 ranks, what a Lightning user runs there); "
    "llama hidden 256, 8 layers, vocab 2048, seq 64, global batch 8, fp32, gloo, 1 thread per rank, emulated "
    "1 Gbit/s links; worst of dp2, dp4, pp2×dp2", issue=49)
EXPOSED = Goal(
    "exposed_grad_comm_fraction", 0.3, "<=",
    "(step with overlap_grad_reduce − step with the gradient collectives removed) / (step without overlap − step "
    "with them removed), merak3d at its defaults otherwise, steps the median of the slowest rank; the original "
    "workload (llama hidden 256, 8 layers, vocab 2048, seq 64, global batch 8, emulated 1 Gbit/s); worst of "
    "modes none, optimizer, gradients (full's reduction is FSDP2's, with no serial schedule to compare) × dp2, "
    "dp4, pp2×dp2", issue=49)
LARGEST = Goal(
    "largest_model_ratio_vs_fsdp2", 1.25, ">=",
    "parameters of the largest llama (hidden 256, vocab 2048, seq 64, global batch 8; decoder layers on a 2-layer "
    "ladder) whose worst rank stays within the cap (MiB above its start) on 4 ranks, merak3d with its layout, "
    "sharding and recompute planned (memory_limit the cap) over Lightning's ModelParallelStrategy with FSDP2 and "
    "activation checkpointing on every decoder layer", issue=49)
LOSS = Goal("loss_max_rel_diff", 1e-5, "<=",
            "largest relative difference of the global loss from Lightning DDP's at the same world size, over every "
            "step, worst merak3d run that communicates", issue=29)
GOALS = (ZERO1_OVER_DDP, EXPOSED, LARGEST, LOSS)


@dataclass(frozen=True)
class Candidate:
    """One contender of the largest-model search at 4 ranks (``layout``: its degrees, ``auto`` where planned)."""

    name: str
    kind: str
    mode: str = "none"
    layout: tuple[tuple[str, int | str], ...] = (("data_parallel", 4),)
    recompute: str = "none"
    checkpointing: bool = False


PLANNED = "merak3d planned"
"""The candidate whose layout, sharding and recompute merak3d's planner chooses: the goal's numerator."""
FSDP2_CHECKPOINTED = "FSDP2 (ModelParallelStrategy) + activation checkpointing dp4"
"""The goal's denominator."""
PP2XDP2 = (("data_parallel", 2), ("pipeline_parallel", 2), ("micro_batches", 2))
CANDIDATES = (
    Candidate(FSDP2_CHECKPOINTED, "fsdp2", checkpointing=True),
    Candidate("FSDP2 (ModelParallelStrategy) dp4", "fsdp2"),
    Candidate(PLANNED, "merak3d", "auto", (("data_parallel", "auto"), ("pipeline_parallel", "auto")), "auto"),
    Candidate("merak3d dp4 full, recompute full", "merak3d", "full", recompute="full"),
    Candidate("merak3d pp2xdp2 full, recompute full", "merak3d", "full", PP2XDP2, "full"),
    Candidate("merak3d pp2xdp2 gradients, recompute full", "merak3d", "gradients", PP2XDP2, "full"),
)


@dataclass(frozen=True)
class Setting:
    """What one run measures: the model and steps of the mode comparison, and the largest-model search."""

    workload: Workload
    steps: int
    warmup: int
    layouts: tuple[str, ...]
    reducing_modes: tuple[str, ...]
    """Modes also run without overlap and without gradient communication (the exposed fraction's)."""
    zero_stages: tuple[int, ...]
    search_workload: Workload
    ladder: tuple[int, ...]
    cap_mb: float
    search_steps: int
    candidates: tuple[Candidate, ...]
    legs_only: bool = False
    """Only merak3d's mode comparison (``--legs``): no baselines or largest-model search."""


def two_layer_ladder(low: int, high: int) -> tuple[int, ...]:
    return tuple(range(low, high + 1, 2))


QUICK = Setting(Workload(hidden=128, layers=8, vocab=1024, seq=64, global_batch=8), steps=8, warmup=2,
                layouts=("dp2", "pp2xdp2"), reducing_modes=("none", "optimizer"), zero_stages=(1, 2),
                search_workload=Workload(hidden=256, layers=0, vocab=2048, seq=64, global_batch=8),
                ladder=two_layer_ladder(8, 64), cap_mb=300.0, search_steps=2,
                candidates=tuple(c for c in CANDIDATES if c.mode != "gradients"))
FULL = Setting(Workload(hidden=256, layers=8, vocab=2048, seq=64, global_batch=8), steps=20, warmup=3,
               layouts=("dp2", "dp4", "pp2xdp2"), reducing_modes=REDUCING_MODES, zero_stages=(1, 2),
               search_workload=Workload(hidden=256, layers=0, vocab=2048, seq=64, global_batch=8),
               ladder=two_layer_ladder(8, 128), cap_mb=400.0, search_steps=2, candidates=CANDIDATES)


# Jobs ------------------------------------------------------------------------------------------


def ladder_description(setting: Setting) -> str:
    """The search's model without its layer count, which the ladder sets."""
    w = setting.search_workload
    return (f"llama hidden {w.hidden}, vocab {w.vocab}, seq {w.seq}, global batch {w.global_batch}, "
            f"{setting.search_steps} steps; decoder layers {setting.ladder[0]}–{setting.ladder[-1]} by 2")


def merak3d_default_bucket_mb(workload: Workload) -> float:
    """merak3d's default gradient bucket (MiB) for ``workload``'s whole model: the size Lightning DDP gets too."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_merak.parallel.data.buckets import bucket_bytes

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(workload.config())
    return bucket_bytes(None, list(model.parameters())) / 2**20


def mode_jobs(setting: Setting, world_size: int, ddp_bucket_mb: float) -> list[Job]:
    """The mode comparison at ``world_size`` ranks: merak3d per layout and mode at its defaults, the reducing modes
    also without overlap and without gradient communication, ZeRO-1 gathering right after the optimizer step (a
    labelled non-default row); then the baselines, DDP with ``ddp_bucket_mb`` (merak3d's default) and at its own
    default."""
    workload = asdict(setting.workload)
    jobs = []
    for layout in (name for name in setting.layouts if LAYOUTS[name][0] == world_size):
        degrees = LAYOUTS[layout][1]

        def job(suffix: str, mode: str, **options: Any) -> Job:
            return Job(f"merak3d {layout} {mode}{suffix}", "merak3d", workload, setting.steps, mode=mode,
                       layout=degrees, **options)

        jobs += [job("", mode) for mode in MODES]
        jobs += [job(" no-overlap", mode, overlap=False) for mode in setting.reducing_modes]
        jobs += [job(" no-grad-comm", mode, skip_grad_comm=True) for mode in setting.reducing_modes]
        jobs.append(job(" gather-after-step", "optimizer", param_gather_overlap=False))
    if not jobs or setting.legs_only:
        return jobs
    jobs += [Job(f"DDP dp{world_size}", "ddp", workload, setting.steps, bucket_mb=ddp_bucket_mb),
             Job(f"DDP default buckets dp{world_size}", "ddp", workload, setting.steps),
             Job(f"FSDP2 (ModelParallelStrategy) dp{world_size}", "fsdp2", workload, setting.steps)]
    jobs += [Job(f"DeepSpeed ZeRO-{stage} dp{world_size}", "zero", workload, setting.steps, stage=stage,
                 bucket_mb=ddp_bucket_mb) for stage in setting.zero_stages]
    return jobs


def search_jobs(setting: Setting) -> list[Job]:
    workload = asdict(setting.search_workload)
    return [Job(candidate.name, candidate.kind, workload, setting.search_steps, mode=candidate.mode,
                layout=dict(candidate.layout), recompute=candidate.recompute, checkpointing=candidate.checkpointing,
                meta_init=True, ladder=setting.ladder, cap_mb=setting.cap_mb)
            for candidate in setting.candidates]


def refused_before_launch(job: Job) -> Optional[str]:
    """The error merak3d's constructor raises for ``job``'s options, if it does: no rank starts for it."""
    if job.kind != "merak3d":
        return None
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    try:
        Merak3DStrategy(**job.layout, data_parallel_sharding=job.mode, overlap_grad_reduce=job.overlap,
                        grad_bucket_mb=job.bucket_mb, recompute=job.recompute)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def run_cluster(world_size: int, jobs: list[tuple[int, Job]], emulated: bool, work: Path,
                extra_env: dict[str, str]) -> dict[int, list[dict[str, Any]] | str]:
    """Every job on ``world_size`` ranks started with ``extra_env``: by index, the ranks' results or the error that
    stopped the job.

    A rank that fails ends the cluster; it is started again on the jobs after the failed one."""
    outcomes: dict[int, list[dict[str, Any]] | str] = {}
    pending = list(jobs)
    while pending:
        jobs_file = work / f"jobs-{world_size}-{pending[0][0]}.json"
        jobs_file.write_text(json.dumps(job_entries(pending)))
        argv = [sys.executable, "-m", "benchmarks._sharding_ranks", str(jobs_file), str(work)]
        # timed clusters emulate one device per rank (a CPU quota each at more ranks than cores)
        quota = device_per_rank_quota(world_size)
        cluster = (EmulatedCluster(world_size, LinkSpec(rate_mbit=RATE_MBIT), cpu_quota=quota) if emulated
                   else LoopbackCluster(world_size))
        error: Optional[Exception] = None
        started = time.monotonic()
        try:
            with cluster:
                cluster.run(argv, timeout_s=CLUSTER_TIMEOUT_S_PER_JOB * len(pending), extra_env=extra_env,
                            cwd=REPO_ROOT)
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
        failed = _failed_index(work, world_size, remaining[0][0])
        if failed < 0:  # a warm-up failed: every job of its kind would fail the same way
            warm_kind = job_entries(pending)[-1 - failed]["job"]["kind"]
            stopped = [(index, job) for index, job in remaining if job.kind == warm_kind]
        else:
            stopped = [(index, job) for index, job in remaining if index == failed]
        for index, job in stopped:
            outcomes[index] = report.rank_failure_line(error)
            print(f"  {job.name}: failed: {outcomes[index]}", flush=True)
        pending = [(index, job) for index, job in remaining if (index, job) not in stopped]
    return outcomes


def _failed_index(work: Path, world_size: int, first_remaining: int) -> int:
    """The index of the job a failed cluster stopped in (a warm-up's is negative), as its ranks recorded it; the
    first unfinished job where no rank recorded one."""
    started = [int(path.read_text()) for rank in range(world_size) if (path := work / f"current-{rank}").exists()]
    for path in work.glob("current-*"):
        path.unlink()
    return min(started, key=lambda index: (index >= 0, index)) if started else first_remaining


# Figures ---------------------------------------------------------------------------------------


def _merak(rows: list[dict[str, Any]], layout: str, mode: str) -> Optional[dict[str, Any]]:
    """merak3d's default run of ``mode`` at ``layout`` (overlap on, communicating, the parameter gather as default)."""
    return next((row for row in rows if row["kind"] == "merak3d" and row["layout"] == layout and row["mode"] == mode
                 and row["overlap"] and not row["skip_grad_comm"] and row["param_gather_overlap"] is None), None)


def _figure(row: Optional[dict[str, Any]], key: str) -> Optional[float]:
    return None if row is None or row["error"] is not None else row.get(key)


def goal_figures(rows: list[dict[str, Any]], largest: list[dict[str, Any]],
                 setting: Setting) -> list[dict[str, Any]]:
    """Each goal's worst case over its leg's configurations (a configuration that failed has no figure, so the goal
    has none: a failure never drops out of the worst case)."""
    zero1 = {layout: _figure(_merak(rows, layout, "optimizer"), "step_over_ddp") for layout in setting.layouts}
    exposed = {f"{layout} {mode}": _figure(_merak(rows, layout, mode), "exposed_grad_comm_fraction")
               for layout in setting.layouts for mode in setting.reducing_modes}
    params = {row["name"]: row.get("params_m") for row in largest}
    planned, fsdp2 = params.get(PLANNED), params.get(FSDP2_CHECKPOINTED)
    losses = {row["name"]: row.get("loss_max_rel_diff_vs_ddp") for row in rows
              if row["kind"] == "merak3d" and not row["skip_grad_comm"]}
    return [worst_case(ZERO1_OVER_DDP, zero1),
            worst_case(EXPOSED, exposed),
            worst_case(LARGEST, {"4 ranks": planned / fsdp2 if planned and fsdp2 else None},
                       note=f"{PLANNED} {planned} M parameters, {FSDP2_CHECKPOINTED} {fsdp2} M"),
            worst_case(LOSS, losses)]


def context_figures(rows: list[dict[str, Any]], setting: Setting) -> dict[str, Any]:
    """Figures beside the goals, per layout: ZeRO-1 at its defaults over DDP at DDP's own default buckets (both at
    their defaults), with overlapped gathering over DDP, over merak3d ``none``; and the optimizer-state share."""
    per_layout: dict[str, dict[str, Any]] = {}
    for layout in setting.layouts:
        dp = LAYOUTS[layout][1]["data_parallel"]
        zero1 = _merak(rows, layout, "optimizer")
        after_step = next((row for row in rows if row["layout"] == layout and row["param_gather_overlap"] is False),
                          None)
        ratio = _figure(zero1, "optimizer_state_ratio")
        per_layout[layout] = {
            "zero1_default_over_lightning_ddp_default_buckets": _figure(zero1, "step_over_ddp_default"),
            "zero1_gather_after_step_over_lightning_ddp": _figure(after_step, "step_over_ddp"),
            "zero1_default_over_merak3d_none": _figure(zero1, "step_over_merak3d_none"),
            "optimizer_state_ratio": ratio, "optimizer_state_goal": 1 / dp + 0.05,
            "optimizer_state_goal_met": None if ratio is None else ratio <= 1 / dp + 0.05,
        }
    return {"targets": per_layout}


# Driver ----------------------------------------------------------------------------------------


COLUMNS = ["layout", "name", "step_ms", "step_over_merak3d_none", *(f"step_over_{key}" for key in BASELINES),
           "optimizer_state_ratio", "exposed_grad_comm_fraction", "loss_max_rel_diff_vs_ddp", "peak_over_ideal",
           "error"]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="dp=2 and pp=2 × dp=2, fewer steps")
    parser.add_argument("--out", type=Path, help=report.out_help("sharding"))
    parser.add_argument("--legs", nargs="+", choices=tuple(LAYOUTS), help="only merak3d's modes at these layouts")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the one-GPU precision leg (benchmarks/_sharding_gpu.py) instead of the CPU run")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        from benchmarks._sharding_gpu import gpu_main

        return gpu_main(args.out or report.default_out("sharding.gpu", args.quick), args.quick)
    setting = QUICK if args.quick else FULL
    if args.legs:
        setting = replace(setting, layouts=tuple(args.legs), candidates=(), legs_only=True)
    out = args.out or (report.default_out("sharding.legs", args.quick) if args.legs else None)
    emulated = emulation_available()
    network = f"{RATE_MBIT / 1000:g}Gbit (emulated)" if emulated else "loopback (unshaped: emulation unavailable)"
    started, load_at_start = time.monotonic(), os.getloadavg()[0]
    print(f"{setting.workload.describe()}, {setting.steps} steps; network {network}", flush=True)
    per_sample = measure_activations(setting.workload)
    ddp_bucket_mb = merak3d_default_bucket_mb(setting.workload)

    jobs: list[tuple[int, Job, str, int]] = []  # index, job, layout, world size
    for world_size in (2, 4):
        for job in mode_jobs(setting, world_size, ddp_bucket_mb):
            layout = next((name for name, (_, degrees) in LAYOUTS.items()
                           if job.kind == "merak3d" and degrees == job.layout), f"dp{world_size}")
            jobs.append((len(jobs), job, layout, world_size))
    timed = len(jobs)
    memory_of = {index: timed + index for index, *_ in jobs}
    jobs += [(memory_of[index], replace(job, steps=MEMORY_STEPS), layout, size) for index, job, layout, size in
             list(jobs)]
    searches = search_jobs(setting)
    search_offset = len(jobs)
    jobs += [(search_offset + i, job, "dp4", 4) for i, job in enumerate(searches)]

    outcomes: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="merak-sharding-") as work:
        for world_size in (2, 4):
            for memory_run in (False, True):
                runnable = []
                for index, job, _, _ in (entry for entry in jobs if entry[3] == world_size
                                         and (timed <= entry[0] < search_offset) == memory_run):
                    if (refusal := refused_before_launch(job)) is not None:
                        outcomes[index] = refusal
                        print(f"  {job.name}: refused before launch: {refusal}", flush=True)
                    else:
                        runnable.append((index, job))
                if runnable:
                    print(f"{world_size} ranks: {len(runnable)} {'memory' if memory_run else 'timed'} jobs",
                          flush=True)
                    env = {**RANK_ENV, **LIVE_HEAP_ENV} if memory_run else RANK_ENV
                    outcomes.update(run_cluster(world_size, runnable, emulated, Path(work), env))

    rows = [job_row(job, layout, size, outcomes.get(index, "not run"), outcomes.get(memory_of[index], "not run"),
                    setting.warmup, per_sample) for index, job, layout, size in jobs if index < timed]
    compare(rows)
    largest = search_rows(searches, outcomes, search_offset)
    goals = goal_figures(rows, largest, setting)
    context = context_figures(rows, setting)

    print(f"\nSharded data parallelism ({network}; {setting.workload.describe()})")
    report.print_table(rows, COLUMNS)
    print(f"\nLargest model under {setting.cap_mb:.0f} MiB per rank above baseline, 4 ranks "
          f"({ladder_description(setting)})")
    report.print_table(largest, ["name", "largest_layers", "params_m", "error"])
    print_goals(goals)

    chart = (out or report.default_out("sharding", args.quick))
    chart = chart.with_name(f"{chart.stem}_memory.png")
    plot_memory(rows, setting.layouts, chart, f"per-rank memory by sharding mode ({network}, "
                                              f"{setting.workload.describe()})")
    wall_s = round(time.monotonic() - started, 1)
    label: report.Label = "emulated" if emulated else "measured"
    written = write_run(
        "sharding", [*rows, *largest], label, goals, args.quick, out=out, benchmark="sharding",
        backend="gloo", network=network, threads_per_rank=1, rank_env=RANK_ENV, memory_rank_env=LIVE_HEAP_ENV,
        rank_cpu={n: emulation_record(device_per_rank_quota(n), n) for n in (2, 4)},
        memory_steps=MEMORY_STEPS, workload=setting.workload.describe(), ddp_bucket_mb=ddp_bucket_mb,
        search_workload=ladder_description(setting), ladder_layers=list(setting.ladder),
        cap_mb=setting.cap_mb, steps=setting.steps, warmup_steps=setting.warmup, modes=list(MODES),
        activations_per_sample=per_sample, **context, memory_png=chart.name, wall_s=wall_s,
        load_average={"start": load_at_start, "end": os.getloadavg()[0]},
        gpu_leg="not run: CPU/gloo ranks on an emulated network",
    )
    print(f"wrote {written} and {chart.name} in {wall_s:.0f} s")
    failed = [row for row in [*rows, *largest] if row["error"] and not row["refused"]]
    for row in failed:
        print(f"sharding: {row['name']} failed: {row['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
