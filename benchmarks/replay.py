"""Trace replay (dPRO) against measurement on the emulated cluster network: replay error and what-if errors.

Run from the repo root (needs root for the network namespaces)::

    python -m benchmarks.replay [--quick] [--out PATH]

Two gloo ranks on tbf-shaped links train a small Llama under merak3d. Runs with
``MerakTraceProfiler`` record a few steps; the replay of a trace predicts its own steps
(``replay_error``, target ≤ 5%), and what-ifs on it predict other runs that are then measured
(target ≤ 10% each): (a) the link at 500 and 200 Mbit/s from a trace at 1 Gbit/s; (b) pp=2 and
tp=2 from a trace of dp=2 (layout re-derived: :mod:`lightning_merak.profiler.synthesize`), tp=2 with a
probe: a traced tp=2 run of the model cut to ``PROBE_LAYERS`` blocks, whose costs (vocabulary-parallel
head, sub-batch machinery, the blocks' collectives) replace the dp trace's
(:mod:`lightning_merak.profiler.calibration`; the row "no probe" predicts tp=2 from the dp trace alone);
(c) other micro-batch counts from a trace of pp=2 with 2 micro-batches. A step's time is the
period between the ends of consecutive training batches (loop and data loading included), the
slowest rank's, median over the steps after warm-up. Rows for 8–64 ranks are replays of layouts
calibrated on the same trace: labelled simulated, nothing measured. Timings on a shared machine
are noisy; the profiler's overhead is the traced steps' period against the same run's untraced steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import report
from benchmarks.merak3d import Workload, _quiet_lightning
from lightning_merak.config import TrainerConfig
from lightning_merak.models import CausalLMModule, build_causal_lm
from lightning_merak.profiler import MerakTraceProfiler, Trace, WhatIf, chrome_trace, replay_trace, write_chrome_trace
from lightning_merak.profiler.calibration import Probe, ReplayPredictor, calibrate_from_traces
from lightning_merak.profiler.replay import measured_step_time
from lightning_merak.profiler.synthesize import LayoutSpec, ModelShape, calibrate, predict_layout
from lightning_merak.testing.netem import EmulatedCluster, LinkSpec, emulation_available

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULT_MARKER = "REPLAY_RESULT "
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
RANK_TIMEOUT_S = 400.0
WORKLOAD = Workload(hidden=128, layers=4, vocab=4096, seq=64, global_batch=8)
"""``global_batch`` is each data-parallel replica's batch (the samples a layout's replica trains per step)."""
BASE_RATE_MBIT = 1000.0
REPLAY_TARGET, WHATIF_TARGET = 0.05, 0.10
PROBE_LAYERS = 2
"""Blocks of the probe runs (the workload has 4)."""
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
    steps: int
    micro_batch_counts: tuple[int, ...]
    rates: tuple[float, ...] = (500.0, 200.0)
    extra: dict[str, Any] = field(default_factory=dict)


QUICK = Mode(steps=8, micro_batch_counts=(4,))
FULL = Mode(steps=12, micro_batch_counts=(1, 4))


# Inside a rank -------------------------------------------------------------------------------


class _Periods(pl.Callback):
    """perf_counter at the end of every training batch (a step's period is the difference)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ends.append(time.perf_counter())


def _run_job(job: Job, out_dir: str, rank: int, world: int) -> dict[str, Any]:
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    torch.manual_seed(0)
    model = build_causal_lm(job.workload().model_config(), WORKLOAD.vocab)
    model.config.use_cache = False
    module = CausalLMModule(model, TrainerConfig(max_steps=job.steps, warmup_steps=1))
    periods = _Periods()
    profiler = (MerakTraceProfiler(dirpath=out_dir, filename=job.name, skip_steps=job.trace_skip,
                                   steps=job.trace_steps) if job.traced else None)
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
    return {"job": job.name, "ends": periods.ends,
            "trace": str(profiler.paths["trace"]) if profiler is not None and profiler.paths else None}


def rank_main(jobs: Sequence[Job], out_dir: str) -> None:
    torch.set_num_threads(1)
    _quiet_lightning()
    launcher = {key: os.environ[key] for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    rank, world = int(launcher["RANK"]), int(launcher["WORLD_SIZE"])
    results = []
    for job in jobs:
        # Lightning's teardown removes the launcher's variables; every job gets them again
        os.environ.update(launcher, LOCAL_RANK=str(rank))
        results.append(_run_job(job, out_dir, rank, world))
    print(RESULT_MARKER + json.dumps(results), flush=True)


# Driver -------------------------------------------------------------------------------------


def _parse(stdout: str) -> list[dict[str, Any]]:
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        raise ValueError(f"rank printed no result line; stdout tail:\n{stdout[-2000:]}")
    return json.loads(lines[-1][len(RESULT_MARKER):])


def run_cluster(rate_mbit: float, jobs: Sequence[Job], out_dir: str) -> dict[str, dict[str, Any]]:
    """Run ``jobs`` in one 2-rank emulated cluster; per job: the measured period, and the trace on rank 0."""
    argv = [sys.executable, "-m", "benchmarks.replay", "--rank", "--jobs", json.dumps([asdict(j) for j in jobs]),
            "--dir", out_dir]
    with EmulatedCluster(2, LinkSpec(rate_mbit=rate_mbit)) as cluster:
        results = [_parse(r.stdout) for r in cluster.run(argv, timeout_s=RANK_TIMEOUT_S, extra_env=RANK_ENV,
                                                           cwd=REPO_ROOT)]
    out = {}
    for index, job in enumerate(jobs):
        ends = [rank[index]["ends"] for rank in results]
        periods = [max(e[i + 1] - e[i] for e in ends) for i in range(len(ends[0]) - 1)]
        # periods[i] is batch i+1's; the last traced batch also gathers and writes the trace
        first = job.trace_skip - 1
        traced = set(range(first, first + job.trace_steps)) if job.traced else set()
        untraced = [p for i, p in enumerate(periods) if i >= job.warmup - 1 and i not in traced]
        in_window = [p for i, p in enumerate(periods) if first <= i < first + job.trace_steps - 1] if job.traced else []
        out[job.name] = {"period_s": statistics.median(untraced), "periods_s": periods,
                         "traced_period_s": statistics.median(in_window) if in_window else None,
                         "trace": results[0][index]["trace"]}
    return out


def recording_overhead_us(calls: int = 2000) -> dict[str, float]:
    """Microseconds each recorded collective costs on top of the plain call (1-rank gloo group, tiny tensor)."""
    import torch.distributed as dist

    from lightning_merak.profiler.recorder import TraceRecorder

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        tensor = torch.zeros(4)

        def per_call() -> float:
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(tensor)
            return (time.perf_counter() - start) / calls * 1e6

        plain = min(per_call() for _ in range(3))
        recorder = TraceRecorder(0, block_spans=False)
        recorder.install()
        try:
            recorded = min(per_call() for _ in range(3))
        finally:
            recorder.uninstall()
    finally:
        dist.destroy_process_group()
    return {"plain_call_us": plain, "recorded_call_us": recorded, "overhead_per_op_us": recorded - plain}


def _shape(workload: Workload = WORKLOAD) -> ModelShape:
    model = build_causal_lm(workload.model_config(), workload.vocab)
    blocks = model.model.layers
    block_params = sum(p.numel() for p in blocks[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    return ModelShape(len(blocks), block_params, total - len(blocks) * block_params, WORKLOAD.hidden, WORKLOAD.seq)


def _row(kind: str, what: str, predicted: float, measured: Optional[float], **extra: Any) -> dict[str, Any]:
    row = {"kind": kind, "what": what, "predicted_ms": round(predicted * 1e3, 2),
           "measured_ms": round(measured * 1e3, 2) if measured else None, **extra}
    if measured:
        row["error"] = predicted / measured - 1.0
    return row


def _runs_without_paths(measured: dict[float, dict[str, dict[str, Any]]],
                        rates: Sequence[float]) -> dict[str, dict[str, Any]]:
    """Every run's periods for the JSON (the traces' temporary paths left out)."""
    runs = dict(measured[BASE_RATE_MBIT]) | {f"dp2@{rate:g}Mbit": measured[rate]["dp2"] for rate in rates}
    return {name: {k: v for k, v in run.items() if k != "trace"} for name, run in runs.items()}


def one_step_trace(trace: Trace, step: int) -> Trace:
    """``trace`` cut to one step (the committed Perfetto example)."""
    from lightning_merak.profiler.trace import RankTrace

    ranks = [RankTrace(r.rank, [s for s in r.spans if s.step == step], [c for c in r.comms if c.step == step])
             for r in trace.ranks]
    return Trace(ranks, trace.offsets, {**trace.meta, "step": step})


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and micro-batch counts (under 4 minutes)")
    parser.add_argument("--out", type=Path, help=report.out_help("replay"))
    parser.add_argument("--traces", type=Path, help="keep the raw traces in this directory")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        rank_main([Job(**j) for j in json.loads(args.jobs)], args.dir)
        return 0
    if not emulation_available():
        print("the emulated cluster needs root, ip and tc (see lightning_merak/testing/netem.py)")
        return 2
    args.out = args.out or report.default_out("replay", args.quick)
    mode = QUICK if args.quick else FULL
    started = time.perf_counter()
    shape = _shape()
    overhead = recording_overhead_us()
    print(f"recording overhead: {overhead['overhead_per_op_us']:.1f} us per op "
          f"(plain call {overhead['plain_call_us']:.1f} us)", flush=True)
    steps = mode.steps
    base = [Job("dp2", 2, 1, 1, 1, True, steps), Job("pp2_m2", 1, 2, 1, 2, True, steps),
            Job("tp2", 1, 1, 2, 1, False, steps)]
    probe_jobs = [Job("tp2_probe", 1, 1, 2, 1, True, steps, layers=PROBE_LAYERS)]
    base += [Job(f"pp2_m{m}", 1, 2, 1, m, False, steps) for m in mode.micro_batch_counts] + probe_jobs
    print(f"replay benchmark: {WORKLOAD.describe()} per replica, 2 gloo ranks, emulated links "
          f"({'quick' if args.quick else 'full'})", flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="merak-replay-") as out_dir:
        os.chmod(out_dir, 0o777)
        measured = {BASE_RATE_MBIT: run_cluster(BASE_RATE_MBIT, base, out_dir)}
        periods = ", ".join(f"{name} {1e3 * run['period_s']:.0f} ms" for name, run in measured[BASE_RATE_MBIT].items())
        print(f"  1 Gbit: {periods} ({time.perf_counter() - started:.0f} s)", flush=True)
        for rate in mode.rates:
            measured[rate] = run_cluster(rate, [Job("dp2", 2, 1, 1, 1, False, steps)], out_dir)
            print(f"  {rate:g} Mbit: dp2 {measured[rate]['dp2']['period_s'] * 1e3:.0f} ms "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
        at_base = measured[BASE_RATE_MBIT]
        traces = {name: Trace.load(at_base[name]["trace"]) for name in ("dp2", "pp2_m2", "tp2_probe")}
        if args.traces:
            for name, trace in traces.items():
                trace.save(args.traces / f"{name}.json")
    for name, trace in traces.items():
        if name.endswith("_probe"):
            continue
        replayed = replay_trace(trace)
        rows.append(_row("replay", f"{name} at 1 Gbit (traced steps)", replayed.step_time, measured_step_time(trace),
                         overhead=at_base[name]["traced_period_s"] / at_base[name]["period_s"] - 1.0))
    dp2 = traces["dp2"]
    traced_period = measured_step_time(dp2)
    for rate in mode.rates:
        predicted = replay_trace(dp2, WhatIf(bandwidth_ratio=rate / BASE_RATE_MBIT)).step_time
        # The traced steps carry the profiler's overhead, measured runs do not: scale by the traced run's own ratio.
        untraced = predicted * at_base["dp2"]["period_s"] / traced_period
        rows.append(_row("what-if link", f"dp2 at {rate:g} Mbit from 1 Gbit", untraced,
                         measured[rate]["dp2"]["period_s"]))
    costs_dp = calibrate(dp2, shape, Job("dp2", 2, 1, 1, 1, True, steps).layout())
    correction = at_base["dp2"]["period_s"] / traced_period
    probes = [Probe(traces[job.name], _shape(job.workload()), job.layout(),
                    at_base[job.name]["period_s"] / measured_step_time(traces[job.name])) for job in probe_jobs]
    predictor = ReplayPredictor(calibrate_from_traces(dp2, shape, base[0].layout(), probes, correction))
    for job in base[1:3]:
        probed = f" and a {PROBE_LAYERS}-block probe" if job.tp > 1 else ""
        rows.append(_row("what-if layout", f"{job.name} from dp2{probed}", predictor.step_time(job.layout()),
                         at_base[job.name]["period_s"]))
    unprobed = predict_layout(costs_dp, shape, base[2].layout()).step_time * correction
    rows.append(_row("what-if layout (no probe)", "tp2 from dp2 alone", unprobed, at_base["tp2"]["period_s"]))
    pp_trace = traces["pp2_m2"]
    costs_pp = calibrate(pp_trace, shape, Job("pp2_m2", 1, 2, 1, 2, True, steps).layout())
    pp_correction = at_base["pp2_m2"]["period_s"] / measured_step_time(pp_trace)
    for m in mode.micro_batch_counts:
        job = Job(f"pp2_m{m}", 1, 2, 1, m, False, steps)
        predicted = predict_layout(costs_pp, shape, job.layout()).step_time * pp_correction
        rows.append(_row("what-if micro-batches", f"pp2 M={m} from M=2", predicted, at_base[job.name]["period_s"]))
    rows.append(_row("what-if (not measured)", "dp2, overlap off", replay_trace(dp2, WhatIf(overlap=False)).step_time
                     * correction, None))
    rows.append(_row("what-if (not measured)", "dp2, full recompute",
                     replay_trace(dp2, WhatIf(recompute_fraction=1.0)).step_time * correction, None))
    for dp, pp, tp, m in SIMULATED:
        layout = LayoutSpec(dp, pp, tp, m, WORKLOAD.global_batch)
        rows.append(_row("simulated", f"{layout.ranks} ranks: dp{dp} pp{pp} tp{tp} M{m}",
                         predict_layout(costs_dp, shape, layout).step_time * correction, None, label="simulated"))
    example = args.out.with_name(f"{args.out.name.removesuffix('.json')}_pp2_step.perfetto.json")
    write_chrome_trace(chrome_trace(one_step_trace(pp_trace, pp_trace.steps()[-1])), example)
    replay_error = abs(max((r["error"] for r in rows if r["kind"] == "replay"), key=abs))
    whatif = [abs(r["error"]) for r in rows if r["kind"].startswith("what-if") and "error" in r
              and r["kind"] != "what-if layout (no probe)"]
    without_probes = [abs(r["error"]) for r in rows if r["kind"].startswith("what-if") and "error" in r
                      and "probe" not in r["what"]]
    print("\nReplay and what-if predictions vs measured step periods (2 ranks, emulated links; 8-64 ranks simulated)")
    report.print_table([{**r, "error": f"{100 * r['error']:+.1f}%" if "error" in r else "-"} for r in rows],
                       ["kind", "what", "predicted_ms", "measured_ms", "error"])
    print(f"replay error {100 * replay_error:.1f}% (target ≤ {100 * REPLAY_TARGET:.0f}%), what-if error max "
          f"{100 * max(whatif):.1f}% (target ≤ {100 * WHATIF_TARGET:.0f}%; without the probes "
          f"{100 * max(without_probes):.1f}%)")
    report.write_json(args.out, rows, "emulated", replay_error=replay_error, whatif_error_max=max(whatif),
                      whatif_error_max_without_probes=max(without_probes), probe_layers=PROBE_LAYERS,
                      replay_target=REPLAY_TARGET, whatif_target=WHATIF_TARGET, workload=WORKLOAD.describe(),
                      mode="quick" if args.quick else "full", perfetto_example=example.name,
                      recording_overhead=overhead, runs=_runs_without_paths(measured, mode.rates),
                      calibrated_costs={"dp2": asdict(costs_dp), "pp2_m2": asdict(costs_pp),
                                        "predictor": predictor.calibration.describe()},
                      note="emulated: tbf-shaped veth links, 2 gloo ranks, one thread each; simulated rows are "
                           "replays only; timings on a shared machine are noisy",
                      gpu_leg="not run: CPU/gloo on an emulated network", wall_s=time.perf_counter() - started)
    print(f"wrote {args.out} and {example.name} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
