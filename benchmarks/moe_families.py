"""Every named transformers-5 MoE family under ``merak_ep``: swap equality and step time (#30).

    python -m benchmarks.moe_families [--quick] [--device cpu|cuda] [--families F ...] [--out FILE]

``--device cpu`` (default): two gloo ranks at ep=2, per family (tiny configs from each config class, fp32) the
largest difference of outputs and parameter gradients from the unswapped model, and the training-step time of
ours (``merak_ep``) against the unswapped model's own expert loop (``eager``) and its ``grouped_mm``
implementation on the same ranks. Variants run interleaved step by step; at ep=2 a speedup is the median over
rounds of the per-round ratio of step times (each the slowest rank's), with the ratio of median steps
(``*_of_medians``) and of fastest steps (``*_fastest``) beside it; the goal's leg times each family for at least
:data:`GOAL_LEG_SECONDS`. The goal's workload is each family at its own routing shape (``routing="family"``: the
config class's expert count, top-k, groups and sparse layers, 8-256 experts, top-2 to top-8) and its own width
proportions (``intermediate="family"``: the class's intermediate sizes scaled to hidden 128) — what an exchange
costs against the expert work it moves; ``few_experts`` repeats it with the tests' 8-16 experts at their narrow
widths, and ``large`` with those at hidden 256 and every intermediate size 512. ``pp2_ep2`` (few experts): four
gloo ranks, merak3d pipeline_parallel=2 × data_parallel=2, each stage's experts spread over its two
data-parallel ranks, against the unswapped model (eager, grouped_mm) in the same layout
(``benchmarks._moe_families_pp2``). ``--device cuda``: the single-GPU leg (ep=1, one process; bf16 and fp32),
see ``benchmarks._moe_families_gpu``. A family that fails is a row with its error and the command exits non-zero
after writing the JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from benchmarks.report import cuda_device_name, default_out, out_help, print_table, write_json

NAME = "moe_families"
TOLERANCE = 1e-5
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

    per_rank = run_distributed(run_all, 2, args=(families, size, warmup, steps), timeout_s=1800)

    def family_row(row: dict[str, Any], peers: list[dict[str, Any]], step: dict[str, float],
                   fastest: dict[str, float]) -> dict[str, Any]:
        return {
            "family": row["family"], "num_experts": row["num_experts"], "top_k": row["top_k"],
            "widths": row["widths"], "experts_per_rank": row["local_experts"],
            "output_diff": max(p["output_diff"] for p in peers), "grad_diff": max(p["grad_diff"] for p in peers),
            "grads_missing": sorted({n for p in peers for n in p["grads_missing"]}),
            "timed_steps": len(row["steps_ms"]["ours"]), "step_ms": step, "step_min_ms": fastest,
            "speedup_vs_eager": _paired_speedup(peers, "eager"),
            "speedup_vs_grouped_mm": _paired_speedup(peers, "grouped_mm"),
            "speedup_vs_eager_of_medians": step["eager"] / step["ours"],
            "speedup_vs_grouped_mm_of_medians": step["grouped_mm"] / step["ours"],
            "speedup_vs_eager_fastest": fastest["eager"] / fastest["ours"],
            "speedup_vs_grouped_mm_fastest": fastest["grouped_mm"] / fastest["ours"],
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


def _speedups(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The slowest family's speedups: median steps (the goal's statistic) and fastest steps beside them."""
    ok = [r for r in rows if "error" not in r]
    return {f"speedup_vs_{name}_min{stat}": min((r[f"speedup_vs_{key}{stat}"] for r in ok), default=None)
            for name, key in (("hf", "eager"), ("grouped_mm", "grouped_mm")) for stat in ("", "_fastest")}


