"""merak3d at scale on this CPU: per-rank memory against its share, the largest model under a cap, load speed.

Run from the repo root::

    python -m benchmarks.scale [--quick] [--out PATH] [--legs NAME ...] [--device cpu|cuda] [--rank-heap merak3d|glibc]

``--legs`` runs only the named legs (``pp2xtp2``, ``"tp2 (compact host memory)"``, ``DDP``: a leg's name, with
or without its ``merak3d`` prefix), for investigating one layout; the load section then covers only those
merak3d layouts (none: skipped).

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
   stage). ``peak_over_ideal`` is the worst rank's (peak − baseline) / ideal over merak3d's
   default legs: dp2, pp2, tp2 (2 ranks) and pp2×tp2 (4 ranks) under meta init
   (``configure_model``); ``peak_over_ideal_compact`` the same with ``compact_host_memory=True``
   (glibc returns freed memory at once), and ``compact_step_time_ratio_max`` what that costs in
   step time (the largest ratio over the layouts). Each row's ``worst_rank_trace_mb`` follows its worst
   rank through setup, each step's forward and backward, and each optimizer step: resident and peak
   memory above the baseline, and ``heap_free``, the freed-but-kept heap (glibc's ``mallinfo2``) that
   resident memory holds beyond live allocations. Baselines: Lightning's
   ModelParallelStrategy (FSDP2 ``fully_shard``, meta init via ``trainer.init_module(empty_init=True)``;
   Lightning materialises it with ``reset_parameters()``, which RMSNorm and rotary buffers lack, so
   its losses mean nothing, while its memory does);
   DeepSpeed ZeRO-3 through ``deepspeed.initialize`` (Lightning's DeepSpeedStrategy refuses CPU),
   reported as ``refused`` with its error if it cannot run here; plain DDP, everything replicated.
2. *Largest model under a cap.* Models grow by decoder layers (the ladder); each leg runs from the
   largest down until its worst rank's (peak − baseline) fits ``cap_mb``. The largest rung's
   weights plus AdamW state exceed the cap, so training it at all needs the model split.
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
baselines included. ``--rank-heap glibc`` starts them with glibc's defaults instead, as ranks another launcher
starts (merak3d ranks still turn fast bins off at setup; the forkserver every rank is forked from reads the
variable once, so one run measures one setting).

``--device cuda`` runs the GPU leg instead (``benchmarks/_scale_gpu.py``: one GPU, one rank per
leg, written to ``scale.gpu.json``).

Figures are measured on this machine (label "measured"; CPU, gloo). A leg that errors makes the
command exit 1, except a baseline that refuses this machine (ZeRO-3), which is recorded.
"""

from __future__ import annotations

import argparse
import os
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
from benchmarks.report import default_out, error_line, out_help, print_table, write_json
from lightning_merak.distributed.host_memory import export_heap_tunables
from lightning_merak.testing import run_distributed
from lightning_merak.testing.distributed import DistributedRunError

