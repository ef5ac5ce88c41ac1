"""Regional compilation (``Merak3DStrategy(compile=True)``) against eager merak3d, and against compiling a bare block.

Run from the repo root::

    python -m benchmarks.compile [--quick] [--out PATH] [--device cpu|cuda]

Two gloo ranks, one compute thread each (one core each on this 2-core machine), train a randomly initialised
transformers Llama (fp32, AdamW at a constant learning rate) at each layout of :data:`LAYOUTS` (dp2, pp2, tp2), eager
and compiled, side by side on the same batches from the same seed (``benchmarks._compile_ranks``), at hidden 128 and
512. Per row: ``tokens_per_s`` (the global batch's tokens over the median, after warm-up, of the slowest rank's
step), ``speedup`` (compiled over eager), ``efficiency`` (the layout's speedup over the bare block's at that width),
and torch's counters after warm-up: graphs compiled, graph breaks and recompilations. The bare block: two Llama
blocks, forward and backward, on one rank's micro-batch shape, in this process with one thread, eager and compiled.

Goals (issue #51; worst case over the leg, :func:`benchmarks.goals.worst_case`): :data:`SPEEDUP` (hidden 128),
:data:`EFFICIENCY`, :data:`BREAKS`, :data:`LOSS`. Label "measured" (CPU, inductor). ``--device cuda`` is the GPU leg
(one process per GPU; not run on this machine, which has none). A full run is written with
:func:`benchmarks.goals.write_run`; ``--quick`` (hidden 128 only, fewer steps) writes ``results/compile.quick.json``.
A row that errors makes the command exit 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from benchmarks import report
from benchmarks._compile_ranks import Job, run_jobs
from benchmarks._scale_ranks import Workload
from benchmarks.goals import Goal, print_goals, worst_case, write_run

WORLD_SIZE = 2
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2": {"data_parallel": 2},
    "pp2": {"data_parallel": 1, "pipeline_parallel": 2},
    "tp2": {"data_parallel": 1, "tensor_parallel": 2},
}
ISSUE = 51


@dataclass(frozen=True)
class Setting:
    hiddens: tuple[int, ...]
    layers: int
    seq: int
    global_batch: int
    steps: int
    warmup: int
    timeout_s: float

    def workload(self, hidden: int) -> Workload:
        return Workload(hidden=hidden, layers=self.layers, vocab=2048, seq=self.seq, global_batch=self.global_batch)


FULL = Setting(hiddens=(128, 512), layers=4, seq=256, global_batch=8, steps=12, warmup=4, timeout_s=2400.0)
QUICK = Setting(hiddens=(128,), layers=2, seq=128, global_batch=4, steps=6, warmup=3, timeout_s=900.0)

SPEEDUP = Goal(
    "compile_speedup_min", 1.15, ">=",
    "tokens/s of merak3d with compile=True over eager merak3d at the same layout, the median after warm-up of the "
    "slowest rank's step; llama hidden 128, 4 layers, seq 256, global batch 8, 2 gloo ranks with one thread each; "
    "worst of dp2, pp2 and tp2", issue=ISSUE)
EFFICIENCY = Goal(
    "compile_efficiency_min", 0.9, ">=",
    "a layout's compile speedup over the bare block's (two Llama blocks, forward and backward, one thread, same "
    "width and micro-batch shape) at that width; worst of dp2, pp2, tp2 at hidden 128 and 512", issue=ISSUE)
BREAKS = Goal(
    "compile_breaks_and_recompiles_after_warmup", 0, "<=",
    "graph breaks plus recompilations on any rank after the warm-up steps; largest over every layout and width",
    issue=ISSUE)
LOSS = Goal(
    "compile_loss_max_rel_diff", 1e-5, "<=",
    "largest relative difference of the compiled run's loss from the eager run's (same layout, batches and seed) "
    "over every step; worst of every layout and width", issue=ISSUE)
COLUMNS = ["hidden", "layout", "mode", "tokens_per_s", "speedup", "efficiency", "graphs", "breaks", "recompiles",
           "status"]


def bare_block_speedup(hidden: int, batch: int, seq: int, device: str, repeats: int = 10, warmup: int = 3
                       ) -> dict[str, float]:
    """Two Llama blocks, forward and backward, eager and compiled as merak3d compiles a block (one thread on CPU):
    the ceiling of the gain."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from lightning_merak.parallel.regional_compile import profiled_block
    from lightning_merak.util.timing import DeviceTimer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Workload(hidden=hidden, layers=2, vocab=2048, seq=seq).config()
    config._attn_implementation = "sdpa"
    blocks = torch.nn.ModuleList(LlamaDecoderLayer(config, index) for index in range(2)).to(device)
    rotary = LlamaRotaryEmbedding(config).to(device)
    hidden_states = torch.randn(batch, seq, hidden, device=device, requires_grad=True)
    positions = torch.arange(seq, device=device)[None]
    embeddings = rotary(hidden_states, positions)

    def step(forwards: list[Any]) -> None:
        out = hidden_states
        for forward in forwards:
            out = forward(out, position_embeddings=embeddings, position_ids=positions)
            out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).mean().backward()

    timings = {}
    compiled = [profiled_block(block, f"layers.{index}", True) for index, block in enumerate(blocks)]  # as merak3d
    for mode, forwards in (("eager", [block.forward for block in blocks]), ("compiled", compiled)):
        times = []
        for index in range(warmup + repeats):
            with DeviceTimer(torch.device(device)) as timer:
                step(forwards)
            if index >= warmup:
                times.append(timer.seconds)
        timings[mode] = statistics.median(times)
    return {"eager_ms": 1e3 * timings["eager"], "compiled_ms": 1e3 * timings["compiled"],
            "speedup": timings["eager"] / timings["compiled"]}


