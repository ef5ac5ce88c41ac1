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

* *memory*, per rank: peak resident size above the rank's resident size when the job began, in a
  separate short run of the same job (``MEMORY_STEPS``) whose ranks start with glibc's mmap threshold
  pinned (``LIVE_HEAP_ENV``), so that freed tensors leave the resident size (``used_mb``; the timed run's
  figure on glibc's default heap is ``used_mb_default_heap``; every rank builds the whole seeded model
  first, so that losses compare, and its peak includes that model once; the largest-model search below
  runs on the same heap and builds on the meta device instead), next
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
merak3d's ``none``, worst layout, each layout's the median over ``paired_repeats`` runs of the two jobs back to
back, ``zero1_step_over_ddp_pairs`` in ``targets``; ≤ 1.05; ``zero1_default_step_over_merak3d_none`` is the same
without overlapped gathering, ``zero1_step_over_lightning_ddp`` the overlapped one over Lightning's DDPStrategy),
``exposed_grad_comm_fraction`` (worst mode of dp=2 on 4× longer sequences, where a backward outlasts the
reduction, each mode's the median over ``paired_repeats`` runs of its two jobs back to back,
``exposed_grad_comm_fraction_runs``; ≤ 0.3; the short-sequence layouts' worst is
``exposed_grad_comm_fraction_short_sequences``),
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

from benchmarks import report
from benchmarks._scale_ranks import Workload, measure_activations
from benchmarks._sharding_ranks import Job, job_entries
from benchmarks._sharding_rows import (
    BASELINES,
    LAYOUTS,
    OVERLAP_LAYOUT,
    compare,
    job_row,
    plot_memory,
    repeat_row,
    search_rows,
)
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
CLUSTER_TIMEOUT_S = 1200.0
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
LIVE_HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
"""Added to ``RANK_ENV`` for the memory runs: glibc's mmap threshold pinned at its 128 KiB default, so every tensor
storage from 128 KiB up has its own mapping, unmapped when freed, and the resident peak follows the tensors alive
at once (``torch.cuda.max_memory_allocated``'s view on a GPU). With glibc's dynamic threshold a freed bucket raises
the threshold and later ones stay in the heap: a dp=4 rank's resident size grew step after step, to 145 MiB after
6 steps with ZeRO-2 against 98 MiB pinned (plain dp 152 / 140), which hid most of what sharding saves."""
MEMORY_STEPS = 4
"""Steps of a job's memory run: its resident peak no longer grows after the second with the pinned threshold."""
MODES = ("none", "optimizer", "gradients", "full")
"""merak3d's ``data_parallel_sharding`` modes, each run on every layout."""
REDUCING_MODES = ("none", "optimizer", "gradients")
"""Modes whose gradients merak3d's own buckets reduce (``full`` leaves it to FSDP2)."""
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
    paired_repeats: int = 3
    """Runs of each layout's headline pair (plain dp, then ZeRO-1 with the gather overlapped), back to back:
    ``zero1_step_over_ddp`` is the median of the pairs' ratios, so that a slow spell on this shared machine during
    one of two jobs minutes apart does not decide it."""
    legs_only: bool = False
    """Only merak3d's mode comparison (``--legs``): no baselines or largest-model search; the overlap measurement
    only with ``overlap_leg`` (``--legs`` names ``OVERLAP_LEG``)."""
    overlap_leg: bool = False


QUICK = Setting(Workload(hidden=128, layers=8, vocab=1024, seq=64, global_batch=8), steps=8, warmup=2,
                layouts=("dp2", "pp2xdp2"), overlap_off_modes=("none", "optimizer"), zero_stages=(1, 2),
                search_workload=Workload(hidden=256, layers=0, vocab=2048, seq=64, global_batch=8),
                ladder=(8, 16, 32, 48, 64), cap_mb=300.0, search_steps=2, overlap_seq=256, bucket_mb=0.5,
                paired_repeats=2,
                candidates=tuple(c for c in CANDIDATES if c.mode != "gradients"))