def _cpu_leg(quick: bool, families: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from lightning_merak.plugins.moe.experts import REFUSED_FAMILIES

    size = {"hidden": 64, "layers": 2, "vocab": 128, "batch": 2, "seq": 32} if quick else \
        {"hidden": 128, "layers": 2, "vocab": 256, "batch": 4, "seq": 64}
    # a cheap family's step (Mixtral's: tens of ms) moves by ±30% with the machine's load, so the goal's leg times
    # it for at least GOAL_LEG_SECONDS (up to 4× the steps) while the 0.3-5 s families keep their step count
    family_size = {**size, "routing": "family", "intermediate": "family",
                   "min_seconds": 0.0 if quick else GOAL_LEG_SECONDS}
    large = {**size, "hidden": 256, "intermediate": 512}
    warmup, steps = (1, 9) if quick else (3, 25)
    # the eager loop's step at 60-256 experts is 0.3-5 s (a zero-filled [E, ...] gradient per expert), so the
    # goal's leg runs fewer steps to keep a full run under ten minutes
    family_warmup, family_steps = (1, 9) if quick else (1, 11)
    rows = _ep2_rows(families, family_size, family_warmup, family_steps)
    few_rows = _ep2_rows(families, size, warmup, steps)
    large_rows = _ep2_rows(families, large, warmup, steps)
    pp2_ep2 = _pp2_leg(families, size, warmup, steps)
    ok = [r for r in rows if "error" not in r]
    exact = [r["family"] for r in ok if max(r["output_diff"], r["grad_diff"]) <= TOLERANCE and not r["grads_missing"]]
    speedups = _speedups(rows)
    summary = {
        "families_exact": exact,
        "families_refused": dict(REFUSED_FAMILIES),
        "families_failed": {r["family"]: r["error"] for r in rows if "error" in r},
        "max_output_diff": max((r["output_diff"] for r in ok), default=None),
        "max_grad_diff": max((r["grad_diff"] for r in ok), default=None),
        "max_replicated_diff": max((r["replicated_diff"] for r in ok), default=None),
        **speedups,
        "statistic": "speedup_vs_*: median over rounds of the per-round ratio (variants back to back each round, "
                     "each the slowest rank's step; pp2_ep2: ratio of medians); step_ms: median step after "
                     "warm-up, *_of_medians: their ratio; *_fastest: fastest steps",
        "ours": "merak_ep (experts_implementation='merak_ep'), no replicas, no block-scope Lancet",
        "goals": {"max_output_diff_le_1e-5": bool(ok) and max(r["output_diff"] for r in ok) <= TOLERANCE,
                  "speedup_vs_hf_min_ge_1.3": speedups["speedup_vs_hf_min"] is not None
                  and speedups["speedup_vs_hf_min"] >= 1.3},
        "ep": 2, "world_size": 2, "backend": "gloo", "size": family_size, "steps": family_steps,
        "few_experts": _second_leg(size, few_rows, steps),
        "large": _second_leg(large, large_rows, steps),
        "pp2_ep2": pp2_ep2,
    }
    return rows, summary


def _second_leg(size: dict[str, Any], rows: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """An ep=2 leg beside the goal's: its size, rows, slowest-family speedups and failures."""
    return {"size": size, "steps": steps, "rows": rows, **_speedups(rows),
            "max_output_diff": max((r["output_diff"] for r in rows if "error" not in r), default=None),
            "families_failed": {r["family"]: r["error"] for r in rows if "error" in r}}


def _pp2_leg(families: list[str], size: dict[str, Any], warmup: int, steps: int) -> dict[str, Any]:
    """pp=2 × ep=2 on 4 ranks (merak3d): per family, loss difference from the unswapped model and step times."""
    from benchmarks._moe_families_pp2 import run_all
    from lightning_merak.testing import run_distributed

    per_rank = run_distributed(run_all, 4, args=(families, size, warmup, steps), timeout_s=1800)
    rows = _family_rows(per_rank, lambda row, peers, step, fastest: {
        "family": row["family"], "loss_diff": max(p["loss_diff"] for p in peers), "step_ms": step,
        "step_min_ms": fastest, "speedup_vs_eager": step["eager"] / step["ours"],
        "speedup_vs_grouped_mm": step["grouped_mm"] / step["ours"],
        "speedup_vs_eager_fastest": fastest["eager"] / fastest["ours"],
        "speedup_vs_grouped_mm_fastest": fastest["grouped_mm"] / fastest["ours"]})
    ok = [r for r in rows if "error" not in r]
    return {"status": "measured" if len(ok) == len(rows) else "failed", "world_size": 4, "pipeline_parallel": 2,
            "ep": 2, "steps": steps, "rows": rows,
            "families_failed": {r["family"]: r["error"] for r in rows if "error" in r},
            "max_loss_diff": max((r["loss_diff"] for r in ok), default=None),
            **_speedups(rows)}


def _gpu_leg(quick: bool, families: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from benchmarks._moe_families_gpu import run_gpu

    device_name = cuda_device_name()
    rows = run_gpu(families, quick)
    ok = [r for r in rows if "error" not in r]
    fp32 = [r for r in ok if r["dtype"] == "float32"]
    summary = {
        "device_name": device_name, "ep": 1,
        "families_failed": {f"{r['family']}/{r['dtype']}": r["error"] for r in rows if "error" in r},
        "max_output_diff_fp32": max((r["output_diff_vs_eager"] for r in fp32), default=None),
        "speedup_vs_hf_min": min((r["speedup_vs_eager"] for r in ok if r["speedup_vs_eager"]), default=None),
        "speedup_vs_grouped_mm_min": min((r["speedup_vs_grouped_mm"] for r in ok if r["speedup_vs_grouped_mm"]),
                                         default=None),
        "baselines_failed": {f"{r['family']}/{r['dtype']}/{k.removesuffix('_error')}": v
                             for r in ok for k, v in r.items() if k.endswith("_error")},
    }
    return rows, summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer steps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--families", nargs="+", choices=_families(), default=None,
                        help="only these families (a targeted run; the committed JSON covers all)")
    parser.add_argument("--out", default=None, help=out_help(NAME))
    args = parser.parse_args(argv)
    families = args.families or _families()
    rows, summary = (_gpu_leg if args.device == "cuda" else _cpu_leg)(args.quick, families)
    table = [{"family": r["family"], **({"dtype": r["dtype"]} if "dtype" in r else {}),
              "diff": r.get("output_diff", r.get("output_diff_vs_eager")),
              **{f"{k}_ms": v for k, v in r.get("step_ms", {}).items()},
              "vs_eager": r.get("speedup_vs_eager"), "vs_grouped_mm": r.get("speedup_vs_grouped_mm"),
              "error": r.get("error", "")[:60]} for r in rows]
    print_table(table)
    for leg in ("few_experts", "large"):
        for row in summary.get(leg, {}).get("rows", []):
            print(f"{leg} {row['family']}: " + (row["error"][:80] if "error" in row else
                  f"diff {row['output_diff']:.1e}, step ms "
                  f"{', '.join(f'{k} {v:.1f}' for k, v in row['step_ms'].items())}, ours vs eager "
                  f"{row['speedup_vs_eager']:.2f}×, vs grouped_mm {row['speedup_vs_grouped_mm']:.2f}×"))
    for row in summary.get("pp2_ep2", {}).get("rows", []):
        print(f"pp2×ep2 {row['family']}: " + (row["error"][:80] if "error" in row else
              f"loss diff {row['loss_diff']:.1e}, ours vs eager {row['speedup_vs_eager']:.2f}×, "
              f"vs grouped_mm {row['speedup_vs_grouped_mm']:.2f}×"))
    name = NAME if args.device == "cpu" else f"{NAME}.gpu"
    out = Path(args.out) if args.out else default_out(name, args.quick)
    path = write_json(out, rows, "measured", quick=args.quick, device=args.device, **summary)
    print(f"wrote {path}")
    failed = [r for r in rows if "error" in r] + [family for leg in ("pp2_ep2", "few_experts", "large")
                                                  for family in summary.get(leg, {}).get("families_failed", {})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
