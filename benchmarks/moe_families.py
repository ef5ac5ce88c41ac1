"""Every named transformers-5 MoE family under ``merak_ep``: swap equality and step time (#30).

    python -m benchmarks.moe_families [--quick] [--device cpu|cuda] [--out FILE]

``--device cpu`` (default): two gloo ranks at ep=2, per family (tiny configs from each config class,
fp32) the largest difference of outputs and parameter gradients from the unswapped model, and the
training-step time of ours (``merak_ep``) against the unswapped model's own expert loop (``eager``)
and its ``grouped_mm`` implementation on the same ranks. Variants run interleaved step by step;
speedups compare the fastest step of each (load from other jobs on a shared machine only adds time),
medians are kept beside them. ``pp2_ep2``: four gloo ranks, merak3d pipeline_parallel=2 × data_parallel=2, each
stage's experts spread over its two data-parallel ranks, against the unswapped model (eager, grouped_mm) in the
same layout (``benchmarks._moe_families_pp2``). ``--device cuda``: the single-GPU leg (ep=1, one
process; bf16 and fp32), see ``benchmarks._moe_families_gpu``. A family that fails is a row with its
error and the command exits non-zero after writing the JSON.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from benchmarks.report import cuda_device_name, default_out, out_help, print_table, write_json

NAME = "moe_families"
TOLERANCE = 1e-5


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


def _cpu_leg(quick: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from benchmarks._moe_families_ranks import run_all
    from lightning_merak.plugins.moe.experts import REFUSED_FAMILIES
    from lightning_merak.testing import run_distributed

    size = {"hidden": 64, "layers": 2, "vocab": 128, "batch": 2, "seq": 32} if quick else \
        {"hidden": 128, "layers": 2, "vocab": 256, "batch": 4, "seq": 64}
    warmup, steps = (1, 9) if quick else (3, 25)
    per_rank = run_distributed(run_all, 2, args=(_families(), size, warmup, steps), timeout_s=900)
    pp2_ep2 = _pp2_leg(size, warmup, steps)

    def family_row(row: dict[str, Any], peers: list[dict[str, Any]], step: dict[str, float],
                   fastest: dict[str, float]) -> dict[str, Any]:
        return {
            "family": row["family"], "num_experts": row["num_experts"], "top_k": row["top_k"],
            "experts_per_rank": row["local_experts"],
            "output_diff": max(p["output_diff"] for p in peers), "grad_diff": max(p["grad_diff"] for p in peers),
            "grads_missing": sorted({n for p in peers for n in p["grads_missing"]}),
            "step_ms": step, "step_min_ms": fastest,
            "speedup_vs_eager": fastest["eager"] / fastest["ours"],
            "speedup_vs_grouped_mm": fastest["grouped_mm"] / fastest["ours"],
            "speedup_vs_eager_median": step["eager"] / step["ours"],
            "exchange_cost": fastest["ours"] / fastest["ours_grouped_no_ep"],
            "replicated_diff": max(p["replicated_diff"] for p in peers),
            "replicated_over_ours": fastest["ours_replicated"] / fastest["ours"],
        }

    rows = _family_rows(per_rank, family_row)
    ok = [r for r in rows if "error" not in r]
    exact = [r["family"] for r in ok if max(r["output_diff"], r["grad_diff"]) <= TOLERANCE and not r["grads_missing"]]
    summary = {
        "families_exact": exact,
        "families_refused": dict(REFUSED_FAMILIES),
        "families_failed": {r["family"]: r["error"] for r in rows if "error" in r},
        "max_output_diff": max((r["output_diff"] for r in ok), default=None),
        "max_grad_diff": max((r["grad_diff"] for r in ok), default=None),
        "max_replicated_diff": max((r["replicated_diff"] for r in ok), default=None),
        "speedup_vs_hf_min": min((r["speedup_vs_eager"] for r in ok), default=None),
        "speedup_vs_grouped_mm_min": min((r["speedup_vs_grouped_mm"] for r in ok), default=None),
        "goals": {"max_output_diff_le_1e-5": bool(ok) and max(r["output_diff"] for r in ok) <= TOLERANCE,
                  "speedup_vs_hf_min_ge_1.3": bool(ok) and min(r["speedup_vs_eager"] for r in ok) >= 1.3},
        "ep": 2, "world_size": 2, "backend": "gloo", "size": size, "steps": steps, "pp2_ep2": pp2_ep2,
    }
    return rows, summary


def _pp2_leg(size: dict[str, Any], warmup: int, steps: int) -> dict[str, Any]:
    """pp=2 × ep=2 on 4 ranks (merak3d): per family, loss difference from the unswapped model and step times."""
    from benchmarks._moe_families_pp2 import run_all
    from lightning_merak.testing import run_distributed

    per_rank = run_distributed(run_all, 4, args=(_families(), size, warmup, steps), timeout_s=1800)
    rows = _family_rows(per_rank, lambda row, peers, step, fastest: {
        "family": row["family"], "loss_diff": max(p["loss_diff"] for p in peers), "step_ms": step,
        "step_min_ms": fastest, "speedup_vs_eager": fastest["eager"] / fastest["ours"],
        "speedup_vs_grouped_mm": fastest["grouped_mm"] / fastest["ours"]})
    ok = [r for r in rows if "error" not in r]
    return {"status": "measured" if len(ok) == len(rows) else "failed", "world_size": 4, "pipeline_parallel": 2,
            "ep": 2, "steps": steps, "rows": rows,
            "families_failed": {r["family"]: r["error"] for r in rows if "error" in r},
            "max_loss_diff": max((r["loss_diff"] for r in ok), default=None),
            "speedup_vs_hf_min": min((r["speedup_vs_eager"] for r in ok), default=None),
            "speedup_vs_grouped_mm_min": min((r["speedup_vs_grouped_mm"] for r in ok), default=None)}


def _gpu_leg(quick: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from benchmarks._moe_families_gpu import run_gpu

    device_name = cuda_device_name()
    rows = run_gpu(_families(), quick)
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
    parser.add_argument("--out", default=None, help=out_help(NAME))
    args = parser.parse_args(argv)
    rows, summary = (_gpu_leg if args.device == "cuda" else _cpu_leg)(args.quick)
    table = [{"family": r["family"], **({"dtype": r["dtype"]} if "dtype" in r else {}),
              "diff": r.get("output_diff", r.get("output_diff_vs_eager")),
              **{f"{k}_ms": v for k, v in r.get("step_ms", {}).items()},
              "vs_eager": r.get("speedup_vs_eager"), "vs_grouped_mm": r.get("speedup_vs_grouped_mm"),
              "error": r.get("error", "")[:60]} for r in rows]
    print_table(table)
    for row in summary.get("pp2_ep2", {}).get("rows", []):
        print(f"pp2×ep2 {row['family']}: " + (row["error"][:80] if "error" in row else
              f"loss diff {row['loss_diff']:.1e}, ours vs eager {row['speedup_vs_eager']:.2f}×, "
              f"vs grouped_mm {row['speedup_vs_grouped_mm']:.2f}×"))
    name = NAME if args.device == "cpu" else f"{NAME}.gpu"
    out = Path(args.out) if args.out else default_out(name, args.quick)
    path = write_json(out, rows, "measured", quick=args.quick, device=args.device, **summary)
    print(f"wrote {path}")
    failed = [r for r in rows if "error" in r] + list(summary.get("pp2_ep2", {}).get("families_failed", {}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