FULL = Setting(Workload(hidden=256, layers=8, vocab=2048, seq=64, global_batch=8), steps=20, warmup=3,
               layouts=("dp2", "dp4", "pp2xdp2"), overlap_off_modes=REDUCING_MODES, zero_stages=(1, 2),
               search_workload=Workload(hidden=256, layers=0, vocab=2048, seq=64, global_batch=8),
               ladder=(8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 96), cap_mb=400.0, search_steps=2, candidates=CANDIDATES,
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


HEADLINE_PAIR = ("none", "optimizer gather-overlap")
"""The name suffixes of the two jobs whose step ratio is ``zero1_step_over_ddp``."""
REPEAT = " (repeat {})"


def run_name(name: str, run: int) -> str:
    """The name of run ``run`` (from 1) of the job ``name``: the first keeps it, later ones add :data:`REPEAT`."""
    return name + REPEAT.format(run) if run > 1 else name


def paired_repeat_jobs(setting: Setting, jobs: list[Job]) -> list[Job]:
    """Runs 2 … ``paired_repeats`` of each layout's headline pair among ``jobs``, each pair back to back."""
    pairs = [[job for suffix in HEADLINE_PAIR for job in jobs if job.kind == "merak3d" and job.name.endswith(suffix)
              and job.layout == degrees] for _, degrees in LAYOUTS.values()]
    return [replace(job, name=run_name(job.name, run)) for run in range(2, setting.paired_repeats + 1)
            for pair in pairs if len(pair) == 2 for job in pair]


def paired_ratios(steps_ms: dict[str, float], layouts: tuple[str, ...], repeats: int) -> dict[str, list[float]]:
    """Per layout, each run's ZeRO-1 step over plain dp's in the same pair (``steps_ms`` by job name)."""
    ratios: dict[str, list[float]] = {}
    for layout in layouts:
        for run in range(1, repeats + 1):
            none, zero1 = (steps_ms.get(run_name(f"merak3d {layout} {suffix}", run)) for suffix in HEADLINE_PAIR)
            if none and zero1:
                ratios.setdefault(layout, []).append(zero1 / none)
    return ratios


OVERLAP_LEG = "dp2-long"
OVERLAP_MODES = ("none", "optimizer")


def overlap_jobs(setting: Setting) -> list[Job]:
    """The exposed-communication measurement at dp=2 on ``overlap_seq``-token sequences: overlap on and off, each
    mode's two jobs back to back, ``paired_repeats`` times (runs after the first named with :data:`REPEAT`)."""
    workload = asdict(replace(setting.workload, seq=setting.overlap_seq))
    return [Job(run_name(f"merak3d {OVERLAP_LAYOUT} {mode}{'' if overlap else ' no-overlap'}", run), "merak3d",
                workload, setting.steps, mode=mode,
                layout=LAYOUTS["dp2"][1], overlap=overlap, bucket_mb=setting.bucket_mb)
            for run in range(1, setting.paired_repeats + 1) for mode in OVERLAP_MODES for overlap in (True, False)
            if setting.overlap_leg or not setting.legs_only]


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
        cluster = (EmulatedCluster(world_size, LinkSpec(rate_mbit=RATE_MBIT)) if emulated
                   else LoopbackCluster(world_size))
        error: Optional[Exception] = None
        started = time.monotonic()
        try:
            with cluster:
                cluster.run(argv, timeout_s=CLUSTER_TIMEOUT_S, extra_env=extra_env, cwd=REPO_ROOT)
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


def summary(rows: list[dict[str, Any]], largest: list[dict[str, Any]], setting: Setting,
            paired: Optional[dict[str, list[float]]] = None) -> dict[str, Any]:
    """The issue's top-level figures, and per layout the values and goals behind them (``zero1_step_over_ddp`` the
    median of ``paired``'s ratios where it has the layout's)."""
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
            "zero1_step_over_ddp": (statistics.median(paired[layout]) if paired and paired.get(layout)
                                    else gathered.get("step_over_merak3d_none") if gathered else None),
            "zero1_step_over_ddp_pairs": paired.get(layout) if paired else None,
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


def overlap_summary(rows: list[dict[str, Any]], setting: Setting,
                    repeats: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """``exposed_grad_comm_fraction`` from the long-sequence measurement (worst mode; per mode the median over its
    runs, the first from ``rows``, later ones from ``repeats``), and the short-sequence layouts' worst as
    ``exposed_grad_comm_fraction_short_sequences``: there a rank's backward is shorter than reducing its gradients
    at 1 Gbit/s, so at least their difference stays exposed whatever the schedule."""
    runs = {row["mode"]: [row["exposed_grad_comm_fraction"]] for row in rows
            if row["layout"] == OVERLAP_LAYOUT and row["error"] is None and row["overlap"]
            and row.get("exposed_grad_comm_fraction") is not None}
    exposed = {row["name"]: row.get("exposed_ms") for row in repeats if row["error"] is None}
    for mode, values in runs.items():
        for run in range(2, setting.paired_repeats + 1):
            on, off = (exposed.get(run_name(f"merak3d {OVERLAP_LAYOUT} {mode}{tail}", run))
                       for tail in ("", " no-overlap"))
            if on is not None and off:
                values.append(on / off)
    fractions = {mode: statistics.median(values) for mode, values in runs.items()}
    short = [f for layout in setting.layouts for f in (row.get("exposed_grad_comm_fraction") for row in rows
             if row["layout"] == layout and row["error"] is None and row["overlap"]) if f is not None]
    return {
        "exposed_grad_comm_fraction": max(fractions.values()) if fractions else None,
        "exposed_grad_comm_fraction_by_mode": fractions,
        "exposed_grad_comm_fraction_runs": runs,
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
    repeats: set[int] = set()
    for world_size in (2, 4):
        modes = mode_jobs(setting, world_size)
        for job in [*modes, *paired_repeat_jobs(setting, modes)]:
            layout = next((name for name, (_, degrees) in LAYOUTS.items()
                           if job.kind == "merak3d" and degrees == job.layout), f"dp{world_size}")
            if job not in modes:
                repeats.add(len(jobs))
            jobs.append((len(jobs), job, layout, world_size))
    overlaps = overlap_jobs(setting)
    for position, job in enumerate(overlaps):
        if position >= len(overlaps) // setting.paired_repeats:  # runs after the first
            repeats.add(len(jobs))
        jobs.append((len(jobs), job, OVERLAP_LAYOUT, 2))
    timed = len(jobs)
    memory_of: dict[int, int] = {}
    for index, job, layout, size in list(jobs):
        if index not in repeats:
            memory_of[index] = len(jobs)
            jobs.append((len(jobs), replace(job, steps=MEMORY_STEPS), layout, size))
    searches = search_jobs(setting)
    search_offset = len(jobs)
    jobs += [(search_offset + i, job, c.layout, 4)
             for i, (job, c) in enumerate(zip(searches, setting.candidates))]

    outcomes: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="merak-sharding-") as work:
        for world_size in (2, 4):
            for live_heap in (False, True):  # memory runs and the search on the heap that returns freed tensors
                runnable = []
                for index, job, _, _ in (entry for entry in jobs if entry[3] == world_size
                                         and (entry[0] >= timed) == live_heap):
                    if (refusal := refused_before_launch(job)) is not None:
                        outcomes[index] = refusal
                        print(f"  {job.name}: refused before launch: {refusal}", flush=True)
                    else:
                        runnable.append((index, job))
                if runnable:
                    print(f"{world_size} ranks: {len(runnable)} {'memory' if live_heap else 'timed'} jobs", flush=True)
                    env = {**RANK_ENV, **LIVE_HEAP_ENV} if live_heap else RANK_ENV
                    outcomes.update(run_cluster(world_size, runnable, emulated, Path(work), env))

    overlap_per_sample = measure_activations(replace(setting.workload, seq=setting.overlap_seq))
    rows = [job_row(job, layout, size, outcomes.get(index, "not run"), outcomes.get(memory_of[index], "not run"),
                    setting.warmup, overlap_per_sample if layout == OVERLAP_LAYOUT else per_sample)
            for index, job, layout, size in jobs if index < timed and index not in repeats]
    compare(rows)
    repeat_rows = [repeat_row(job, outcomes.get(index, "not run"), setting.warmup)
                   for index, job, _, _ in jobs if index in repeats]
    steps_ms = {row["name"]: row["step_ms"] for row in [*rows, *repeat_rows] if row["error"] is None}
    largest = search_rows(searches, outcomes, search_offset)
    top = summary(rows, largest, setting, paired_ratios(steps_ms, setting.layouts, setting.paired_repeats))
    top.update(overlap_summary(rows, setting, repeat_rows))
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
        args.out, [*rows, *largest], repeats=repeat_rows, label=label, benchmark="sharding", quick=args.quick,
        backend="gloo",
        network=network, threads_per_rank=1, rank_env=RANK_ENV, memory_rank_env=LIVE_HEAP_ENV,
        memory_steps=MEMORY_STEPS, workload=setting.workload.describe(),
        search_workload=ladder_description(setting), ladder_layers=list(setting.ladder),
        cap_mb=setting.cap_mb, steps=setting.steps, warmup_steps=setting.warmup, modes=list(MODES),
        activations_per_sample=per_sample, **{key: value for key, value in top.items()}, goals=GOALS,
        goals_met=met, memory_png=chart.name if setting.layouts else None, wall_s=wall_s,
        load_average={"start": load_at_start, "end": os.getloadavg()[0]},
        gpu_leg="not run: CPU/gloo ranks on an emulated network",
    )
    print(f"wrote {out} and {chart.name} in {wall_s:.0f} s")
    failed = [row for row in [*rows, *repeat_rows, *largest] if row["error"] and not row["refused"]]
    for row in failed:
        print(f"sharding: {row['name']} failed: {row['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
