"""Every named transformers-5 MoE family under ``merak_ep``: swap equality and step time (#30, goals of #49).

    python -m benchmarks.moe_families [--quick] [--device cpu|cuda] [--families F ...] [--out FILE]

``--device cpu`` (default): two gloo ranks at ep=2, per family (tiny configs from each config class, fp32) the
largest difference of outputs and parameter gradients from the unswapped model (its ``eager`` loop), the bytes of
expert tensors each rank holds, and the training-step time of ours (``merak_ep`` at its defaults) against the
unswapped model at transformers' default experts implementation (``default``: the model built without
``experts_implementation``; the implementation transformers picked is recorded per row, ``grouped_mm`` in
transformers 5.24) and its ``eager`` loop, on the same ranks under the same data-parallel gradient average.
Variants run interleaved step by step; at ep=2 a speedup is the median over rounds of the per-round
ratio of step times (each the slowest rank's), with the ratio of median steps
(``*_of_medians``) and of fastest steps (``*_fastest``) beside it; the goal's leg times each family for at least
:data:`GOAL_LEG_SECONDS`. The goal's workload is each family at its own routing shape (``routing="family"``: the
config class's expert count, top-k, groups and sparse layers, 8-256 experts, top-2 to top-8) and its own width
proportions (``intermediate="family"``: the class's intermediate sizes scaled to hidden 128) — what an exchange
costs against the expert work it moves; ``few_experts`` repeats it with the tests' 8-16 experts at their narrow
widths, and ``large`` with those at hidden 256 and every intermediate size 512. ``pp2_ep2`` (few experts): four
gloo ranks, merak3d pipeline_parallel=2 × data_parallel=2, each stage's experts spread over its two
data-parallel ranks, against the unswapped model (default implementation, eager) in the same layout
(``benchmarks._moe_families_pp2``). ``--device cuda``: the single-GPU leg (ep=1, one process; bf16 and fp32),
see ``benchmarks._moe_families_gpu``. A family that fails is a row with its error and the command exits non-zero
after writing the JSON. The goals (:data:`GOALS`) are each the worst case over every family of every leg they
name; the ranks start with the launcher's heap settings (``export_heap_tunables``), baselines and ours alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from benchmarks.goals import Goal, print_goals, worst_case, write_run
from benchmarks.report import cuda_device_name, out_help, print_table

NAME = "moe_families"
TOLERANCE = 1e-5
EP = 2
EP2_LEGS = ("family_widths", "few_experts", "large")
"""The ep=2 legs every ep=2 goal takes its worst case over: the families' own routing and widths, the tests' 8-16
experts at narrow widths, and those at hidden 256 with intermediate 512."""

SPEEDUP_VS_DEFAULT = Goal(
    "speedup_vs_default_min", 1.0, ">=",
    "merak_ep at ep=2 (2 gloo ranks, defaults) over the same model and ranks at transformers' default experts "
    "implementation (experts_implementation not set) with every expert on every rank and the same gradient "
    "average: median over interleaved rounds of the per-round step ratio (slowest rank's), worst over families × "
    "{family widths, narrow widths, large}", 49)
EXPERT_BYTES_RATIO = Goal(
    "expert_bytes_ratio", 1 / EP + 0.05, "<=",
    "bytes of expert tensors a rank holds under merak_ep at ep=2 over the full model's expert bytes, the largest "
    "rank's, worst (max) over families × {family widths, narrow widths, large}; target 1/ep + 0.05", 49)
PP2_EP2_VS_DEFAULT = Goal(
    "pp2_ep2_vs_default_min", 0.9, ">=",
    "merak3d pipeline_parallel=2 × data_parallel=2 (4 gloo ranks) with merak_ep over the same layout with the "
    "model's experts untouched at transformers' default experts implementation: ratio of median steps (slowest "
    "rank's), worst over families (few experts, narrow widths)", 49)
MAX_OUTPUT_DIFF = Goal(
    "max_output_diff", TOLERANCE, "<=",
    "largest |logits difference| of merak_ep at ep=2 from the unswapped eager model (fp32), worst over families × "
    "{family widths, narrow widths, large}", 30)
MAX_GRAD_DIFF = Goal(
    "max_grad_diff", TOLERANCE, "<=",
    "largest |parameter gradient difference| of merak_ep at ep=2 from the unswapped eager model (fp32, local "
    "experts' slices), worst over families × {family widths, narrow widths, large}", 30)
GOALS = (SPEEDUP_VS_DEFAULT, EXPERT_BYTES_RATIO, PP2_EP2_VS_DEFAULT, MAX_OUTPUT_DIFF, MAX_GRAD_DIFF)
GOAL_LEG_SECONDS = 20.0
"""Least timed seconds per family in the goal's leg (full runs)."""


