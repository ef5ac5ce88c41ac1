"""Distributed Muon against AdamW and against the common port, on an emulated 1 Gbit/s cluster network.

Run from the repo root, as root (the shaped links need network namespaces)::

    python -m benchmarks.muon [--quick] [--out PATH]

Four gloo ranks, one compute thread each, each in its own network namespace on a tbf-shaped 1 Gbit/s veth link
(``lightning_merak.testing.netem.EmulatedCluster``); on this 2-core machine every rank gets a fixed CPU quota
(``device_per_rank_quota``: one device per rank, half a core each), recorded in the JSON. merak3d trains a randomly
initialised transformers Llama (:data:`WORKLOAD`, fp32, constant learning rate) at two layouts, :data:`LAYOUTS`:
``dp4-zero1`` (``data_parallel=4, data_parallel_sharding="optimizer"``) and ``pp2-dp2`` (merak3d's default
sharding, none). At each, side by side on the same batches from the same seed (``benchmarks._muon_ranks``):

* ``adamw``: the baseline, ``CausalLMModule``'s AdamW at the same layout;
* ``muon``: ours at its defaults, ``optim=muon`` (Muon on the hidden matrices, AdamW on embeddings, head, norms and
  biases), each matrix orthogonalised on one owner rank (ZeRO-1: put together from the ranks' slices; none: the
  owner broadcasts the new values);
* ``muon_naive``: the common port: every rank puts every matrix together and runs every Newton–Schulz itself;
* ``muon_float32``: ours with ``optim.newton_schulz_dtype=float32``, a labelled row in no goal: torch's Muon (ours
  and the port at their defaults) iterates in bfloat16, which a CPU without AVX512-BF16 or AMX multiplies some 50×
  slower than float32 (the machine record's ``cpu_capability`` and ``cpu_bfloat16`` say which CPU ran).

Per row: ``step_ms`` (median over the timed steps, warm-up dropped, of the slowest rank's step) and
``optimizer_ms`` (the same statistic of the part after the backward: the optimizer's step with its collectives, what
the three rows differ in; a diagnostic, no goal), with each rank's ``optimizer_ms_by_rank``, and at pp2 AutoPipe's
``boundaries`` and the Newton–Schulz work it priced per stage (``priced_optimizer_ms``). Goals (issue #53;
worst case over the layouts, :func:`benchmarks.goals.worst_case`): :data:`STEP`, :data:`NAIVE`, :data:`LOSS`. A full
run is written with :func:`benchmarks.goals.write_run`; ``--quick`` writes ``results/muon.quick.json``. Label
"emulated": measured on this machine's CPU over a shaped network (no latency emulation: no sch_netem). Any row
that errors makes the command exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from benchmarks import report
from benchmarks._muon_ranks import OPTIMIZERS, Job, rank_file
from benchmarks._scale_ranks import Workload
from benchmarks.goals import Goal, print_goals, worst_case, write_run
from lightning_merak.distributed.host_memory import with_heap_tunables
from lightning_merak.testing.cpu_quota import device_per_rank_quota, emulation_record
from lightning_merak.testing.netem import EmulatedCluster, LinkSpec, RankFailure, RankTimeout, emulation_available

REPO_ROOT = Path(__file__).resolve().parents[1]
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLIBC_TUNABLES": with_heap_tunables(os.environ)}
"""Every rank's environment, ours and the baselines': one compute thread, the heap merak3d's launcher gives."""
WORLD_SIZE = 4
RATE_MBIT = 1_000.0
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp4-zero1": {"data_parallel": 4, "data_parallel_sharding": "optimizer"},
    "pp2-dp2": {"pipeline_parallel": 2, "data_parallel": 2},
}
WORKLOAD = Workload(hidden=256, layers=4, vocab=2048, seq=256, global_batch=16, micro_batches=2)
ISSUE = 53