PEAK_OVER_IDEAL_GOAL = 1.3
PP_TP = {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 2, "micro_batches": 2}
MERAK_LAYOUTS = (
    ("dp2", 2, {"data_parallel": 2}),
    ("pp2", 2, {"data_parallel": 1, "pipeline_parallel": 2, "micro_batches": 2}),
    ("tp2", 2, {"data_parallel": 1, "tensor_parallel": 2}),
    ("pp2xtp2", 4, PP_TP),
)
COMPACT = " (compact host memory)"
LEGS = (
    *(Leg(f"merak3d {name}", "merak3d", ranks, merak) for name, ranks, merak in MERAK_LAYOUTS),
    *(Leg(f"merak3d {name}{COMPACT}", "merak3d", ranks, {**merak, "compact_host_memory": True})
      for name, ranks, merak in MERAK_LAYOUTS),
    Leg("FSDP2 (ModelParallelStrategy)", "fsdp2", 2),
    Leg("DeepSpeed ZeRO-3", "zero3", 2),
    Leg("DDP", "ddp", 2),
)
MAY_REFUSE = {"zero3"}
LOAD_LEGS = LEGS[:4]
"""merak3d's default layouts, which the load section also runs."""
"""Baselines whose refusal to run on this machine is a result, not a failure."""


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
        completed_steps=min(len(rank["step_s"]) for rank in ranks), of_steps=steps,
        step_s=max(max(rank["step_s"][1:] or rank["step_s"]) for rank in ranks), error=None, refused=False,
        worst_rank_trace_mb=[{"at": at, "rss": round(rss - ranks[worst]["baseline_mb"], 1),
                              "peak": round(hwm - ranks[worst]["baseline_mb"], 1),
                              "heap_free": None if free is None else round(free, 1)}
                             for at, rss, hwm, free in ranks[worst]["trace"]],
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
    """Each leg from the largest rung down until it fits the cap: every run's row, and each leg's largest.

    ``activations``: per tensor-parallel degree, the measured activation bytes per sample.
    """
    runs, largest = [], []
    for leg in legs:
        fitted: Optional[dict[str, Any]] = None
        for layers in sorted(mode.ladder, reverse=True):
            row = train_leg(leg, replace(mode.base, layers=layers), mode.steps, mode.cap_mb, activations)
            runs.append(row)
            if row["error"] is not None or row["under_cap"]:
                fitted = row if row["error"] is None else None
                break
        top = next(row for row in runs if row["leg"] == leg.name)
        largest.append({
            "section": "largest", "leg": leg.name, "cap_mb": mode.cap_mb,
            "layers": fitted["layers"] if fitted else None, "params_m": fitted["params_m"] if fitted else None,
            "full_state_mb": fitted["full_state_mb"] if fitted else None,
            "full_state_exceeds_cap": fitted["full_state_mb"] > mode.cap_mb if fitted else None,
            "max_used_mb": fitted["max_used_mb"] if fitted else None,
            "error": top["error"], "refused": top["refused"],
        })
    return runs, largest


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
    """merak3d's worst-rank memory on the largest model against each baseline's, and its load speed."""
    at_top = {row["leg"]: row for row in runs if row["layers"] == layers and row["error"] is None}
    load = {row["leg"]: row for row in loads if row.get("error") is None}
    reference = load.get("from_pretrained (1 process)", {}).get("gb_per_s")
    table = []
    baselines = {"FSDP2": "fsdp2", "ZeRO-3": "zero3", "DDP": "ddp"}
    baseline_leg = {name: next(leg.name for leg in LEGS if leg.strategy == strategy)
                    for name, strategy in baselines.items()}
    for leg in (leg for leg in LEGS if leg.strategy == "merak3d"):
        used = at_top.get(leg.name, {}).get("max_used_mb")
        table.append({
            "layout": leg.name, "used_mb": used,
            **{f"vs {name}": _ratio(used, at_top.get(full, {}).get("max_used_mb"))
               for name, full in baseline_leg.items()},
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
                             "ranks (default); glibc: with glibc's defaults")
    args = parser.parse_args(argv)
    if args.rank_heap == "merak3d":
        export_heap_tunables()  # before the forkserver the ranks are forked from starts
    if args.device == "cuda":
        from benchmarks._scale_gpu import gpu_main

        return gpu_main(args.out or default_out("scale.gpu", args.quick), args.quick)
    legs = select_legs(args.legs)
    load_legs = tuple(leg for leg in LOAD_LEGS if leg in legs)
    # a run of some legs must not overwrite the full run's figures
    args.out = args.out or default_out("scale.legs" if args.legs else "scale", args.quick)
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
    if load_legs:
        print(f"3. load: {top.describe()}, fp32", flush=True)
        with tempfile.TemporaryDirectory(prefix="merak-scale-") as tmp:
            work = Path(tmp)
            torch.manual_seed(0)
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_config(top.config()).save_pretrained(work / "source")
            loads, roundtrip = load_and_export(top, work / "source", work, load_legs)

    merak_top = [row for row in runs if row["strategy"] == "merak3d" and row["layers"] == top.layers
                 and row["error"] is None]
    worst = max((row for row in merak_top if COMPACT not in row["leg"]), key=lambda row: row["peak_over_ideal"],
                default=None)
    worst_compact = max((row for row in merak_top if COMPACT in row["leg"]), key=lambda row: row["peak_over_ideal"],
                        default=None)
    step = {row["leg"]: row["step_s"] for row in merak_top}
    compact_step = [step[leg] / step[leg.replace(COMPACT, "")] for leg in step
                    if COMPACT in leg and leg.replace(COMPACT, "") in step]
    errors = [row for row in runs + loads if row.get("error") and not row.get("refused")]
    rel_errs = [row["logits_rel_err"] for row in loads if row.get("error") is None and row["leg"].startswith("merak3d")]

    print(f"\nMemory per rank (measured; MiB above the baseline; cap {mode.cap_mb:.0f} MiB)")
    print_table(runs, ["leg", "layers", "params_m", "max_used_mb", "peak_over_ideal", "under_cap", "error"])
    print("\nLargest model under the cap")
    print_table(largest, ["leg", "layers", "params_m", "full_state_mb", "full_state_exceeds_cap", "max_used_mb",
                          "error"])
    print("\nLoad (measured)")
    print_table(loads, ["leg", "load_s", "gb_per_s", "bytes_read_mb", "logits_rel_err", "error"])
    print(f"\nRatios on the largest model ({top.layers} layers): merak3d's worst-rank memory / the baseline's")
    print_table(ratio_table(runs, loads, top.layers))
    wall_s = time.perf_counter() - started
    out = write_json(
        args.out, [*runs, *largest, *loads], label="measured", benchmark="scale", quick=args.quick, backend="gloo",
        threads_per_rank=1, rank_glibc_tunables=os.environ.get("GLIBC_TUNABLES"), steps=mode.steps,
        legs=[leg.name for leg in legs], cap_mb=mode.cap_mb,
        ladder_layers=list(mode.ladder),
        workload=top.describe(), activations_per_sample_mb_by_tp={k: {n: v / MIB for n, v in a.items()}
                                                                  for k, a in activations.items()},
        logits_max_rel_err=max(rel_errs) if rel_errs else None, export_roundtrip_max_abs=roundtrip,
        peak_over_ideal=worst["peak_over_ideal"] if worst else None,
        peak_over_ideal_layout=worst["leg"] if worst else None, peak_over_ideal_goal=PEAK_OVER_IDEAL_GOAL,
        peak_over_ideal_compact=worst_compact["peak_over_ideal"] if worst_compact else None,
        peak_over_ideal_compact_layout=worst_compact["leg"] if worst_compact else None,
        compact_step_time_ratio_max=max(compact_step) if compact_step else None,
        layouts=layout_rows(runs, loads, top.layers), ratios=ratio_table(runs, loads, top.layers),
        wall_s=round(wall_s, 1),
    )
    print(f"\nwrote {out} in {wall_s:.0f} s")
    for row in errors:
        print(f"scale: {row['leg']} failed: {row['error']}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
