"""merak3d at scale on this CPU: per-rank memory against its share, the largest model under a cap, load speed.

Run from the repo root::

    python -m benchmarks.scale [--quick] [--out PATH] [--legs NAME ...] [--device cpu|cuda]
                               [--rank-heap merak3d|glibc] [--memory-only]

``--legs`` runs only the named legs (``pp2xtp2``, ``"tp2 (compact host memory)"``, ``"DDP (4 ranks)"``: a leg's
name, with or without its ``merak3d`` prefix), for investigating one layout; the load section then covers only
those merak3d layouts (none: skipped), and the goals only those layouts (noted as partial).

Every leg runs in fresh gloo rank processes (``lightning_merak.testing.run_distributed``, one
torch thread each) and trains a few steps of a randomly initialised Llama built from its config:

1. *Memory.* Per rank, ``VmHWM`` (peak resident memory) minus ``VmRSS`` after the imports and
   before the model exists. The rank's *ideal* is what it must hold: its parameters, their
   gradients and AdamW's two moments (4 × its parameter bytes, as counted on the rank after
   training: DTensor shards and ZeRO-3 partitions locally) plus activations. Activations are
   *measured*, not derived: bytes autograd saves for backward in a separate one-sample forward of
   the part of the model one tensor-parallel rank computes (its heads, MLP columns and vocabulary
   rows; norms and residual stream at full width) with 1 and with 2 decoder layers (parameters
   excluded), giving per-layer and embedding/head/loss figures; a rank holds (its micro-batch) ×
   (micro-batches in flight under 1F1B: pp − stage) × (its layers, plus the head part on the last
   stage). Goal ``peak_over_ideal`` (issue #49, ≤ 1.3) is the worst rank's (peak − baseline) / ideal,
   worst over merak3d's default legs — dp2, pp2, tp2 (2 ranks) and pp2×tp2 (4 ranks) under meta init
   (``configure_model``) — and over every rung of the ladder (``benchmarks.goals.worst_case``);
   ``peak_over_ideal_compact`` the same with ``compact_host_memory=True`` (not the default: glibc
   returns freed memory at once), and ``compact_step_time_ratio_max`` what that costs in step time
   (the largest ratio over layouts and rungs). Each row's ``worst_rank_trace_mb`` follows its worst
   rank through setup, each step's forward and backward, and each optimizer step: resident and peak
   memory above the baseline, ``rss_file`` (file-backed pages above the baseline's: library code the
   steps touch first), ``heap_free``, the freed-but-kept heap (glibc's ``mallinfo2``) that resident
   memory holds beyond live allocations, and ``heap_in_use``, live heap above the baseline's. Baselines: Lightning's
   ModelParallelStrategy (FSDP2 ``fully_shard``, meta init via ``trainer.init_module(empty_init=True)``;
   Lightning materialises it with ``reset_parameters()``, which RMSNorm and rotary buffers lack, so
   its losses mean nothing, while its memory does);
   DeepSpeed ZeRO-3 through ``deepspeed.initialize`` (Lightning's DeepSpeedStrategy refuses CPU),
   reported as ``refused`` with its error if it cannot run here; plain DDP (Lightning's ``DDPStrategy()``),
   everything replicated. Each baseline runs on 2 and on 4 ranks, and each merak3d layout is compared
   with the baselines on as many ranks (``ratios``).
2. *Largest model under a cap.* Models grow by decoder layers (the ladder); each leg runs every rung,
   largest first; its largest model is the largest rung whose worst rank's (peak − baseline) fits
   ``cap_mb``. The largest rung's weights plus AdamW state exceed the cap, so training it at all needs the
   model split.
3. *Load.* ``save_pretrained`` writes the ladder's largest model (fp32) to a temporary directory;
   ``AutoModelForCausalLM.from_pretrained(DIR, dtype=float32)`` is timed in this process (the call,
   ``call_s``, and until every weight has been read once, ``load_s``: the call may only map the file), and
   merak3d's per-rank sharded load (``lightning_merak.hf.load_pretrained`` on each rank's shard,
   from merak3d's pretrained seam) in each layout: the slowest rank's seconds, and checkpoint
   bytes / those seconds. Logits of one batch are compared with ``from_pretrained``'s
   (``logits_max_rel_err``: max |difference| / max |reference|, worst layout). The pp2×tp2 load is
   saved as a merak3d checkpoint with no training step and exported with ``merak-export``;
   ``export_roundtrip_max_abs`` compares every exported tensor with the original file's.

Ranks start as merak3d's launcher starts the ranks it creates: with ``GLIBC_TUNABLES`` holding
``lightning_merak.distributed.host_memory.HEAP_TUNABLES`` (glibc's per-thread cache and fast bins off, so freed
tensor storage merges into holes the heap reuses; recorded as ``rank_glibc_tunables``), for every leg, the
baselines included (rule 5 of ``docs/results.md``: no benchmark-only heap). Ranks torchrun or SLURM start
from a user's shell have glibc's defaults instead (merak3d ranks still turn fast bins off at setup), so a run
then measures the memory section of merak3d's default layouts again in a fresh ``python -m benchmarks.scale
--rank-heap glibc --memory-only`` (the forkserver every rank is forked from reads the variable once):
``without_launcher_env`` holds its rows, goal ``peak_over_ideal_without_launcher_env`` its worst case. Each
memory row's ``tcache_off`` says, per rank, whether its heap really started with the cache off.

``--device cuda`` runs the GPU leg instead (``benchmarks/_scale_gpu.py``: one GPU, one rank per
leg, written to ``scale.gpu.json``).

Figures are measured on this machine (label "measured"; CPU, gloo). A leg that errors makes the
command exit 1, except a baseline that refuses this machine (ZeRO-3), which is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks._scale_ranks import (
    MIB,
    RANK_TIMEOUT_S,
    Leg,
    Workload,
    from_pretrained_rank,
    load_rank,
    measure_activations,
    train_rank,
)
from benchmarks.goals import Goal, print_goals, worst_case, write_run
from benchmarks.report import default_out, error_line, out_help, print_table
from lightning_merak.distributed.host_memory import HEAP_TUNABLES, export_heap_tunables
from lightning_merak.testing import run_distributed
from lightning_merak.testing.distributed import DistributedRunError

PP_TP = {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 2, "micro_batches": 2}
MERAK_LAYOUTS = (
    ("dp2", 2, {"data_parallel": 2}),
    ("pp2", 2, {"data_parallel": 1, "pipeline_parallel": 2, "micro_batches": 2}),
    ("tp2", 2, {"data_parallel": 1, "tensor_parallel": 2}),
    ("pp2xtp2", 4, PP_TP),
)
COMPACT = " (compact host memory)"
BASELINE_RANKS = sorted({ranks for _, ranks, _ in MERAK_LAYOUTS})
"""Every rank count a merak3d layout runs on: each baseline runs at each, so a layout meets its equal."""
BASELINES = (("FSDP2", "FSDP2 (ModelParallelStrategy, {} ranks)", "fsdp2"),
             ("ZeRO-3", "DeepSpeed ZeRO-3 ({} ranks)", "zero3"), ("DDP", "DDP ({} ranks)", "ddp"))
"""Each baseline: its short name, its legs' name (by rank count) and its strategy."""
DEFAULT_LEGS = tuple(Leg(f"merak3d {name}", "merak3d", ranks, merak) for name, ranks, merak in MERAK_LAYOUTS)
LEGS = (
    *DEFAULT_LEGS,
    *(Leg(f"merak3d {name}{COMPACT}", "merak3d", ranks, {**merak, "compact_host_memory": True})
      for name, ranks, merak in MERAK_LAYOUTS),
    *(Leg(name.format(ranks), strategy, ranks) for _, name, strategy in BASELINES for ranks in BASELINE_RANKS),
)
MAY_REFUSE = {"zero3"}
"""Baselines whose refusal to run on this machine is a result, not a failure."""
LOAD_LEGS = DEFAULT_LEGS
"""merak3d's default layouts, which the load section also runs."""