STEP = Goal(
    "muon_step_over_adamw", 1.15, "<=",
    "merak3d step with optim=muon (defaults) over the same layout's step with AdamW, steps the median of the "
    f"slowest rank after warm-up; {WORKLOAD.describe()}, 4 gloo ranks, 1 thread and half a core each, emulated "
    "1 Gbit/s links; worst of dp4 ZeRO-1 and pp2 x dp2", issue=ISSUE)
NAIVE = Goal(
    "muon_naive_over_ours", 1.5, ">=",
    "step of the common Muon port (every rank puts every matrix together and orthogonalises it) over ours (each "
    "matrix on one owner), same layout, workload and statistic as muon_step_over_adamw; worst of the layouts",
    issue=ISSUE)
LOSS = Goal(
    "muon_loss_max_rel_diff", 1e-5, "<=",
    "largest relative difference of the global batch's loss of ours from the common port's (the same arithmetic on "
    "the same matrices, distributed differently) over every step; worst of the layouts", issue=ISSUE)
COLUMNS = ["layout", "optimizer", "step_ms", "optimizer_ms", "over_adamw", "loss_last", "status"]


@dataclass(frozen=True)
class Setting:
    workload: Workload
    steps: int
    warmup: int
    timeout_s: float


FULL = Setting(WORKLOAD, steps=10, warmup=3, timeout_s=1800.0)
QUICK = Setting(Workload(hidden=128, layers=2, vocab=1024, seq=128, global_batch=8, micro_batches=2), steps=5,
                warmup=2, timeout_s=900.0)


def plan_jobs(setting: Setting) -> list[Job]:
    """One job per layout and optimizer, after a short unreported warm-up (process set-up, first imports)."""
    warmup = Job("warm-up", "adamw", LAYOUTS["dp4-zero1"], steps=2)
    return [warmup] + [Job(f"{layout}/{optimizer}", optimizer, degrees, setting.steps)
                       for layout, degrees in LAYOUTS.items() for optimizer in OPTIMIZERS]


def run_cluster(jobs: list[Job], setting: Setting, work: Path) -> tuple[list[list[dict[str, Any]]], Optional[str]]:
    """Every job on the emulated cluster: each rank's results, and the error that stopped the ranks, if any."""
    jobs_file = work / "jobs.json"
    jobs_file.write_text(json.dumps({"workload": asdict(setting.workload), "jobs": [asdict(job) for job in jobs]}))
    out = work / "results.jsonl"
    cluster = EmulatedCluster(WORLD_SIZE, LinkSpec(rate_mbit=RATE_MBIT), cpu_quota=device_per_rank_quota(WORLD_SIZE))
    argv = [sys.executable, "-m", "benchmarks._muon_ranks", str(jobs_file), str(out)]
    error: Optional[str] = None
    try:
        with cluster:
            cluster.run(argv, timeout_s=setting.timeout_s, extra_env=RANK_ENV, cwd=REPO_ROOT)
    except (RankFailure, RankTimeout) as failure:
        error = report.rank_failure_line(failure)
    by_rank = []
    for rank in range(WORLD_SIZE):
        path = rank_file(out, rank)
        by_rank.append([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])
    return by_rank, error


def job_rows(jobs: list[Job], by_rank: list[list[dict[str, Any]]], warmup: int, error: Optional[str]
             ) -> list[dict[str, Any]]:
    """A row per measured job: the slowest rank's median step after warm-up, the losses, or the error."""
    rows = []
    for index, job in enumerate(jobs):
        if job.name == "warm-up":
            continue
        layout, _ = job.name.split("/")
        row: dict[str, Any] = {"layout": layout, "optimizer": job.optimizer, "degrees": job.layout}
        if any(len(results) <= index for results in by_rank):
            rows.append({**row, "error": error or "no result"})
            continue
        results = [results[index] for results in by_rank]
        slowest = [max(steps) for steps in zip(*(result["step_s"] for result in results))]
        optimizer = [max(steps) for steps in zip(*(result["optimizer_s"] for result in results))]
        rows.append({**row, "step_ms": 1e3 * statistics.median(slowest[warmup:]),
                     "optimizer_ms": 1e3 * statistics.median(optimizer[warmup:]),
                     "step_ms_by_step": [1e3 * step for step in slowest], "losses": results[0]["losses"],
                     "loss_last": results[0]["losses"][-1],
                     # where AutoPipe cut and the optimizer work it priced per stage, and each rank's measured
                     "boundaries": results[0].get("boundaries"),
                     "priced_optimizer_ms": [1e3 * seconds for seconds in results[0].get("stage_optimizer_s") or []],
                     "optimizer_ms_by_rank": [1e3 * statistics.median(result["optimizer_s"][warmup:])
                                              for result in results]})
    for row in rows:
        adamw = next((other for other in rows if other["layout"] == row["layout"] and other["optimizer"] == "adamw"
                      and "step_ms" in other), None)
        if "step_ms" in row and adamw is not None:
            row["over_adamw"] = row["step_ms"] / adamw["step_ms"]
    return rows


