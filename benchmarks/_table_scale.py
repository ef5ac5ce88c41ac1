"""The scale area's table for ``docs/results.md``: what ``python -m benchmarks.scale`` wrote.

Its goals (``goal_runs``) are rendered by ``benchmarks.results_table`` for every area alike; this table shows
each leg's figures behind them: every rung's worst peak/ideal, not the top rung's alone, and the ranks started
without the launcher's heap settings beside the launcher's.
"""

from __future__ import annotations

from typing import Any

from benchmarks._table_cells import Table, brief, ratio

WITHOUT_LAUNCHER_ENV = " (without the launcher's heap settings)"


def _worst_rung(memory: list[dict[str, Any]], leg: str) -> str:
    """The worst peak/ideal of ``leg`` over the rungs it ran, with that rung; a failed rung shows as failed."""
    rows = [row for row in memory if row["leg"] == leg]
    if not rows or any(row.get("peak_over_ideal") is None for row in rows):
        return "-" if not rows else "failed"
    worst = max(rows, key=lambda row: row["peak_over_ideal"])
    return f"{ratio(worst['peak_over_ideal'])} at {worst['layers']} layers"


def _memory_cells(memory: list[dict[str, Any]], leg: str, top: int) -> list[str]:
    at_top = next((row for row in memory if row["leg"] == leg and row["layers"] == top), {})
    used = "-" if at_top.get("max_used_mb") is None else f"{at_top['max_used_mb']:.0f}"
    return [used, ratio(at_top.get("peak_over_ideal")), _worst_rung(memory, leg)]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def scale(data: dict[str, Any]) -> Table:
    """One row per leg (its largest model under the cap, its memory, its load), then the default layouts with
    ranks started as torchrun starts them, and the ``from_pretrained`` reference."""
    top = max(data["ladder_layers"])
    memory = [row for row in data["rows"] if row["section"] == "memory"]
    loads = {row["leg"]: row for row in data["rows"] if row["section"] == "load"}
    rows: list[list[object]] = []
    for fit in (row for row in data["rows"] if row["section"] == "largest"):
        load = loads.get(fit["leg"], {})
        if fit["refused"]:
            rows.append([fit["leg"], fit["ranks"], f"refused: {brief(fit['error'])}", "-", "-", "-", "-", "-"])
            continue
        fitted = "none" if fit["layers"] is None else (
            f"{fit['layers']} layers, {fit['params_m']:.1f} M params"
            + (" (weights + AdamW exceed the cap)" if fit["full_state_exceeds_cap"] else ""))
        rows.append([fit["leg"], fit["ranks"], fitted, *_memory_cells(memory, fit["leg"], top),
                     _seconds(load.get("load_s")), _seconds(load.get("gb_per_s"))])
    external = data.get("without_launcher_env") or []
    for leg in dict.fromkeys(row["leg"] for row in external):
        ranks = next(row["ranks"] for row in external if row["leg"] == leg)
        rows.append([f"{leg}{WITHOUT_LAUNCHER_ENV}", ranks, "-", *_memory_cells(external, leg, top), "-", "-"])
    reference = loads.get("from_pretrained (1 process)")
    if reference:
        rows.append([reference["leg"], 1, "-", "-", "-", "-", _seconds(reference["load_s"]),
                     _seconds(reference["gb_per_s"])])
    rel_err = data["logits_max_rel_err"]
    notes = [
        f"{data['workload']}; cap {data['cap_mb']:.0f} MiB per rank above the baseline; every leg runs every rung of "
        f"{data['ladder_layers']} decoder layers; {data['steps']} training steps per run",
        "peak/ideal: worst rank's (peak RSS − baseline) / (4 × its parameter bytes + measured activations in flight); "
        "ranks start with the launcher's GLIBC_TUNABLES, baselines included; rows marked "
        f"“{WITHOUT_LAUNCHER_ENV.strip(' ()')}” start with glibc's defaults, as torchrun or SLURM start a script",
        "baselines run at every rank count a merak3d layout runs at; each layout is compared with the baseline on "
        "as many ranks",
        *([f"with compact_host_memory=True (not the default): worst {ratio(data['peak_over_ideal_compact'])} over "
           f"layouts and rungs; step time up to {data['compact_step_time_ratio_max']:.2f}× the default's"]
          if data.get("peak_over_ideal_compact") is not None and data.get("compact_step_time_ratio_max") else []),
        f"logits vs from_pretrained, max relative error over layouts: {'-' if rel_err is None else f'{rel_err:.1e}'}; "
        f"export round trip (load → merak3d checkpoint → merak-export) max |diff|: {data['export_roundtrip_max_abs']}",
    ]
    return Table(["leg", "ranks", "largest model under the cap", f"MiB above baseline, {top} layers",
                  f"peak/ideal, {top} layers", "peak/ideal, worst rung", "load s", "load GB/s"], rows, notes)