_GOAL_WORKLOAD = ("merak3d's default layouts (dp2, pp2, tp2 on 2 ranks; pp2xtp2 on 4), every rung of the ladder; "
                  "the worst rank's (VmHWM - VmRSS before the model) / (4 x its parameter bytes + its measured "
                  "activations in flight)")
PEAK_OVER_IDEAL = Goal(
    "peak_over_ideal", 1.3, "<=",
    f"{_GOAL_WORKLOAD}, ranks started as merak3d's launcher starts them (GLIBC_TUNABLES = HEAP_TUNABLES); "
    "worst over layouts and rungs", issue=49)
PEAK_OVER_IDEAL_WITHOUT_LAUNCHER_ENV = Goal(
    "peak_over_ideal_without_launcher_env", 1.3, "<=",
    f"{_GOAL_WORKLOAD}, ranks started with glibc's default heap, as torchrun or SLURM start a user's script "
    "(merak3d's setup still turns fast bins off); worst over layouts and rungs", issue=49)


@dataclass(frozen=True)
class Mode:
    """Model sizes (decoder layers, ascending), the per-rank cap and training steps."""

    base: Workload
    ladder: tuple[int, ...]
    cap_mb: float
    steps: int


QUICK = Mode(Workload(hidden=256, layers=0, vocab=4000), ladder=(2, 24), cap_mb=210.0, steps=3)
FULL = Mode(Workload(hidden=512, layers=0, vocab=16000), ladder=(2, 8, 24), cap_mb=800.0, steps=4)