def _families() -> list[str]:
    from lightning_merak.plugins.moe.experts import EXACT_FAMILIES

    return list(EXACT_FAMILIES)


def _family_rows(per_rank: list[list[dict[str, Any]]],
                 row_of: Callable[[dict[str, Any], list[dict[str, Any]], dict[str, float], dict[str, float]],
                                  dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per family from every rank's rows: a rank's error, or ``row_of(first rank's row, every rank's row,
    median step ms, fastest step ms)`` with each time the slowest rank's."""
    rows = []
    for index, row in enumerate(per_rank[0]):
        peers = [ranks[index] for ranks in per_rank]
        errors = [p["error"] for p in peers if "error" in p]
        if errors:
            rows.append({"family": row["family"], "error": errors[0]})
            continue
        step = {name: max(p["step_ms"][name] for p in peers) for name in row["step_ms"]}
        fastest = {name: max(p["step_min_ms"][name] for p in peers) for name in row["step_min_ms"]}
        rows.append(row_of(row, peers, step, fastest))
    return rows


def _ep2_rows(families: list[str], size: dict[str, Any], warmup: int, steps: int) -> list[dict[str, Any]]:
    """One row per family from two gloo ranks at ep=2 (``benchmarks._moe_families_ranks``)."""
    from benchmarks._moe_families_ranks import run_all
    from lightning_merak.testing import run_distributed

    per_rank = run_distributed(run_all, EP, args=(families, size, warmup, steps), timeout_s=1800)

    def family_row(row: dict[str, Any], peers: list[dict[str, Any]], step: dict[str, float],
                   fastest: dict[str, float]) -> dict[str, Any]:
        return {
            "family": row["family"], "num_experts": row["num_experts"], "top_k": row["top_k"],
            "widths": row["widths"], "experts_per_rank": row["local_experts"],
            "default_implementation": row["default_implementation"],
            "output_diff": max(p["output_diff"] for p in peers), "grad_diff": max(p["grad_diff"] for p in peers),
            "default_diff": max(p["default_diff"] for p in peers),
            "grads_missing": sorted({n for p in peers for n in p["grads_missing"]}),
            "expert_bytes_ratio": max(p["expert_bytes"] / p["expert_bytes_full"] for p in peers),
            "timed_steps": len(row["steps_ms"]["ours"]), "step_ms": step, "step_min_ms": fastest,
            "speedup_vs_default": _paired_speedup(peers, "default"),
            "speedup_vs_eager": _paired_speedup(peers, "eager"),
            "speedup_vs_default_of_medians": step["default"] / step["ours"],
            "speedup_vs_eager_of_medians": step["eager"] / step["ours"],
            "speedup_vs_default_fastest": fastest["default"] / fastest["ours"],
            "speedup_vs_eager_fastest": fastest["eager"] / fastest["ours"],
            "exchange_cost": step["ours"] / step["ours_grouped_no_ep"],
            "replicated_diff": max(p["replicated_diff"] for p in peers),
            "replicated_over_ours": step["ours_replicated"] / step["ours"],
        }

    return _family_rows(per_rank, family_row)


def _paired_speedup(peers: list[dict[str, Any]], baseline: str) -> float:
    """Median over timed rounds of ``baseline``'s step over ours in the same round, each the slowest rank's.

    The variants run back to back in every round, so a round's ratio sees one load; its median over rounds is
    steadier on a shared machine than a ratio of two medians taken over different moments.
    """
    slowest = {name: [max(values) for values in zip(*(p["steps_ms"][name] for p in peers))]
               for name in (baseline, "ours")}
    return statistics.median(b / o for b, o in zip(slowest[baseline], slowest["ours"]))


def _by_config(legs: dict[str, list[dict[str, Any]]], key: str) -> dict[str, float | None]:
    """``key`` of every family row of ``legs`` as ``leg/family``; a failed row (no ``key``) is None."""
    return {f"{leg}/{row['family']}": row.get(key) for leg, rows in legs.items() for row in rows}


def compute_goals(ep2_legs: dict[str, list[dict[str, Any]]], pp2_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every goal of :data:`GOALS` for one run: each the worst case over the configurations it names.

    ``ep2_legs`` maps each of :data:`EP2_LEGS` to its family rows; ``pp2_rows`` are the pp=2 × ep=2 leg's rows.
    """
    if set(ep2_legs) != set(EP2_LEGS):
        raise ValueError(f"ep=2 goals need the legs {EP2_LEGS}, got {sorted(ep2_legs)}")
    return [
        worst_case(SPEEDUP_VS_DEFAULT, _by_config(ep2_legs, "speedup_vs_default")),
        worst_case(EXPERT_BYTES_RATIO, _by_config(ep2_legs, "expert_bytes_ratio")),
        worst_case(PP2_EP2_VS_DEFAULT, _by_config({"pp2_ep2": pp2_rows}, "speedup_vs_default")),
        worst_case(MAX_OUTPUT_DIFF, _by_config(ep2_legs, "output_diff")),
        worst_case(MAX_GRAD_DIFF, _by_config(ep2_legs, "grad_diff")),
    ]


def _speedups(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The slowest family's speedups over each baseline: the goal's statistic and fastest steps beside it."""
    ok = [r for r in rows if "error" not in r]
    return {f"speedup_vs_{name}_min{stat}": min((r[f"speedup_vs_{name}{stat}"] for r in ok), default=None)
            for name in ("default", "eager") for stat in ("", "_fastest")}


def leg_sizes(quick: bool) -> dict[str, dict[str, Any]]:
    """Each ep=2 leg's model and batch size (the pp=2 × ep=2 leg runs ``few_experts``')."""
    size = {"hidden": 64, "layers": 2, "vocab": 128, "batch": 2, "seq": 32} if quick else \
        {"hidden": 128, "layers": 2, "vocab": 256, "batch": 4, "seq": 64}
    # a cheap family's step (Mixtral's: tens of ms) moves by ±30% with the machine's load, so the family-widths
    # leg times it for at least GOAL_LEG_SECONDS (up to 4× the steps) while the 0.3-5 s families keep their count
    return {"family_widths": {**size, "routing": "family", "intermediate": "family",
                              "min_seconds": 0.0 if quick else GOAL_LEG_SECONDS},
            "few_experts": size, "large": {**size, "hidden": 256, "intermediate": 512}}


def _cpu_leg(quick: bool, families: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The three ep=2 legs and pp=2 × ep=2: the family-widths rows, this run's goals and everything else."""
    from lightning_merak.distributed.host_memory import export_heap_tunables
    from lightning_merak.plugins.moe.experts import REFUSED_FAMILIES

    export_heap_tunables()  # as merak3d's launcher starts its ranks; before the forkserver the ranks come from starts
    sizes = leg_sizes(quick)
    warmup, steps = (1, 9) if quick else (3, 25)
    # the eager loop's step at 60-256 experts is 0.3-5 s (a zero-filled [E, ...] gradient per expert), so the
    # family-widths leg runs fewer steps to keep a full run under ten minutes
    repeats = {"family_widths": (1, 9) if quick else (1, 11), "few_experts": (warmup, steps), "large": (warmup, steps)}
    legs = {leg: _ep2_rows(families, sizes[leg], *repeats[leg]) for leg in EP2_LEGS}
    pp2_ep2 = _pp2_leg(families, sizes["few_experts"], warmup, steps)
    rows = legs["family_widths"]
    every = [r for leg in legs.values() for r in leg]
    ok = [r for r in every if "error" not in r]
    inexact = {r["family"] for r in every if "error" in r
               or max(r["output_diff"], r["grad_diff"]) > TOLERANCE or r["grads_missing"]}
    exact = [family for family in families if family not in inexact]
    summary = {
        "families_exact": exact,
        "families_refused": dict(REFUSED_FAMILIES),
        "families_failed": {r["family"]: r["error"] for r in rows if "error" in r},
        "default_implementations": sorted({r["default_implementation"] for r in ok}
                                          | {r["default_implementation"] for r in pp2_ep2["rows"] if "error" not in r}),
        "max_replicated_diff": max((r["replicated_diff"] for r in ok), default=None),
        **_speedups(rows),
        "statistic": "speedup_vs_*: median over rounds of the per-round ratio (variants back to back each round, "
                     "each the slowest rank's step; pp2_ep2: ratio of medians); step_ms: median step after "
                     "warm-up, *_of_medians: their ratio; *_fastest: fastest steps",
        "ours": "merak_ep (experts_implementation='merak_ep') at its defaults: no replicas, no block-scope Lancet",
        "baseline": "default: the unswapped model built without experts_implementation (transformers' default, "
                    "recorded per row as default_implementation), every expert on every rank; eager: its expert "
                    "loop, the exactness reference",
        "rank_glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "ep": EP, "world_size": EP, "backend": "gloo", "size": sizes["family_widths"],
        "steps": repeats["family_widths"][1],
        "few_experts": _second_leg(sizes["few_experts"], legs["few_experts"], steps),
        "large": _second_leg(sizes["large"], legs["large"], steps),
        "pp2_ep2": pp2_ep2,
    }
    return rows, compute_goals(legs, pp2_ep2["rows"]), summary


def _second_leg(size: dict[str, Any], rows: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """An ep=2 leg beside the family-widths one: its size, rows, slowest-family speedups and failures."""
    return {"size": size, "steps": steps, "rows": rows, **_speedups(rows),
            "families_failed": {r["family"]: r["error"] for r in rows if "error" in r}}


def _pp2_leg(families: list[str], size: dict[str, Any], warmup: int, steps: int) -> dict[str, Any]:
    """pp=2 × ep=2 on 4 ranks (merak3d): per family, loss difference from the unswapped model and step times."""
    from benchmarks._moe_families_pp2 import run_all
    from lightning_merak.testing import run_distributed
    from lightning_merak.testing.cpu_quota import device_per_rank_quota, emulation_record

    quota = device_per_rank_quota(4)  # one device per rank: 4 ranks on fewer cores get a fixed CPU share each
    per_rank = run_distributed(run_all, 4, args=(families, size, warmup, steps), timeout_s=1800, cpu_quota=quota)
    rows = _family_rows(per_rank, lambda row, peers, step, fastest: {
        "family": row["family"], "default_implementation": row["default_implementation"],
        "loss_diff": max(p["loss_diff"] for p in peers),
        "default_loss_diff": max(p["default_loss_diff"] for p in peers),
        "step_ms": step, "step_min_ms": fastest,
        "speedup_vs_default": step["default"] / step["ours"], "speedup_vs_eager": step["eager"] / step["ours"],
        "speedup_vs_default_fastest": fastest["default"] / fastest["ours"],
        "speedup_vs_eager_fastest": fastest["eager"] / fastest["ours"]})
    ok = [r for r in rows if "error" not in r]
    return {"status": "measured" if len(ok) == len(rows) else "failed", "world_size": 4, "pipeline_parallel": 2,
            "ep": EP, "steps": steps, "rows": rows, "rank_cpu": emulation_record(quota, 4),
            "families_failed": {r["family"]: r["error"] for r in rows if "error" in r},
            "max_loss_diff": max((r["loss_diff"] for r in ok), default=None),
            **_speedups(rows)}


def _gpu_leg(quick: bool, families: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The single-GPU leg: ep=1, so none of :data:`GOALS` (all ep=2) is taken from it."""
    from benchmarks._moe_families_gpu import run_gpu

    device_name = cuda_device_name()
    rows = run_gpu(families, quick)
    ok = [r for r in rows if "error" not in r]
    fp32 = [r for r in ok if r["dtype"] == "float32"]
    summary = {
        "device_name": device_name, "ep": 1,
        "families_failed": {f"{r['family']}/{r['dtype']}": r["error"] for r in rows if "error" in r},
        "default_implementations": sorted({r["default_implementation"] for r in ok}),
        "max_output_diff_fp32": max((r["output_diff_vs_eager"] for r in fp32), default=None),
        **{f"speedup_vs_{name}_min": min((r[f"speedup_vs_{name}"] for r in ok if r[f"speedup_vs_{name}"]),
                                         default=None) for name in ("default", "eager")},
        "baselines_failed": {f"{r['family']}/{r['dtype']}/{k.removesuffix('_error')}": v
                             for r in ok for k, v in r.items() if k.endswith("_error")},
    }
    return rows, [], summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer steps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--families", nargs="+", choices=_families(), default=None,
                        help="only these families (a targeted run; the committed JSON covers all)")
    parser.add_argument("--out", default=None, help=out_help(NAME))
    args = parser.parse_args(argv)
    if args.families and not (args.quick or args.out):
        parser.error("--families runs part of the families, so it must not join the goals' full runs; write it "
                     "elsewhere with --out PATH (or --quick)")
    families = args.families or _families()
    rows, goals, summary = (_gpu_leg if args.device == "cuda" else _cpu_leg)(args.quick, families)
    table = [{"family": r["family"], **({"dtype": r["dtype"]} if "dtype" in r else {}),
              "diff": r.get("output_diff", r.get("output_diff_vs_eager")),
              **{f"{k}_ms": v for k, v in r.get("step_ms", {}).items()},
              "vs_default": r.get("speedup_vs_default"), "vs_eager": r.get("speedup_vs_eager"),
              "error": r.get("error", "")[:60]} for r in rows]
    print_table(table)
    for leg in ("few_experts", "large"):
        for row in summary.get(leg, {}).get("rows", []):
            print(f"{leg} {row['family']}: " + (row["error"][:80] if "error" in row else
                  f"diff {row['output_diff']:.1e}, step ms "
                  f"{', '.join(f'{k} {v:.1f}' for k, v in row['step_ms'].items())}, ours vs default "
                  f"{row['speedup_vs_default']:.2f}×, vs eager {row['speedup_vs_eager']:.2f}×"))
    for row in summary.get("pp2_ep2", {}).get("rows", []):
        print(f"pp2×ep2 {row['family']}: " + (row["error"][:80] if "error" in row else
              f"loss diff {row['loss_diff']:.1e}, ours vs default {row['speedup_vs_default']:.2f}×, "
              f"vs eager {row['speedup_vs_eager']:.2f}×"))
    print_goals(goals)
    name = NAME if args.device == "cpu" else f"{NAME}.gpu"
    path = write_run(name, rows, "measured", goals, args.quick, Path(args.out) if args.out else None,
                     device=args.device, **summary)
    print(f"wrote {path}")
    failed = [r for r in rows if "error" in r] + [family for leg in ("pp2_ep2", "few_experts", "large")
                                                  for family in summary.get(leg, {}).get("families_failed", {})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
