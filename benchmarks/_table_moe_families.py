"""The moe_families area of ``benchmarks.results_table``: ours against transformers' default experts implementation.

Renders the JSON ``benchmarks.moe_families`` writes (issue #49's baseline: the unswapped model at the experts
implementation transformers picks when none is set). The goals themselves (``goal_runs``) are rendered by
``benchmarks.results_table`` for every area alike; the notes here say what each leg ran.
"""

from __future__ import annotations

from typing import Any

from benchmarks._table_cells import Table, brief, percent, ratio

__all__ = ["moe_families", "moe_families_gpu"]


def moe_families(data: dict[str, Any]) -> Table:
    """The family-widths leg per family, with a note per other leg (narrow widths, large, pp=2 × ep=2)."""
    rows = [[r["family"], "failed", brief(r["error"]), "", "", "", "", "", ""] if "error" in r else
            [r["family"], f"{r['num_experts']} / top-{r['top_k']}", f"{r['output_diff']:.1e} / {r['grad_diff']:.1e}",
             *(f"{r['step_ms'][v]:.1f}" for v in ("default", "eager", "ours")),
             f"{ratio(r['speedup_vs_default'])} / {ratio(r['speedup_vs_eager'])}", ratio(r["exchange_cost"]),
             percent(r["expert_bytes_ratio"])]
            for r in data["rows"]]
    notes = [
        f"ep={data['ep']} on {data['world_size']} {data['backend']} ranks, tiny configs from each family's config "
        f"class (hidden {data['size']['hidden']}, batch {data['size']['batch']} × {data['size']['seq']} per rank, "
        f"the family's own routing and width proportions); ours: {data['ours']}; baseline: {data['baseline']} "
        f"(transformers picked: {', '.join(data['default_implementations'])}); speedups: median over "
        f"{_timed_steps(data)} interleaved rounds of the per-round ratio (ratios of medians and of fastest steps in "
        "the JSON); exchange cost: ours over our grouped core without expert parallelism; expert bytes: a rank's "
        "expert tensors over the full model's",
        f"families_exact: {', '.join(data['families_exact'])}; refused: {', '.join(sorted(data['families_refused']))}",
        _pp2_ep2_note(data["pp2_ep2"]),
    ]
    legs = (("few_experts", "8–16 experts per family, narrow widths"), ("large", "larger size"))
    notes.extend(_size_leg_note(name, data[key]) for key, name in legs if data.get(key, {}).get("rows"))
    replicated = [r["replicated_over_ours"] for r in data["rows"] if "replicated_over_ours" in r]
    if replicated:
        notes.append(f"each layer's hottest expert shadowed on every rank (Pro-Prophet/FasterMoE replicas run by "
                     f"merak_ep): max diff from ours {data['max_replicated_diff']:.1e}, step "
                     f"{ratio(min(replicated))}–{ratio(max(replicated))} of ours")
    return Table(["family", "experts / k", "output / grad max diff", "default ms", "eager ms", "ours ms",
                  "ours vs default / eager", "exchange cost", "expert bytes"], rows, notes)


def moe_families_gpu(data: dict[str, Any]) -> str:
    """One line for the moe_families section: the single-GPU leg, ours against the default and eager.

    GPU legs run before the default was recorded named ``grouped_mm`` explicitly, which is what transformers picks
    for every family measured; they are read as such."""
    def versus_default(row: dict[str, Any]) -> float | None:
        return row.get("speedup_vs_default", row.get("speedup_vs_grouped_mm"))

    cells = [f"{r['family']} {r['dtype']} failed: {brief(r['error'])}" if r.get("error") else
             f"{r['family']} {r['dtype']} {ratio(versus_default(r))} / {ratio(r.get('speedup_vs_eager'))}"
             for r in data["rows"]]
    implementations = data.get("default_implementations", ["grouped_mm"])
    return (f"GPU leg ({data['device_name']}, torch {data['machine']['torch']}, ep=1, one process; ours vs "
            f"transformers' default ({', '.join(implementations)}) / vs eager): " + ", ".join(cells))


def _timed_steps(data: dict[str, Any]) -> str:
    """The family-widths leg's timed rounds per family: one count, or its range where cheap families ran longer."""
    counts = [r.get("timed_steps", data["steps"]) for r in data["rows"] if "error" not in r] or [data["steps"]]
    return str(min(counts)) if min(counts) == max(counts) else f"{min(counts)}–{max(counts)}"


def _size_leg_note(name: str, leg: dict[str, Any]) -> str:
    """A second size of the families' comparison: its shape and the range of ours over each baseline."""
    ok = [r for r in leg["rows"] if "error" not in r]
    failed = [f"{r['family']} failed: {brief(r['error'])}" for r in leg["rows"] if "error" in r]
    size = leg["size"]
    intermediate = f", intermediate {size['intermediate']}" if "intermediate" in size else ""
    ranges = [f"vs {baseline} {ratio(min(values))}–{ratio(max(values))}" for baseline in ("default", "eager")
              if (values := [r[f"speedup_vs_{baseline}"] for r in ok])]
    return (f"{name} (hidden {size['hidden']}{intermediate}, batch {size['batch']} × {size['seq']} per rank): ours "
            + ", ".join(ranges + failed))


def _pp2_ep2_note(leg: dict[str, Any]) -> str:
    """The merak3d pipeline × expert-parallel leg: each family's loss difference and speed, or why it did not run."""
    if leg.get("status") not in ("measured", "failed"):
        return f"pp=2 × ep=2: {leg.get('status')} ({leg.get('reason', '')})"
    cells = [f"{r['family']} {ratio(r['speedup_vs_default'])} / {ratio(r['speedup_vs_eager'])} (loss diff "
             f"{r['loss_diff']:.1e})" if "error" not in r else f"{r['family']} failed: {brief(r['error'])}"
             for r in leg["rows"]]
    return (f"merak3d pp=2 × ep=2 ({leg['world_size']} ranks, {leg['steps']} steps; ours vs default / eager in the "
            "same layout, ratio of median steps): " + ", ".join(cells))