def _ideal_mb(rank: dict[str, Any], activations: dict[str, float]) -> float:
    """What this rank must hold: parameters, gradients, AdamW's two moments, and its activations."""
    pp, stage = rank["pipeline_parallel"], rank["pipeline_rank"]
    in_flight = min(pp - stage, rank["micro_batches"]) if pp > 1 else 1
    measured = activations[str(rank["tensor_parallel"])]
    per_sample = len(rank["layers_held"]) * measured["per_layer"] + (measured["head"] if rank["has_head"] else 0)
    return (4 * rank["param_bytes"] + rank["micro_batch"] * in_flight * per_sample) / MIB


def worst_rank_trace(rank: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank's memory at each traced point, in MiB above its baseline (heap free absolute): resident, peak,
    resident file pages (library code first touched after the baseline), freed-but-kept heap and live heap."""
    def above(value: Optional[float], base: Optional[float]) -> Optional[float]:
        return None if value is None or base is None else round(value - base, 1)

    return [{"at": at, "rss": above(rss, rank["baseline_mb"]), "peak": above(hwm, rank["baseline_mb"]),
             "rss_file": above(rss_file, rank["baseline_file_mb"]), "heap_free": above(free, 0.0),
             "heap_in_use": above(in_use, rank["baseline_heap_in_use_mb"])}
            for at, rss, hwm, rss_file, free, in_use in rank["trace"]]


def train_leg(leg: Leg, workload: Workload, steps: int, cap_mb: float,
              activations: dict[str, float]) -> dict[str, Any]:
    """One leg on one model in fresh ranks: a memory row (or the error that stopped it)."""
    row: dict[str, Any] = {"section": "memory", "leg": leg.name, "strategy": leg.strategy, "ranks": leg.world_size,
                           "layers": workload.layers, "params_m": workload.parameters() / 1e6}
    row["full_state_mb"] = 12 * workload.parameters() / MIB  # weights + AdamW's two moments, fp32
    started = time.perf_counter()
    try:
        ranks = run_distributed(train_rank, leg.world_size, args=(leg, workload, steps), timeout_s=RANK_TIMEOUT_S)
    except DistributedRunError as error:
        row.update(error=error_line(error), refused=leg.strategy in MAY_REFUSE)
        print(f"  {leg.name}, {workload.layers} layers: {'refused' if row['refused'] else 'FAILED'}: {row['error']}",
              flush=True)
        return row
    used = [rank["peak_mb"] - rank["baseline_mb"] for rank in ranks]
    ideal = [_ideal_mb(rank, activations) for rank in ranks]
    worst = max(range(len(ranks)), key=lambda i: used[i] / ideal[i])
    row.update(
        baseline_mb=[round(rank["baseline_mb"], 1) for rank in ranks], peak_mb=[round(r["peak_mb"], 1) for r in ranks],
        used_mb=[round(u, 1) for u in used], ideal_mb=[round(i, 1) for i in ideal],
        param_mb=[round(rank["param_bytes"] / MIB, 1) for rank in ranks], max_used_mb=max(used),
        peak_over_ideal=used[worst] / ideal[worst], worst_rank=worst, under_cap=max(used) <= cap_mb,
        tcache_off=[rank["tcache_off"] for rank in ranks],
        completed_steps=min(len(rank["step_s"]) for rank in ranks), of_steps=steps,
        step_s=max(max(rank["step_s"][1:] or rank["step_s"]) for rank in ranks), error=None, refused=False,
        worst_rank_trace_mb=worst_rank_trace(ranks[worst]),
    )
    print(f"  {leg.name}, {workload.layers} layers ({row['params_m']:.1f} M params): max used "
          f"{row['max_used_mb']:.0f} MiB, peak/ideal {row['peak_over_ideal']:.2f} "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    return row


def select_legs(names: Optional[list[str]]) -> tuple[Leg, ...]:
    """The legs ``names`` picks (all without it), each named in full or without its ``merak3d`` prefix."""
    if not names:
        return LEGS
    known = {alias: leg for leg in LEGS for alias in (leg.name, leg.name.removeprefix("merak3d "))}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"--legs: no leg named {unknown}; the legs are {[leg.name for leg in LEGS]}")
    return tuple(leg for leg in LEGS if any(known[name] is leg for name in names))


def memory(mode: Mode, activations: dict[str, dict[str, float]],
           legs: tuple[Leg, ...] = LEGS) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each leg on every rung, largest first (a leg that errors stops there): every run's row, and each
    leg's largest rung under the cap. Every rung, because a goal is the worst case over the ladder.

    ``activations``: per tensor-parallel degree, the measured activation bytes per sample.
    """
    runs, largest = [], []
    for leg in legs:
        rows = []
        for layers in sorted(mode.ladder, reverse=True):
            rows.append(train_leg(leg, replace(mode.base, layers=layers), mode.steps, mode.cap_mb, activations))
            if rows[-1]["error"] is not None:
                break
        runs.extend(rows)
        fitted = next((row for row in rows if row["error"] is None and row["under_cap"]), None)
        largest.append({
            "section": "largest", "leg": leg.name, "ranks": leg.world_size, "cap_mb": mode.cap_mb,
            "layers": fitted["layers"] if fitted else None, "params_m": fitted["params_m"] if fitted else None,
            "full_state_mb": fitted["full_state_mb"] if fitted else None,
            "full_state_exceeds_cap": fitted["full_state_mb"] > mode.cap_mb if fitted else None,
            "max_used_mb": fitted["max_used_mb"] if fitted else None,
            "error": rows[0]["error"], "refused": rows[0]["refused"],
        })
    return runs, largest


def peak_over_ideal_by_config(runs: list[dict[str, Any]], legs: tuple[Leg, ...] = DEFAULT_LEGS
                              ) -> dict[str, Optional[float]]:
    """``peak_over_ideal`` of each of ``legs`` on each rung it ran, by "LEG, N layers" (None where it failed)."""
    names = {leg.name for leg in legs}
    return {f"{row['leg']}, {row['layers']} layers": row.get("peak_over_ideal") for row in runs
            if row["leg"] in names}


def goal_records(launched: Optional[list[dict[str, Any]]], external: Optional[list[dict[str, Any]]],
                 legs: tuple[Leg, ...]) -> list[dict[str, Any]]:
    """The run's goals over the default layouts among ``legs``, from the memory rows of ranks started with the
    launcher's heap settings (``launched``) and without them (``external``); None: that run was not made."""
    chosen = tuple(leg for leg in DEFAULT_LEGS if leg in legs)
    partial = None if chosen == DEFAULT_LEGS else f"only {[leg.name for leg in chosen]} (--legs)"
    return [worst_case(goal, peak_over_ideal_by_config(rows, chosen), note=partial)
            for goal, rows in ((PEAK_OVER_IDEAL, launched), (PEAK_OVER_IDEAL_WITHOUT_LAUNCHER_ENV, external))
            if rows is not None and chosen]


def without_heap_tunables(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` as a rank torchrun starts from a user's shell gets it: no :data:`HEAP_TUNABLES` in
    ``GLIBC_TUNABLES`` (other tunables kept; the variable dropped when nothing else is left)."""
    kept = [item for item in environ.get("GLIBC_TUNABLES", "").split(":")
            if item and item.split("=", 1)[0] not in HEAP_TUNABLES]
    env = {name: value for name, value in environ.items() if name != "GLIBC_TUNABLES"}
    return {**env, "GLIBC_TUNABLES": ":".join(kept)} if kept else env


def memory_without_launcher_env(quick: bool, legs: tuple[Leg, ...], work: Path) -> Optional[list[dict[str, Any]]]:
    """The memory section of ``legs`` in a fresh benchmark process whose ranks start with glibc's default heap.

    A separate process because every rank is forked from one forkserver, which reads ``GLIBC_TUNABLES`` once
    when it starts; None (with the reason printed) when that run failed.
    """
    out = work / "without_launcher_env.json"
    command = [sys.executable, "-m", "benchmarks.scale", "--rank-heap", "glibc", "--memory-only", "--out", str(out),
               "--legs", *(leg.name for leg in legs), *(["--quick"] if quick else [])]
    done = subprocess.run(command, env=without_heap_tunables(dict(os.environ)), check=False)
    if done.returncode != 0 or not out.exists():
        print(f"scale: the run without the launcher's heap settings failed (exit {done.returncode})", file=sys.stderr)
        return None
    return [row for row in json.loads(out.read_text())["rows"] if row["section"] == "memory"]


def _rel_err(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float((logits - reference).abs().max() / reference.abs().max())


def load_and_export(workload: Workload, directory: Path, work: Path,
                    legs: tuple[Leg, ...] = LOAD_LEGS) -> tuple[list[dict[str, Any]], Optional[float]]:
    """``from_pretrained`` here, then merak3d's sharded load in each layout; the export round trip's max |diff|."""
    from safetensors.torch import load_file

    from lightning_merak.hf import export_checkpoint

    tokens = torch.randint(workload.vocab, (workload.global_batch, workload.seq),
                           generator=torch.Generator().manual_seed(1))
    checkpoint_bytes = sum(file.stat().st_size for file in directory.glob("*.safetensors"))
    reference = from_pretrained_rank(0, 1, str(directory), tokens)
    rows = [{"section": "load", "leg": "from_pretrained (1 process)", "load_s": reference["load_s"],
             "call_s": reference["call_s"],
             "gb_per_s": checkpoint_bytes / reference["load_s"] / 1e9, "bytes_read_mb": checkpoint_bytes / MIB,
             "logits_rel_err": 0.0, "error": None}]
    print(f"  from_pretrained: {reference['load_s']:.2f} s", flush=True)
    exported_from = work / "merak3d.ckpt"
    for leg in legs:
        assert leg.merak is not None
        saving = leg.merak is PP_TP
        try:
            ranks = run_distributed(load_rank, leg.world_size, timeout_s=RANK_TIMEOUT_S,
                                    args=(str(directory), leg.merak, tokens, str(exported_from) if saving else None))
        except DistributedRunError as error:
            rows.append({"section": "load", "leg": leg.name, "error": error_line(error)})
            print(f"  {leg.name}: load FAILED: {rows[-1]['error']}", flush=True)
            continue
        seconds = max(rank["load_s"] for rank in ranks)
        rows.append({
            "section": "load", "leg": leg.name, "load_s": seconds, "gb_per_s": checkpoint_bytes / seconds / 1e9,
            "bytes_read_mb": sum(rank["bytes_read"] for rank in ranks) / MIB,
            "logits_rel_err": max(_rel_err(rank["logits"], reference["logits"]) for rank in ranks), "error": None,
        })
        print(f"  {leg.name}: {seconds:.2f} s, logits rel err {rows[-1]['logits_rel_err']:.2e}", flush=True)
    if not exported_from.exists():
        return rows, None  # the pp2×tp2 load failed; its row says why
    export_checkpoint(exported_from, work / "exported")
    original, exported = {}, {}
    for source, into in ((directory, original), (work / "exported", exported)):
        for file in sorted(source.glob("*.safetensors")):
            into.update(load_file(file))
    if sorted(original) != sorted(exported):
        raise RuntimeError(f"merak-export wrote tensors {sorted(set(exported) ^ set(original))} differently named "
                           "from the original checkpoint")
    roundtrip = max(float((exported[name].double() - tensor.double()).abs().max()) for name, tensor in original.items())
    return rows, roundtrip


def _ratio(value: Optional[float], base: Optional[float]) -> Optional[float]:
    return value / base if value is not None and base else None


def ratio_table(runs: list[dict[str, Any]], loads: list[dict[str, Any]], layers: int) -> list[dict[str, Any]]:
    """merak3d's worst-rank memory on the largest model against each baseline's on as many ranks, and its load
    speed."""
    at_top = {row["leg"]: row for row in runs if row["layers"] == layers and row["error"] is None}
    load = {row["leg"]: row for row in loads if row.get("error") is None}
    reference = load.get("from_pretrained (1 process)", {}).get("gb_per_s")
    table = []
    ran = {row["leg"] for row in runs}
    for leg in (leg for leg in LEGS if leg.strategy == "merak3d" and leg.name in ran):
        used = at_top.get(leg.name, {}).get("max_used_mb")
        table.append({
            "layout": leg.name, "ranks": leg.world_size, "used_mb": used,
            **{f"vs {short}": _ratio(used, at_top.get(name.format(leg.world_size), {}).get("max_used_mb"))
               for short, name, _ in BASELINES},
            "load GB/s vs from_pretrained": _ratio(load.get(leg.name, {}).get("gb_per_s"), reference),
        })
    return table


def layout_rows(runs: list[dict[str, Any]], loads: list[dict[str, Any]], layers: int) -> list[dict[str, Any]]:
    """One line per leg on the largest model: its worst rank's memory against its ideal, and its load speed."""
    load = {row["leg"]: row for row in loads}
    rows = []
    for run in (row for row in runs if row["layers"] == layers):
        worst = run.get("worst_rank")
        rows.append({
            "leg": run["leg"], "used_mb": None if worst is None else run["used_mb"][worst],
            "ideal_mb": None if worst is None else run["ideal_mb"][worst],
            "peak_over_ideal": run.get("peak_over_ideal"), "load_s": load.get(run["leg"], {}).get("load_s"),
            "gb_per_s": load.get(run["leg"], {}).get("gb_per_s"), "error": run["error"],
        })
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer steps")
    parser.add_argument("--out", type=Path, help=out_help("scale"))
    parser.add_argument("--legs", nargs="+", metavar="NAME",
                        help="run only these legs (default: all; output default scale.legs.json)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the one-GPU leg (benchmarks/_scale_gpu.py) instead of the CPU run")
    parser.add_argument("--rank-heap", choices=("merak3d", "glibc"), default="merak3d",
                        help="merak3d: ranks start with merak3d's glibc tunables, as its launcher starts "
                             "ranks (default); glibc: with glibc's defaults, as torchrun starts them")
    parser.add_argument("--memory-only", action="store_true",
                        help="the memory section alone (no load, no run without the launcher's heap settings)")
    args = parser.parse_args(argv)
    if args.rank_heap == "merak3d":
        export_heap_tunables()  # before the forkserver the ranks are forked from starts
    if args.device == "cuda":
        from benchmarks._scale_gpu import gpu_main

        return gpu_main(args.out or default_out("scale.gpu", args.quick), args.quick)
    legs = select_legs(args.legs)
    load_legs = () if args.memory_only else tuple(leg for leg in LOAD_LEGS if leg in legs)
    mode = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    started = time.perf_counter()
    top = replace(mode.base, layers=max(mode.ladder))
    degrees = sorted({(leg.merak or {}).get("tensor_parallel", 1) for leg in legs})
    activations = {str(tp): measure_activations(mode.base, tp) for tp in degrees}
    print(f"1./2. memory: {top.describe()} and down to {min(mode.ladder)} layers, "
          f"cap {mode.cap_mb:.0f} MiB per rank above the baseline", flush=True)
    runs, largest = memory(mode, activations, legs)
    loads: list[dict[str, Any]] = []
    roundtrip: Optional[float] = None
    external: Optional[list[dict[str, Any]]] = None
    with tempfile.TemporaryDirectory(prefix="merak-scale-") as tmp:
        work = Path(tmp)
        if load_legs:
            print(f"3. load: {top.describe()}, fp32", flush=True)
            torch.manual_seed(0)
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_config(top.config()).save_pretrained(work / "source")
            loads, roundtrip = load_and_export(top, work / "source", work, load_legs)
        default_legs = tuple(leg for leg in DEFAULT_LEGS if leg in legs)
        if args.rank_heap == "merak3d" and not args.memory_only and default_legs:
            print("4. memory of merak3d's default layouts, ranks started without the launcher's heap settings",
                  flush=True)
            external = memory_without_launcher_env(args.quick, default_legs, work)

    compact = tuple(leg for leg in LEGS if COMPACT in leg.name and leg in legs)
    compact_figures = [value for value in peak_over_ideal_by_config(runs, compact).values() if value is not None]
    step = {(row["leg"], row["layers"]): row["step_s"] for row in runs if row["strategy"] == "merak3d"
            and row["error"] is None}
    compact_step = [seconds / step[(leg.replace(COMPACT, ""), layers)] for (leg, layers), seconds in step.items()
                    if COMPACT in leg and (leg.replace(COMPACT, ""), layers) in step]
    errors = [row for row in runs + loads if row.get("error") and not row.get("refused")]
    rel_errs = [row["logits_rel_err"] for row in loads if row.get("error") is None and row["leg"].startswith("merak3d")]
    goals = goal_records(None, runs, legs) if args.rank_heap == "glibc" else goal_records(runs, external, legs)

    print(f"\nMemory per rank (measured; MiB above the baseline; cap {mode.cap_mb:.0f} MiB)")
    print_table(runs, ["leg", "layers", "params_m", "max_used_mb", "peak_over_ideal", "under_cap", "error"])
    if external is not None:
        print("\nWithout the launcher's heap settings (as torchrun starts ranks)")
        print_table(external, ["leg", "layers", "max_used_mb", "peak_over_ideal", "error"])
    print("\nLargest model under the cap")
    print_table(largest, ["leg", "layers", "params_m", "full_state_mb", "full_state_exceeds_cap", "max_used_mb",
                          "error"])
    print("\nLoad (measured)")
    print_table(loads, ["leg", "load_s", "gb_per_s", "bytes_read_mb", "logits_rel_err", "error"])
    print(f"\nRatios on the largest model ({top.layers} layers): merak3d's worst-rank memory / the baseline's "
          "on as many ranks")
    print_table(ratio_table(runs, loads, top.layers))
    print_goals(goals)
    wall_s = time.perf_counter() - started
    out = write_run(
        "scale", [*runs, *largest, *loads], "measured", goals, args.quick,
        # a run of some legs must not count as a full run
        out=args.out or (default_out("scale.legs", args.quick) if args.legs else None),
        benchmark="scale", mode="quick" if args.quick else "full", backend="gloo", threads_per_rank=1,
        rank_heap=args.rank_heap, rank_glibc_tunables=os.environ.get("GLIBC_TUNABLES"),
        steps=mode.steps, legs=[leg.name for leg in legs], cap_mb=mode.cap_mb, ladder_layers=list(mode.ladder),
        workload=top.describe(), activations_per_sample_mb_by_tp={k: {n: v / MIB for n, v in a.items()}
                                                                  for k, a in activations.items()},
        logits_max_rel_err=max(rel_errs) if rel_errs else None, export_roundtrip_max_abs=roundtrip,
        peak_over_ideal_compact=max(compact_figures) if compact_figures else None,
        compact_step_time_ratio_max=max(compact_step) if compact_step else None,
        without_launcher_env=external, layouts=layout_rows(runs, loads, top.layers),
        ratios=ratio_table(runs, loads, top.layers), wall_s=round(wall_s, 1),
    )
    print(f"\nwrote {out} in {wall_s:.0f} s")
    for row in errors:
        print(f"scale: {row['leg']} failed: {row['error']}", file=sys.stderr)
    return 1 if errors or (external is None and not args.memory_only and args.rank_heap == "merak3d"
                           and any(leg in legs for leg in DEFAULT_LEGS)) else 0


if __name__ == "__main__":
    sys.exit(main())
