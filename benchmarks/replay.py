"""Trace replay (dPRO) against measurement on the emulated cluster network: held-out replay and what-if errors.

Run from the repo root (needs root for the network namespaces)::

    python -m benchmarks.replay [--quick] [--out PATH]

Two gloo ranks on tbf-shaped links train a small Llama under merak3d; runs with ``MerakTraceProfiler`` record a
few steps. Goals (issue #49): ``replay_heldout_error_max`` (:data:`REPLAY_HELDOUT_GOAL`), the plain replay of a
trace against ANOTHER, untraced run of the same layout in fresh rank processes (the held-out cluster), worst over
dp2 and pp2 M=2; ``whatif_error_max`` (:data:`WHATIF_GOAL`), every measured what-if row, none left out, each
predicted from a trace of another run than the one measured: (a) dp2 at 500 and 200 Mbit/s from its 1 Gbit/s trace
(each transfer's bytes at the traced link's TCP payload rate scaled,
:func:`~lightning_merak.planning.replay.engine.link_payload_bytes_per_s`, compute anchored on the traced run's
untraced steps, :func:`~lightning_merak.planning.replay.engine.anchored`); (b) pp=2 and tp=2 re-derived from the
dp=2 trace (:mod:`lightning_merak.planning.replay.synthesize`): pp=2 with its blocks' backward at the ratio the
driver's in-process call probe measured (:func:`~lightning_merak.planning.replay.refine.with_probed_backward`), tp=2
with a traced tp=2 probe of the model cut to ``PROBE_LAYERS`` blocks
(:mod:`lightning_merak.planning.replay.calibration`) and without it; (c) other micro-batch counts from the pp=2 M=2
trace by each call model of :mod:`benchmarks._replay_microbatch`. Pipelines are priced at the split the driver
derives as autopipe will (:mod:`benchmarks._replay_partition`), and again (kind ``PARTITIONED``) at each measured
run's. Diagnostics beside the goals: "replay of its own steps" (the old, self-referential ``replay_error``) and
"run to run" (the traced run's untraced steps against the held-out run: the machine's share of the held-out error).
A step's time is the period between the ends of consecutive training batches, the slowest rank's, median over the
untraced steps after warm-up. Rows for 8–64 ranks are replays only, labelled simulated.

Runs are repeated (``Mode.repeats``), every cluster in reversed order every other repeat; a row's figures are the
medians over repeats, its error their ratio, beside every repeat's own, their spread and ``cpu_wait_share`` (each
rank's main thread's wait for a CPU, Linux schedstat). The ranks start with the glibc tunables merak3d's launcher
gives a user's ranks (:func:`rank_environment`) and the driver, whose probe prices calls, restarts itself with them;
``--default-heap`` runs both on glibc's defaults. ``--pin`` puts each rank (and the probe) on a core of its own
(docs/design/replay.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import report
from benchmarks._replay_microbatch import microbatch_rows, probe_curves, probe_sizes, recording_overhead_us
from benchmarks._replay_partition import expected_stage_blocks, stage_blocks
from benchmarks.goals import Goal, print_goals, worst_case, write_run
from benchmarks.merak3d import Workload, _quiet_lightning
from lightning_merak.callbacks.profiler import (
    MerakTraceProfiler,
    Trace,
    WhatIf,
    chrome_trace,
    replay_trace,
    write_chrome_trace,
)
from lightning_merak.distributed.host_memory import restart_with_heap_tunables, with_heap_tunables
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import OptimConfig
from lightning_merak.planning.measure.probe import ProbedCurves
from lightning_merak.planning.replay.calibration import Probe, ReplayPredictor, calibrate_from_traces
from lightning_merak.planning.replay.engine import anchored, link_payload_bytes_per_s, measured_step_time
from lightning_merak.planning.replay.refine import with_probed_backward
from lightning_merak.planning.replay.synthesize import (
    LayoutSpec,
    ModelShape,
    StepCosts,
    calibrate,
    predict_layout,
)
from lightning_merak.testing.cores import pin_rank_to_core
from lightning_merak.testing.netem import EmulatedCluster, LinkSpec, emulation_available

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULT_MARKER = "REPLAY_RESULT "
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
RANK_TIMEOUT_S = 400.0
WORKLOAD = Workload(hidden=128, layers=4, vocab=4096, seq=64, global_batch=8)
"""``global_batch`` is each data-parallel replica's batch (the samples a layout's replica trains per step)."""
BASE_RATE_MBIT = 1000.0
REPLAY_HELDOUT_GOAL = Goal(
    "replay_heldout_error_max", 0.05, "<=",
    "|replay of a traced run's steps / the median untraced step of another run of that layout (fresh rank processes) "
    "- 1|, medians over repeats; worst over dp2 and pp2 M=2 at 1 Gbit", issue=49)
WHATIF_GOAL = Goal(
    "whatif_error_max", 0.10, "<=",
    "|what-if prediction from a trace of one run / the measured median step of another run - 1|, medians over "
    "repeats; worst over every measured what-if row (link rates, layouts, micro-batch counts, every call model)",
    issue=49)
REPLAY_KIND, RUN_TO_RUN_KIND, SELF_REPLAY_KIND = "replay held-out", "run to run", "replay of its own steps"
BASE, HELDOUT = "1Gbit", "1Gbit held-out"
"""The clusters at the base rate: the traced runs and their measured counterparts, and the held-out runs."""
PROBE_LAYERS = 2
"""Blocks of the probe runs (the workload has 4)."""
PARTITIONED = "what-if (measured run's partition)"
SIMULATED = ((8, 1, 1, 1), (16, 2, 2, 4), (16, 4, 1, 8), (32, 2, 1, 4), (64, 1, 1, 1))
"""(dp, pp, tp, micro-batches) replayed beyond this machine."""


@dataclass(frozen=True)
class Job:
    """One training run inside a cluster: its layout, whether it is traced, its steps."""

    name: str
    dp: int
    pp: int
    tp: int
    micro_batches: int
    traced: bool
    steps: int
    warmup: int = 2
    trace_skip: int = 2
    trace_steps: int = 3
    layers: int = 0
    """Blocks of the model (0: the workload's); a probe runs fewer."""

    def layout(self) -> LayoutSpec:
        return LayoutSpec(self.dp, self.pp, self.tp, self.micro_batches, WORKLOAD.global_batch)

    def workload(self) -> Workload:
        return replace(WORKLOAD, layers=self.layers) if self.layers else WORKLOAD


@dataclass(frozen=True)
class Mode:
    """Steps per run, the micro-batch counts predicted from the M=2 trace, and how often everything is repeated."""

    steps: int
    micro_batch_counts: tuple[int, ...]
    repeats: int
    trace_steps: int = 3
    """Steps a traced run records (its replay, and its traced over untraced ratio, average over them)."""
    rates: tuple[float, ...] = (500.0, 200.0)


QUICK = Mode(steps=12, micro_batch_counts=(4,), repeats=2)
FULL = Mode(steps=20, micro_batch_counts=(4, 8), repeats=4, trace_steps=5)



def thread_schedstat() -> Optional[tuple[float, float]]:
    """The calling thread's CPU time and its wait for a CPU, in seconds (Linux schedstat); None without them."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            cpu, waiting = stat.read().split()[:2]
        return int(cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return None


class _Periods(pl.Callback):
    """perf_counter, the main thread's schedstat and the process's minor page faults (the heap's pages faulted back in,
    which differ by layout: docs/design/replay.md) at the end of every training batch; a step's are the differences."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.sched: list[Optional[tuple[float, float]]] = []
        self.faults: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ends.append(time.perf_counter())
        self.sched.append(thread_schedstat())
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def _run_job(job: Job, out_dir: str, rank: int, world: int) -> dict[str, Any]:
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    torch.manual_seed(0)
    model = build_causal_lm(job.workload().model_config(), WORKLOAD.vocab)
    model.config.use_cache = False
    module = CausalLMModule(model, OptimConfig(warmup_steps=1))
    periods = _Periods()
    profiler = (MerakTraceProfiler(dirpath=out_dir, filename=job.name, skip_steps=job.trace_skip,
                                   steps=job.trace_steps, untraced_steps=0) if job.traced else None)
    merak: dict[str, Any] = {"data_parallel": job.dp, "pipeline_parallel": job.pp, "tensor_parallel": job.tp}
    if job.pp > 1:
        merak["micro_batches"] = job.micro_batches
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=Merak3DStrategy(**merak, timeout_s=RANK_TIMEOUT_S),
        max_steps=job.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[periods], profiler=profiler,
    )
    replica = rank // (job.pp * job.tp)
    tokens = torch.randint(WORKLOAD.vocab, (job.steps, WORKLOAD.global_batch * job.dp, WORKLOAD.seq),
                           generator=torch.Generator().manual_seed(1))
    local = tokens[:, replica * WORKLOAD.global_batch:(replica + 1) * WORKLOAD.global_batch].reshape(-1, WORKLOAD.seq)
    trainer.fit(module, DataLoader(TensorDataset(local), batch_size=WORKLOAD.global_batch))
    partition = getattr(trainer.strategy, "partition", None)
    return {"job": job.name, "ends": periods.ends, "sched": periods.sched, "faults": periods.faults,
            "partition": list(partition.boundaries) if partition is not None else None,
            "trace": str(profiler.paths["trace"]) if profiler is not None and profiler.paths else None}


