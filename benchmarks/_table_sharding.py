"""The sharding area's table for ``docs/results.md``: ``benchmarks.sharding``'s JSON (issue #49's goals) as rows."""

from __future__ import annotations

from typing import Any

from benchmarks._table_cells import Table, brief, ratio

HEADERS = ["layout", "run", "step ms", "vs merak3d none", "vs DDP (same buckets)", "vs DDP (25 MB)", "vs FSDP2",
           "vs ZeRO-1", "optimizer bytes vs none", "exposed comm", "loss vs DDP", "MiB (peak/ideal)"]


def _mode_row(row: dict[str, Any]) -> list[str]:
    if row["error"]:
        return [row["layout"], row["name"], ("refused: " if row["refused"] else "failed: ") + brief(row["error"]),
                *["-"] * (len(HEADERS) - 3)]
    worst = row["worst_rank"]
    fraction, loss = row.get("exposed_grad_comm_fraction"), row.get("loss_max_rel_diff_vs_ddp")
    return [row["layout"], row["name"], f"{row['step_ms']:.0f}", ratio(row.get("step_over_merak3d_none")),
            ratio(row.get("step_over_ddp")), ratio(row.get("step_over_ddp_default")),
            ratio(row.get("step_over_fsdp2")), ratio(row.get("step_over_zero1")),
            ratio(row.get("optimizer_state_ratio")), "-" if fraction is None else f"{fraction:.2f}",
            "-" if loss is None else f"{loss:.1e}", f"{row['used_mb'][worst]:.0f} ({ratio(row['peak_over_ideal'])})"]


def sharding(data: dict[str, Any]) -> Table:
    """Every mode-comparison run, then notes: the workload, the largest-model search, and the figures beside the
    goals (the goals themselves are ``goal_runs``, which ``benchmarks.results_table`` renders for every area)."""
    rows = [_mode_row(row) for row in data["rows"] if row["section"] == "modes"]
    largest = ", ".join(f"{r['name']} {r['largest_layers']} layers ({r['params_m']:.1f} M)" if r["params_m"]
                        else f"{r['name']} {'none' if r['error'] is None else brief(r['error'])}"
                        for r in data["rows"] if r["section"] == "largest")
    notes = [
        f"{data['workload']}, {data['steps']} steps, network {data['network']}; step time: median of the slowest "
        f"rank; DDP (same buckets): Lightning's DDPStrategy with bucket_cap_mb {data['ddp_bucket_mb']:.2f}, "
        "merak3d's default bucket; exposed comm: (step with overlap − step without gradient communication) over "
        "(step without overlap − the same); MiB: worst rank's peak above its baseline in a "
        f"{data['memory_steps']}-step run with glibc's mmap threshold pinned (its peak over the ideal: parameters, "
        "the mode's gradients and AdamW state, activations)",
        f"largest model under {data['cap_mb']:.0f} MiB per rank, 4 ranks ({data['search_workload']}): "
        + (largest or "not run"),
    ]
    targets = data.get("targets", {})
    if targets:
        notes.append("ZeRO-1 at its defaults over Lightning DDP at its own 25 MB buckets, by layout: " + ", ".join(
            f"{layout} {ratio(t['zero1_default_over_lightning_ddp_default_buckets'])}" for layout, t in targets.items())
            + "; with overlap_param_gather=False (not the default: the gather right after the step) over DDP with "
            "the same buckets: " + ", ".join(
            f"{layout} {ratio(t['zero1_gather_after_step_over_lightning_ddp'])}" for layout, t in targets.items()))
    return Table(HEADERS, rows, notes)
