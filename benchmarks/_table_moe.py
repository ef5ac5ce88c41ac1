"""The MoE placement benchmark's results table (``benchmarks/moe.py``'s JSON), measured rows then simulated.

The goals themselves (``goal_runs``) are rendered by ``benchmarks.results_table`` like every area's; this
table gives each configuration's figures behind them, so a reader can find the worst configuration.
"""

from __future__ import annotations

from typing import Any

from benchmarks._table_cells import Table, ratio

__all__ = ["moe"]


def _kinds(policy: dict[str, Any]) -> str:
    return ", ".join(f"{kind} {count}" for kind, count in policy["kinds"].items())


def _rank_cpu(record: dict[str, Any] | None) -> str:
    """How the ranks shared the CPU, in a few words: a figure at more ranks than cores means little without it."""
    if record is None:
        return "CPU sharing not recorded"
    if "quota_us" not in record:
        return str(record["emulation"])
    text = f"each under a fixed CPU quota of {record['core_share_per_rank']:g} core, ours and baselines alike"
    if record.get("no_lending_at_call_scale") is False:
        text += (f", yet a rank computing alone ran {max(record['lone_over_shared_expert_rate'].values()):.1f}× "
                 "the shared expert rate: idle ranks still lent cores within a quota period")
    return text


def moe(data: dict[str, Any]) -> Table:
    """One row per measured configuration, then one per simulated (ranks × routing), labelled as such."""
    rows: list[list[object]] = []
    for r in data["rows"]:
        p = r["policies"]
        rows.append(["emulated", r["config"], f"{p['ours']['max_over_mean_worst_step']:.3f}",
                     f"{p['dropless']['max_over_mean_worst_step']:.3f}",
                     f"{ratio(r['ours_over_best_baseline'])} ({r['best_baseline']})",
                     ", ".join(f"{name} {ratio(value)}" for name, value in r["ours_over_baseline"].items()),
                     _kinds(p["ours"])])
    for s in data["simulated"]["rows"]:
        best = min(("deepspeed", "dropless", "shadowing"), key=lambda name: s[f"{name}_ms"])
        rows.append([data["simulated"]["label"], f"{s['ranks']} ranks/{s['routing']}",
                     f"{s['ours_worst_step_max_over_mean']:.3f}", f"{s['dropless_worst_step_max_over_mean']:.3f}",
                     f"{ratio(s['ours_over_best_baseline'])} ({best})",
                     ", ".join(f"{name} {ratio(s[f'{name}_ms'] / s['ours_ms'])}"
                               for name in ("deepspeed", "dropless", "shadowing")),
                     ", ".join(f"{kind} {count}" for kind, count in s["ours_kinds"].items())])
    dropless = data["dropless_meets_balance"]
    simulated_note = data["simulated"].get("note", "1 expert per rank, on this run's calibrated cost model; "
                                           "not measured")
    notes = [
        f"emulated: {data['world_size']} ranks ({_rank_cpu(data.get('rank_cpu'))}; unpinned, launcher heap "
        "settings), 8 experts, top-2; base at 400 Mbit/s on each routing (drift4: Zipf 1.2 shifting every 4 "
        "steps; rotateK: hot set redrawn every K steps), then one factor swept on rotate3; simulated: 8–64 ranks, "
        f"{simulated_note}",
        "ours: " + ", ".join(f"{key}={value}" for key, value in data["ours_options"].items())
        + ", every other option at its default",
        "baselines: " + "; ".join(f"{name}: {label}" for name, label in data["baselines"].items()),
        "load max/mean: tokens computed per rank in the worst timed step (a step at its worst layer call); speed: "
        "median over timed steps of the paired step-time ratio baseline/ours (simulated: ratio of predicted times)",
        f"dropless alone meets the balance goal in {dropless['meeting']} of {dropless['configurations']} "
        "emulated configurations",
    ]
    return Table(["label", "configuration", "ours worst-step load max/mean", "dropless worst step",
                  "ours vs best baseline", "ours vs each baseline", "kinds ours ran (layer-steps)"], rows, notes)