def rank_main(jobs: Sequence[Job], out_dir: str, pin: bool = False) -> None:
    launcher = {key: os.environ[key] for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    rank, world = int(launcher["RANK"]), int(launcher["WORLD_SIZE"])
    # one core per rank, as one device per rank: before any thread starts, so gloo's threads inherit it
    core = pin_rank_to_core(rank) if pin else None
    torch.set_num_threads(1)
    _quiet_lightning()
    results = []
    for job in jobs:
        # Lightning's teardown removes the launcher's variables; every job gets them again
        os.environ.update(launcher, LOCAL_RANK=str(rank))
        results.append({**_run_job(job, out_dir, rank, world), "core": core})
    print(RESULT_MARKER + json.dumps(results), flush=True)



def _parse(stdout: str) -> list[dict[str, Any]]:
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        raise ValueError(f"rank printed no result line; stdout tail:\n{stdout[-2000:]}")
    return json.loads(lines[-1][len(RESULT_MARKER):])


def run_cluster(rate_mbit: float, jobs: Sequence[Job], out_dir: str, pin: bool = False, default_heap: bool = False
                ) -> dict[str, dict[str, Any]]:
    """Run ``jobs`` in one 2-rank emulated cluster (with ``pin``, each rank on a core of its own; unless
    ``default_heap``, on the heap merak3d's launcher gives a user's ranks: :func:`rank_environment`); per job: its
    periods
    (:func:`summarize_run`), the stage boundaries its partitioner chose, the ranks' cores (None: unpinned) and the
    trace on rank 0."""
    argv = [sys.executable, "-m", "benchmarks.replay", "--rank", "--jobs", json.dumps([asdict(j) for j in jobs]),
            "--dir", out_dir, *(("--pin",) if pin else ())]
    with EmulatedCluster(2, LinkSpec(rate_mbit=rate_mbit)) as cluster:
        env = rank_environment(default_heap)
        results = [_parse(r.stdout) for r in cluster.run(argv, timeout_s=RANK_TIMEOUT_S, extra_env=env,
                                                           cwd=REPO_ROOT)]
    out = {}
    for index, job in enumerate(jobs):
        per_rank = [rank[index] for rank in results]
        ends = [r["ends"] for r in per_rank]
        periods = [max(e[i + 1] - e[i] for e in ends) for i in range(len(ends[0]) - 1)]
        run = summarize_run(periods, _step_deltas([r["sched"] for r in per_rank], 1), job)
        faults = [max(r["faults"][i + 1] - r["faults"][i] for r in per_rank) for i in range(len(periods))]
        out[job.name] = {**run, "minor_faults_per_step": statistics.median(faults[i] for i in run["measured_steps"]),
                         "partition": per_rank[0]["partition"], "cores": [r["core"] for r in per_rank],
                         "trace": per_rank[0]["trace"]}
    return out


def rank_environment(default_heap: bool = False) -> dict[str, str]:
    """What a rank's environment adds to the driver's: one thread, and (unless ``default_heap``) the glibc tunables
    merak3d's launcher exports to the ranks it starts, so the benchmark times the heap a user's ranks get."""
    return dict(RANK_ENV) if default_heap else {**RANK_ENV, "GLIBC_TUNABLES": with_heap_tunables(os.environ)}


def _step_deltas(sched: Sequence[Sequence[Optional[tuple[float, float]]]], field_index: int) -> Optional[list[float]]:
    """Per step, the largest increase over ranks of one schedstat field (0: CPU time, 1: waiting for a CPU)."""
    if any(s is None for rank in sched for s in rank):
        return None
    return [max(rank[i + 1][field_index] - rank[i][field_index] for rank in sched)  # type: ignore[index]
            for i in range(len(sched[0]) - 1)]


def summarize_run(periods: Sequence[float], cpu_waits: Optional[Sequence[float]], job: Job) -> dict[str, Any]:
    """A run's statistics from its step ``periods`` (``periods[i]`` is batch i+1's; the last traced batch also
    gathers and writes the trace): ``period_s``, the median over the untraced steps after warm-up, and
    ``traced_period_s`` over the traced ones; with ``cpu_waits`` (each step's longest wait for a CPU over the
    ranks' main threads), ``cpu_wait_share`` (that wait over the period) and ``period_less_cpu_wait_s``, medians
    over the measured steps."""
    first = job.trace_skip - 1
    traced = set(range(first, first + job.trace_steps)) if job.traced else set()
    measured = [i for i in range(len(periods)) if i >= job.warmup - 1 and i not in traced]
    if not measured:
        raise ValueError(f"job {job.name} leaves no untraced step after warm-up; give it more steps")
    in_window = [periods[i] for i in range(first, first + job.trace_steps - 1)] if job.traced else []
    summary: dict[str, Any] = {"period_s": statistics.median(periods[i] for i in measured),
                               "periods_s": list(periods), "measured_steps": measured,
                               "traced_period_s": statistics.median(in_window) if in_window else None}
    if cpu_waits is not None:
        summary["cpu_waits_s"] = list(cpu_waits)
        summary["cpu_wait_share"] = statistics.median(cpu_waits[i] / periods[i] for i in measured)
        # A diagnostic only (no error uses it): roughly what the steps take where nothing else wants the cores.
        summary["period_less_cpu_wait_s"] = statistics.median(periods[i] - cpu_waits[i] for i in measured)
    return summary


def _shape(workload: Workload = WORKLOAD) -> ModelShape:
    model = build_causal_lm(workload.model_config(), workload.vocab)
    blocks = model.model.layers
    block_params = sum(p.numel() for p in blocks[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    return ModelShape(len(blocks), block_params, total - len(blocks) * block_params, WORKLOAD.hidden, WORKLOAD.seq)


def _row(kind: str, what: str, predicted: float, measured: Optional[float], **extra: Any) -> dict[str, Any]:
    """One repeat's row: seconds predicted and measured (None: nothing measured)."""
    return {"kind": kind, "what": what, "predicted_s": predicted, "measured_s": measured, **extra}


def merge_rows(repeats: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows over repeats (each a list of :func:`_row`'s, in the same order): predicted and measured ms are the
    medians of the repeats' own, ``error`` their ratio less one; ``error_paired`` the median of each repeat's own
    error (its prediction from traces taken next to the run it predicts); every repeat's figures, the measured spread
    ((max - min) / median) and ``error_first_repeat`` (one run alone: what a single run reports) stay beside."""
    if not repeats or any(len(rows) != len(repeats[0]) for rows in repeats):
        raise ValueError("every repeat needs the same rows")
    merged = []
    for rows in zip(*repeats):
        if len({(r["kind"], r["what"]) for r in rows}) != 1:
            raise ValueError(f"repeats disagree on a row: {[(r['kind'], r['what']) for r in rows]}")
        first = rows[0]
        predicted = [r["predicted_s"] for r in rows]
        row = {"kind": first["kind"], "what": first["what"],
               "predicted_ms": round(1e3 * statistics.median(predicted), 2), "measured_ms": None}
        for key in first:
            if key not in ("kind", "what", "predicted_s", "measured_s"):
                values = [r.get(key) for r in rows]
                row[key] = (statistics.median(values) if all(isinstance(v, float) for v in values)
                            else values[0])
        if first["measured_s"] is not None:
            measured = [r["measured_s"] for r in rows]
            median = statistics.median(measured)
            row["measured_ms"] = round(1e3 * median, 2)
            row["error"] = statistics.median(predicted) / median - 1.0
            row["error_first_repeat"] = predicted[0] / measured[0] - 1.0
            row["errors_by_repeat"] = [p / m - 1.0 for p, m in zip(predicted, measured)]
            row["error_paired"] = statistics.median(row["errors_by_repeat"])
            row["measured_ms_by_repeat"] = [round(1e3 * m, 2) for m in measured]
            row["predicted_ms_by_repeat"] = [round(1e3 * p, 2) for p in predicted]
            row["measured_spread"] = (max(measured) - min(measured)) / median
        merged.append(row)
    return merged


def merge_runs(repeats: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every run over repeats for the JSON: ``period_s`` the median of the repeats' (``period_s_first_repeat``:
    one run alone), their spread, and each repeat's statistics (the traces' temporary paths left out)."""
    merged = {}
    for name in repeats[0]:
        runs = [{k: v for k, v in repeat[name].items() if k != "trace"} for repeat in repeats]
        periods = [run["period_s"] for run in runs]
        median = statistics.median(periods)
        merged[name] = {"period_s": median, "period_s_first_repeat": periods[0],
                        "period_spread": (max(periods) - min(periods)) / median, "repeats": runs}
    return merged


def _named_runs(measured: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One repeat's runs by name: the base cluster's jobs by their own, the others' as ``<job>@<cluster>``."""
    return dict(measured[BASE]) | {f"{job}@{cluster}": run for cluster, runs in measured.items() if cluster != BASE
                                   for job, run in runs.items()}


def one_step_trace(trace: Trace, step: int) -> Trace:
    """``trace`` cut to one step (the committed Perfetto example)."""
    from lightning_merak.planning.replay.trace import RankTrace

    ranks = [RankTrace(r.rank, [s for s in r.spans if s.step == step], [c for c in r.comms if c.step == step])
             for r in trace.ranks]
    return Trace(ranks, trace.offsets, {**trace.meta, "step": step})


def jobs_by_name(mode: Mode) -> dict[str, Job]:
    """Every 1 Gbit job: traced dp2, the tp2 probe and pp2 M=2, and the runs their what-ifs predict."""
    steps, traced = mode.steps, mode.trace_steps
    jobs = [Job("dp2", 2, 1, 1, 1, True, steps, trace_steps=traced),
            Job("tp2_probe", 1, 1, 2, 1, True, steps, trace_steps=traced, layers=PROBE_LAYERS),
            Job("tp2", 1, 1, 2, 1, False, steps), Job("pp2_m2", 1, 2, 1, 2, True, steps, trace_steps=traced)]
    jobs += [Job(f"pp2_m{m}", 1, 2, 1, m, False, steps) for m in mode.micro_batch_counts]
    return {job.name: job for job in jobs}


def clusters_of(mode: Mode) -> list[tuple[str, float, list[Job]]]:
    """Every cluster of a repeat (name, link rate, jobs): the base cluster's traced and measured runs, the held-out
    cluster's untraced runs of the traced layouts (fresh processes: what the replay goal predicts), and dp2 at each
    other link rate."""
    held_out = [Job("dp2", 2, 1, 1, 1, False, mode.steps), Job("pp2_m2", 1, 2, 1, 2, False, mode.steps)]
    return ([(BASE, BASE_RATE_MBIT, list(jobs_by_name(mode).values())), (HELDOUT, BASE_RATE_MBIT, held_out)]
            + [(f"{rate:g}Mbit", rate, [Job("dp2", 2, 1, 1, 1, False, mode.steps)]) for rate in mode.rates])


def measure_repeat(mode: Mode, repeat: int, out_dir: str, started: float, pin: bool = False,
                   default_heap: bool = False) -> dict[str, dict[str, dict[str, Any]]]:
    """One repeat of every cluster (:func:`clusters_of`), by cluster name; each measured run next to its traced
    counterpart, and the order of the jobs and of the clusters reversed every other repeat (a drifting machine then
    favours no run)."""
    clusters = clusters_of(mode)
    measured = {}
    for name, rate, jobs in clusters[::-1] if repeat % 2 else clusters:
        load = os.getloadavg()[0]
        runs = run_cluster(rate, jobs[::-1] if repeat % 2 else jobs, out_dir, pin, default_heap)
        for run in runs.values():
            run["load_1m_before"] = load
        measured[name] = runs
        periods = ", ".join(f"{job} {1e3 * run['period_s']:.0f} ms" for job, run in runs.items())
        print(f"  repeat {repeat + 1}/{mode.repeats}, {name}: {periods} (load {load:.1f}; "
              f"{time.perf_counter() - started:.0f} s)", flush=True)
    return measured


def expected_splits(mode: Mode) -> dict[str, tuple[int, ...]]:
    """Blocks per stage the partitioner will give every pipelined 1 Gbit job, derived before it runs
    (:func:`~benchmarks._replay_partition.expected_stage_blocks`)."""
    return {name: expected_stage_blocks(job.workload().model_config(), WORKLOAD.vocab, WORKLOAD.seq,
                                        WORKLOAD.global_batch // job.micro_batches, job.pp, job.micro_batches)
            for name, job in jobs_by_name(mode).items() if job.pp > 1}


def replay_rows(measured: dict[str, dict[str, dict[str, Any]]], traces: dict[str, Trace]) -> list[dict[str, Any]]:
    """One repeat's replay rows for the traced dp2 and pp2 M=2 runs: the plain replay of each trace against the
    held-out run of its layout (the goal's), the traced run's untraced steps against that run (run to run), and the
    replay against the traced steps themselves (what ``replay_error`` was)."""
    rows = []
    for name in ("dp2", "pp2_m2"):
        replayed, traced, held_out = replay_trace(traces[name]).step_time, measured[BASE][name], measured[HELDOUT][name]
        rows += [_row(REPLAY_KIND, f"{name} at 1 Gbit, another run", replayed, held_out["period_s"],
                      **_contention(held_out)),
                 _row(RUN_TO_RUN_KIND, f"{name} at 1 Gbit: the traced run's untraced steps, another run",
                      traced["period_s"], held_out["period_s"], **_contention(held_out)),
                 _row(SELF_REPLAY_KIND, f"{name} at 1 Gbit (traced steps)", replayed, measured_step_time(traces[name]),
                      overhead=traced["traced_period_s"] / traced["period_s"] - 1.0)]
    return rows


def predict_repeat(measured: dict[str, dict[str, dict[str, Any]]], traces: dict[str, Trace], mode: Mode,
                   shape: ModelShape, curves: ProbedCurves, splits: dict[str, tuple[int, ...]]
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One repeat's rows (:func:`_row`) from its own traces, runs, probed call ``curves`` and the ``splits`` the
    partitioner was expected to give the pipelined runs (:func:`expected_splits`); and the costs calibrated on
    them."""
    jobs = jobs_by_name(mode)
    at_base = measured[BASE]
    rows = replay_rows(measured, traces)
    dp2 = traces["dp2"]
    # The traced steps carry the profiler's overhead and a spell of the machine, measured runs do not: replays of
    # the trace scale its compute to the run's untraced steps (anchored), layouts re-derived from it their step.
    correction = at_base["dp2"]["period_s"] / measured_step_time(dp2)
    for rate in mode.rates:
        what_if = anchored(dp2, at_base["dp2"]["period_s"], WhatIf(
            bandwidth_ratio=rate / BASE_RATE_MBIT, link_bytes_per_s=link_payload_bytes_per_s(BASE_RATE_MBIT * 1e6)))
        predicted = replay_trace(dp2, what_if).step_time
        run = measured[f"{rate:g}Mbit"]["dp2"]
        rows.append(_row("what-if link", f"dp2 at {rate:g} Mbit from 1 Gbit", predicted, run["period_s"],
                         **_contention(run)))
    costs_dp = calibrate(dp2, shape, jobs["dp2"].layout())
    probe_job = jobs["tp2_probe"]
    probe = Probe(traces["tp2_probe"], _shape(probe_job.workload()), probe_job.layout(),
                  at_base["tp2_probe"]["period_s"] / measured_step_time(traces["tp2_probe"]))
    predictor = ReplayPredictor(calibrate_from_traces(dp2, shape, jobs["dp2"].layout(), [probe], correction))
    pp_layout = jobs["pp2_m2"].layout()
    base_costs, base_correction = predictor.calibration.costs_for(pp_layout)
    # the dp2 trace's block backwards overlap its gradient reduction; a pipeline's do not: the probe's ratio
    base_costs = with_probed_backward(base_costs, curves.block, pp_layout.samples / pp_layout.micro_batches)
    rows.append(_row("what-if layout", "pp2_m2 from dp2", predict_layout(
        replace(base_costs, stage_blocks=splits["pp2_m2"]), shape, jobs["pp2_m2"].layout()).step_time * base_correction,
        at_base["pp2_m2"]["period_s"], **_contention(at_base["pp2_m2"])))
    rows.append(_row("what-if layout", f"tp2 from dp2 and a {PROBE_LAYERS}-block probe",
                     predictor.step_time(jobs["tp2"].layout()), at_base["tp2"]["period_s"],
                     **_contention(at_base["tp2"])))
    unprobed = predict_layout(costs_dp, shape, jobs["tp2"].layout()).step_time * correction
    rows.append(_row("what-if layout (no probe)", "tp2 from dp2 alone", unprobed, at_base["tp2"]["period_s"],
                     **_contention(at_base["tp2"])))
    # autopipe splits the blocks by timings taken at start-up, which a busy machine moves: the pipeline what-ifs
    # again with the split each measured run got (the replay's error apart from the partitioner's choice)
    def split_of(costs: StepCosts, name: str) -> StepCosts:
        return replace(costs, stage_blocks=stage_blocks(at_base[name]["partition"], shape.blocks))

    rows.append(_row(PARTITIONED, "pp2_m2 from dp2", predict_layout(split_of(base_costs, "pp2_m2"), shape,
                                                                    jobs["pp2_m2"].layout()).step_time
                     * base_correction, at_base["pp2_m2"]["period_s"], **_contention(at_base["pp2_m2"])))
    micro_rows, costs_pp = microbatch_rows(traces, at_base, {name: job.layout() for name, job in jobs.items()},
                                           mode.micro_batch_counts, shape, curves, _row, PARTITIONED, split_of,
                                           lambda costs, name: replace(costs, stage_blocks=splits[name]))
    rows += micro_rows
    for what, what_if in (("overlap off", WhatIf(overlap=False)), ("full recompute", WhatIf(recompute_fraction=1.0))):
        rows.append(_row("what-if (not measured)", f"dp2, {what}",
                         replay_trace(dp2, anchored(dp2, at_base["dp2"]["period_s"], what_if)).step_time, None))
    for dp, pp, tp, m in SIMULATED:
        layout = LayoutSpec(dp, pp, tp, m, WORKLOAD.global_batch)
        rows.append(_row("simulated", f"{layout.ranks} ranks: dp{dp} pp{pp} tp{tp} M{m}",
                         predict_layout(costs_dp, shape, layout).step_time * correction, None, label="simulated"))
    costs = {"dp2": asdict(costs_dp), **costs_pp, "predictor": predictor.calibration.describe()}
    return rows, costs


def _contention(run: dict[str, Any]) -> dict[str, float]:
    """The measured run's ``cpu_wait_share`` for its row, where the kernel reported it."""
    return {"measured_cpu_wait_share": run["cpu_wait_share"]} if "cpu_wait_share" in run else {}


def _config(row: dict[str, Any]) -> str:
    return f"{row['kind']}: {row['what']}"


def replay_goal(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """:data:`REPLAY_HELDOUT_GOAL`'s record: the worst |error| of the merged held-out replay rows."""
    return worst_case(REPLAY_HELDOUT_GOAL, {_config(r): abs(r["error"]) for r in rows if r["kind"] == REPLAY_KIND})


def whatif_goal(rows: Sequence[dict[str, Any]], key: str = "error") -> dict[str, Any]:
    """:data:`WHATIF_GOAL`'s record: the worst |``key``| of every what-if row with a measurement, none left out (with
    ``key`` another error statistic, for a diagnostic beside the goal)."""
    return worst_case(WHATIF_GOAL, {_config(r): abs(r[key]) for r in rows
                                    if r["kind"].startswith("what-if") and r["measured_ms"] is not None})


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, repeats and micro-batch counts")
    parser.add_argument("--out", type=Path, help=report.out_help("replay"))
    parser.add_argument("--traces", type=Path, help="keep the raw traces in this directory")
    parser.add_argument("--pin", action="store_true",
                        help="pin each rank, and the probe, to a core of its own (default: the scheduler places "
                             "them; pinned ranks cannot leave a core another process takes)")
    parser.add_argument("--default-heap", action="store_true",
                        help="run the ranks and the driver on glibc's default heap (default: the tunables merak3d's "
                             "launcher gives a user's ranks, lightning_merak.distributed.host_memory)")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        rank_main([Job(**j) for j in json.loads(args.jobs)], args.dir, pin=args.pin)
        return 0
    if (args.pin or args.default_heap) and not (args.quick or args.out):
        parser.error("--pin / --default-heap: not a user's setting, so not a full run; add --out PATH (or --quick)")
    if not emulation_available():
        print("the emulated cluster needs root, ip and tc (see lightning_merak/testing/netem.py)")
        return 2
    if not args.default_heap:
        restart_with_heap_tunables()  # the driver's in-process probe prices calls on the ranks' heap
    example = (args.out or report.default_out("replay", args.quick)).with_name(
        f"replay{'.quick' * args.quick}_pp2_step.perfetto.json")
    mode = QUICK if args.quick else FULL
    started = time.perf_counter()
    shape = _shape()
    overhead = recording_overhead_us()
    print(f"recording overhead: {overhead['overhead_per_op_us']:.1f} us per op "
          f"(plain call {overhead['plain_call_us']:.1f} us)", flush=True)
    print(f"replay benchmark: {WORKLOAD.describe()} per replica, 2 gloo ranks, emulated links "
          f"({'quick' if args.quick else 'full'}: {mode.repeats} repeats of {mode.steps} steps per run)", flush=True)
    repeat_rows, repeat_runs, repeat_costs, pp_traces = [], [], [], []
    for repeat in range(mode.repeats):
        with tempfile.TemporaryDirectory(prefix="merak-replay-") as out_dir:
            os.chmod(out_dir, 0o777)
            curves = probe_curves(WORKLOAD.model_config(), WORKLOAD.vocab, WORKLOAD.seq,
                                  probe_sizes(WORKLOAD.global_batch, mode.micro_batch_counts), pin=args.pin)
            splits = expected_splits(mode)
            measured = measure_repeat(mode, repeat, out_dir, started, pin=args.pin, default_heap=args.default_heap)
            traces = {name: Trace.load(measured[BASE][name]["trace"])
                      for name in ("dp2", "pp2_m2", "tp2_probe")}
        if args.traces:
            for name, trace in traces.items():
                trace.save(args.traces / f"r{repeat}_{name}.json")
        rows, costs = predict_repeat(measured, traces, mode, shape, curves, splits)
        costs["call_curves"] = {name: curve.describe() for name, curve in curves._asdict().items()}
        costs["expected_stage_blocks"] = splits
        repeat_rows.append(rows)
        repeat_runs.append(_named_runs(measured))
        repeat_costs.append(costs)
        pp_traces.append(traces["pp2_m2"])
    rows = merge_rows(repeat_rows)
    write_chrome_trace(chrome_trace(one_step_trace(pp_traces[0], pp_traces[0].steps()[-1])), example)
    goals = [replay_goal(rows), whatif_goal(rows)]
    print(f"\nReplay and what-if predictions vs measured step periods (2 ranks, emulated links; 8-64 ranks simulated; "
          f"medians over {mode.repeats} repeats)")
    report.print_table([{**r, "error": f"{100 * r['error']:+.1f}%" if "error" in r else "-",
                         "by repeat": " ".join(f"{100 * e:+.0f}%" for e in r.get("errors_by_repeat", [])),
                         "spread": f"{100 * r['measured_spread']:.0f}%" if "measured_spread" in r else "-"}
                        for r in rows], ["kind", "what", "predicted_ms", "measured_ms", "error", "by repeat", "spread"])
    print_goals(goals)
    paired, first = whatif_goal(rows, "error_paired"), whatif_goal(rows, "error_first_repeat")
    print(f"what-if error max paired by repeat {100 * paired['value']:.1f}%, first repeat alone "
          f"{100 * first['value']:.1f}% (diagnostics, not goals)")
    by_kind = {kind: max(abs(r["error"]) for r in rows if r["kind"] == kind and "error" in r)
               for kind in dict.fromkeys(r["kind"] for r in rows if r["kind"].startswith("what-if") and "error" in r)}
    out = write_run("replay", rows, "emulated", goals, args.quick, out=args.out, whatif_error_max_by_kind=by_kind,
                    whatif_error_max_paired=paired["value"], whatif_error_max_first_repeat=first["value"],
                    statistic=f"medians over {mode.repeats} repeats (each run's period: median of its untraced "
                              "steps after warm-up); error_paired: the median of each repeat's own error; "
                              "error_first_repeat: the first repeat alone, as a single run reported before repeats",
                    repeats=mode.repeats, steps_per_run=mode.steps, probe_layers=PROBE_LAYERS, ranks_pinned=args.pin,
                    rank_heap="glibc defaults" if args.default_heap else rank_environment()["GLIBC_TUNABLES"],
                    workload=WORKLOAD.describe(), mode="quick" if args.quick else "full",
                    perfetto_example=example.name, recording_overhead=overhead, runs=merge_runs(repeat_runs),
                    calibrated_costs=repeat_costs[0],
                    note="emulated: tbf-shaped veth links, 2 gloo ranks, one thread each; simulated rows are "
                         "replays only; timings on a shared machine are noisy (cpu_wait_share per run: the main "
                         "threads' wait for a CPU over the period)",
                    gpu_leg="not run: CPU/gloo on an emulated network", wall_s=time.perf_counter() - started)
    print(f"wrote {out} and {example.name} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