def plan_jobs(setting: Setting) -> list[Job]:
    return [Job(f"h{hidden}/{layout}/{'compiled' if compiled else 'eager'}", setting.workload(hidden), degrees,
                compiled, setting.steps, setting.warmup)
            for hidden in setting.hiddens for layout, degrees in LAYOUTS.items() for compiled in (False, True)]


def job_rows(jobs: list[Job], by_rank: list[list[dict[str, Any]]], warmup: int, bare: dict[int, dict[str, float]]
             ) -> list[dict[str, Any]]:
    rows = []
    for index, job in enumerate(jobs):
        hidden, layout, mode = job.name.split("/")
        row: dict[str, Any] = {"hidden": int(hidden[1:]), "layout": layout, "mode": mode, "degrees": job.layout}
        results = [results[index] if len(results) > index else {"error": "not run (an earlier job failed)"}
                   for results in by_rank]
        errors = [result["error"] for result in results if "error" in result]
        if errors:
            rows.append({**row, "error": errors[0]})
            continue
        slowest = [max(steps) for steps in zip(*(result["step_s"] for result in results))]
        step_s = statistics.median(slowest[warmup:])
        later = [result["later_counts"] for result in results]
        rows.append({**row, "step_ms": 1e3 * step_s, "step_ms_by_step": [1e3 * s for s in slowest],
                     "tokens_per_s": job.workload.global_batch * job.workload.seq / step_s,
                     "losses": results[0]["losses"], "graphs": max(r["warmup_counts"]["graphs"] for r in results),
                     "breaks": max(c["graph_breaks"] for c in later),
                     "recompiles": max(c["recompiles"] for c in later)})
    for row in rows:
        eager = next((other for other in rows if (other["hidden"], other["layout"], other["mode"]) ==
                      (row["hidden"], row["layout"], "eager") and "step_ms" in other), None)
        if row["mode"] == "compiled" and "step_ms" in row and eager is not None:
            row["speedup"] = eager["step_ms"] / row["step_ms"]
            row["efficiency"] = row["speedup"] / bare[row["hidden"]]["speedup"]
            row["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], eager["losses"]))
    return rows


def goal_figures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    compiled = {f"h{row['hidden']}/{row['layout']}": row for row in rows if row["mode"] == "compiled"}
    speedup = {key: row.get("speedup") for key, row in compiled.items() if key.startswith("h128/")}
    return [worst_case(SPEEDUP, speedup), worst_case(EFFICIENCY, {k: r.get("efficiency") for k, r in compiled.items()}),
            worst_case(BREAKS, {k: (r["breaks"] + r["recompiles"] if "breaks" in r else None)
                                for k, r in compiled.items()}),
            worst_case(LOSS, {k: r.get("loss_max_rel_diff") for k, r in compiled.items()})]


def main(argv: Optional[list[str]] = None) -> int:
    """Benchmark entry point; exit 0 when every row ran, 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="hidden 128 only, 2 layers, fewer steps (~3 minutes)")
    parser.add_argument("--out", type=Path, help=report.out_help("compile"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU leg (the bare block on the GPU; layouts need 2 GPUs)")
    args = parser.parse_args(argv)
    setting = QUICK if args.quick else FULL
    from lightning_merak.testing import run_distributed

    started, load_at_start = time.monotonic(), os.getloadavg()[0]
    print(f"hiddens {setting.hiddens}, {setting.layers} layers, seq {setting.seq}, global batch "
          f"{setting.global_batch}; layouts {', '.join(LAYOUTS)}; {setting.steps} steps ({setting.warmup} warm-up)",
          flush=True)
    per_rank_batch = setting.global_batch // WORLD_SIZE
    bare = {hidden: bare_block_speedup(hidden, per_rank_batch, setting.seq, args.device) for hidden in setting.hiddens}
    for hidden, figures in bare.items():
        print(f"bare block, hidden {hidden}: eager {figures['eager_ms']:.1f} ms, compiled {figures['compiled_ms']:.1f} "
              f"ms, speedup {figures['speedup']:.2f}", flush=True)
    if args.device == "cuda":
        rows: list[dict[str, Any]] = []  # the layouts need one GPU per rank; the bare block is the one-GPU leg
    else:
        jobs = plan_jobs(setting)
        by_rank = run_distributed(run_jobs, WORLD_SIZE, args=(jobs,), timeout_s=setting.timeout_s)
        rows = job_rows(jobs, by_rank, setting.warmup, bare)
    goals = goal_figures(rows)
    print("\nRegional compile vs eager merak3d (measured, CPU inductor, 2 ranks x 1 thread)")
    report.print_table([{**row, "status": "error" if "error" in row else "ok"} for row in rows], COLUMNS)
    print_goals(goals)
    wall_s = round(time.monotonic() - started, 1)
    written = write_run(
        "compile", rows, "measured", goals, quick=args.quick, out=args.out, benchmark="compile", backend="gloo",
        device=args.device, threads_per_rank=1, setting=asdict(setting), layouts=LAYOUTS, bare_block=bare,
        baseline="eager merak3d at the same layout (compile=False, the default), and the bare block's own speedup",
        gpu_leg="not run: no GPU on this machine" if args.device == "cpu" else "bare block only", wall_s=wall_s,
        load_average={"start": load_at_start, "end": os.getloadavg()[0]})
    print(f"wrote {written} in {wall_s:.0f} s")
    failed = [f"h{row['hidden']}/{row['layout']}/{row['mode']}: {row['error']}" for row in rows if "error" in row]
    for line in failed:
        print(f"compile: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