def goal_figures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def row(layout: str, optimizer: str) -> Optional[dict[str, Any]]:
        return next((r for r in rows if r["layout"] == layout and r["optimizer"] == optimizer and "step_ms" in r),
                    None)

    step, naive, loss = {}, {}, {}
    for layout in LAYOUTS:
        ours, adamw, port = row(layout, "muon"), row(layout, "adamw"), row(layout, "muon_naive")
        step[layout] = ours["step_ms"] / adamw["step_ms"] if ours and adamw else None
        naive[layout] = port["step_ms"] / ours["step_ms"] if ours and port else None
        loss[layout] = (max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], port["losses"]))
                        if ours and port else None)
    return [worst_case(STEP, step), worst_case(NAIVE, naive), worst_case(LOSS, loss)]


def main(argv: Optional[list[str]] = None) -> int:
    """Benchmark entry point; exit 0 when every row ran, 1 otherwise, 2 when the host cannot emulate the network."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer steps (about 3 minutes)")
    parser.add_argument("--out", type=Path, help=report.out_help("muon"))
    args = parser.parse_args(argv)
    setting = QUICK if args.quick else FULL
    if not emulation_available():
        return 2
    started, load_at_start = time.monotonic(), os.getloadavg()[0]
    print(f"{setting.workload.describe()}; layouts {', '.join(LAYOUTS)}; {setting.steps} steps ({setting.warmup} "
          f"warm-up); emulated {RATE_MBIT:g} Mbit/s links, {WORLD_SIZE} ranks", flush=True)
    jobs = plan_jobs(setting)
    with tempfile.TemporaryDirectory(prefix="merak-muon-") as work:
        by_rank, error = run_cluster(jobs, setting, Path(work))
    rows = job_rows(jobs, by_rank, setting.warmup, error)
    goals = goal_figures(rows)
    print(f"\nMuon vs AdamW and vs the common port (emulated network, measured; {setting.workload.describe()})")
    report.print_table([{**row, "status": "error" if "error" in row else "ok"} for row in rows], COLUMNS)
    print_goals(goals)
    wall_s = round(time.monotonic() - started, 1)
    written = write_run(
        "muon", rows, "emulated", goals, quick=args.quick, out=args.out, benchmark="muon", backend="gloo",
        threads_per_rank=1, rank_env=RANK_ENV, workload=asdict(setting.workload),
        workload_description=setting.workload.describe(), setting=asdict(setting), layouts=LAYOUTS,
        baseline="AdamW (CausalLMModule's) at the same merak3d layout; the common Muon port (every rank computes every "
        "matrix) as the second baseline",
        rank_cpu=emulation_record(device_per_rank_quota(WORLD_SIZE), WORLD_SIZE),
        network_note="tbf rate shaping on veth links; no latency emulation (no sch_netem)",
        gpu_leg="not run: this benchmark's runs are CPU/gloo on an emulated network", wall_s=wall_s,
        load_average={"start": load_at_start, "end": os.getloadavg()[0]})
    print(f"wrote {written} in {wall_s:.0f} s")
    failed = [f"{row['layout']}/{row['optimizer']}: {row['error']}" for row in rows if "error" in row]
    for line in failed:
        print(f"muon: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
