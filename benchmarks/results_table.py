"""Write docs/results.md, one table per benchmark area, from the JSON files in benchmarks/results/.

    python -m benchmarks.results_table [--results DIR] [--out PATH]

Each area is taken from its full run (``NAME.json``) or, where there is none, from its
``--quick`` run (``NAME.quick.json``); the page says which file, its label and its machine.
Every figure on the page comes from those files. A file that cannot be read, or whose
content contradicts its name (a ``quick`` or ``mode`` field), stops the command with its name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from benchmarks._auxiliary_lines import (
    adapters_lr_sweep,
    context_parallel_variable,
    delta_gpu,
    planner_moe,
    scale_gpu,
    sharding_gpu,
)
from benchmarks._table_cells import ResultsError, Table, brief, percent, ratio
from benchmarks._table_moe import moe
from benchmarks._table_moe_families import moe_families, moe_families_gpu
from benchmarks._table_replay_planner import planner, replay
from benchmarks._table_scale import scale
from benchmarks._table_sharding import sharding
from benchmarks._table_sparse_comm_overlap_tp import overlap_tp, sparse_comm
from benchmarks.delta import budget_text
from benchmarks.goals import RULES, combine_runs, goal_line, undecided
from benchmarks.report import RESULTS_DIR, revision_text

REPO_ROOT = RESULTS_DIR.parents[1]
DEFAULT_PAGE = REPO_ROOT / "docs" / "results.md"
NOT_RESULTS = ("_trace.json", ".perfetto.json")
"""Chrome traces next to the results: overlap_tp's (git-ignored), benchmarks.replay's committed Perfetto example."""


# ---------------------------------------------------------------- one function per area


def collectives(data: dict[str, Any]) -> Table:
    networks = list(dict.fromkeys(row["network"] for row in data["rows"]))
    shaped = [n for n in networks if n != "loopback"]
    cells: dict[tuple, dict[str, dict[str, Any]]] = {}
    for row in data["rows"]:
        cells.setdefault((row["ranks"], row["op"], row["size"]), {})[row["network"]] = row
    headers = ["ranks", "op", "size", *(f"{n} Gbit/s" for n in networks), *(f"{n}: of set rate" for n in shaped)]
    rows = []
    for (ranks, op, size), by_network in cells.items():
        bandwidth = [f"{by_network[n]['busbw_gbit']:.2f}" if n in by_network else "-" for n in networks]
        share = [percent(by_network[n].get("vs_set_rate")) if n in by_network else "-" for n in shaped]
        rows.append([ranks, op, size, *bandwidth, *share])
    return Table(headers, rows, [f"check: {data['check']['verdict']}"])


def merak3d(data: dict[str, Any]) -> Table:
    rows: list[Sequence[object]] = []
    none_ms = {r["partition"]: r["step_ms"] for r in data["rows"]
               if r["section"] == "recompute" and r["recompute"] == "none"}
    for r in data["rows"]:
        section = r["section"]
        if section == "throughput":
            value = ratio(r["vs_ddp"]) if r["error"] is None else f"refused: {brief(r['error'])}"
            rows.append([section, f"{r['strategy']} {r['layout']}", "tokens/s vs Lightning DDP", value, r["label"]])
        elif section == "balance":
            rows.append([section, f"{r['partition']} split, {r['stages']} stages, {r['micro_batches']} micro-batches",
                         "bubble fraction", f"{r['bubble_fraction']:.2f}", r["label"]])
        elif section == "balance_measured":
            value = ratio(r["vs_uniform"]) if r["error"] is None else brief(r["error"])
            rows.append([section, f"{r['partition']} split, {r['stages']} stages", "step vs uniform split",
                         value + (f" ({r['note']})" if r["note"] else ""), r["label"]])
        elif section == "recompute":
            value = brief(r["error"]) if r["error"] else (
                f"{r['saved_mb_per_microbatch_stage0']:.1f}; {ratio(none_ms[r['partition']] / r['step_ms'])}")
            rows.append([section, f"recompute={r['recompute']}", "saved MB per micro-batch on stage 0; speed vs none",
                         value, r["label"]])
        elif section == "vocab_stages":
            rows.append([section, f"vocab {r['vocab']}, {r['layers']} blocks, {r['stages']} stages",
                         "worst stage / mean: autopipe, with the head split",
                         f"{r['autopipe_max_over_mean']:.2f}, {r['vocab_stages_max_over_mean']:.2f}", r["label"]])
        elif section == "vocab_stages_measured" and r["vocab_stages"] == "on":
            value = ratio(r["vs_autopipe"]) if r["error"] is None else brief(r["error"])
            rows.append([section, f"vocab {r.get('vocab', 32000)}, {r['stages']} stages",
                         "tokens/s with the vocabulary split vs autopipe alone", value, r["label"]])
        elif section == "memory_cap":
            value = f"{r['completed_steps']}/{r['of_steps']}" + (f" ({brief(r['error'])})" if r["error"] else "")
            rows.append([section, f"{r['strategy']} {r['layout']}", "steps completed under the cap", value,
                         r["label"]])
    notes = [f"{name}: {text}" for name, text in data["workloads"].items()]
    notes.append(f"memory cap: baseline + {data['cap_param_multiple']} × parameter bytes per rank")
    return Table(["part", "case", "figure", "value", "label"], rows, notes)


def delta(data: dict[str, Any]) -> Table:
    """Per leg and configuration against that leg's ``none``; DELTA's budget named on each of its rows."""
    budget = budget_text(data["delta_budget_fraction"])
    rows = []
    for r in data["rows"]:
        if r["config"] == "none":
            continue
        if r["leg"] == "max batch":
            rows.append([r["leg"], r["config"], "-", "-", "-", f"{r['batch']} ({ratio(r['batch_vs_none'])})"])
        else:
            config = r["config"] + (f" ({budget}: {r['budget_MiB']:.1f} MiB)" if "budget_MiB" in r else "")
            rows.append([r["leg"], config, percent(r["activation_vs_none"]),
                         percent(r.get("allocated_vs_none")), ratio(r["time_vs_none"]), "-"])
    notes = [f"equal-batch legs and the sweep: DELTA's {budget} in the same leg; goals: the worst delta row over "
             "every leg they cover",
             f"max batch: within none's activation RSS peak at batch 8 ({data['memory_budget_MiB']:.1f} MiB); "
             "DELTA's budget that minus none's non-saved transients per sample",
             f"GPU leg: {data['gpu_leg']}"]
    return Table(["leg", "config", "activation RSS, share of none's", "allocator in-use, share of none's",
                  "step time vs none", "max batch (vs none)"], rows, notes)


def adapters(data: dict[str, Any]) -> Table:
    tasks = data["setting"]["tasks"]
    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in data["rows"]:
        by_method.setdefault(r["method"], []).append(r)

    def mean_accuracy(runs: list[dict[str, Any]], task: str | None = None, key: str = "accuracy") -> float | None:
        values = [r[key] for r in runs if (task is None or r["task"] == task) and r[key] is not None]
        return statistics.mean(values) if values else None

    baseline = mean_accuracy(by_method["qlora"])
    rows = []
    for method, runs in by_method.items():
        adapted, merged = mean_accuracy(runs), mean_accuracy(runs, key="merged_accuracy")
        rows.append([method, runs[0]["trainable"], *(percent(mean_accuracy(runs, t)) for t in tasks),
                     f"{100 * (adapted - baseline):+.1f}",
                     "-" if merged is None else f"{100 * (merged - adapted):+.1f}", runs[0]["merge"]])
    setting = data["setting"]
    notes = [f"mean over {len(setting['seeds'])} seeds; {setting['finetune_steps']} steps, r={setting['r']}, "
             f"group size {setting['group_size']}; memory column of the JSON: {data['memory_column']}",
             *data["notes"]]
    return Table(["method", "trainable", *(f"{t} acc" for t in tasks), "mean vs qlora (points)",
                  "merge change (points)", "merge"], rows, notes)


def adapters_layouts(data: dict[str, Any]) -> Table:
    """Per layout and method: the largest rank's model state, its ratio to LoRA-on-float's, the slowest rank's step."""
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    rows: list[Sequence[object]] = []
    for r in data["rows"]:
        if "error" in r:
            rows.append([r["layout"], "-", "-", "-", "-", f"failed: {brief(r['error'])}"])
        else:
            cells.setdefault((r["layout"], r["method"]), []).append(r)
    for (layout, method), ranks in cells.items():
        floats = {r["rank"]: r["state_mb"] for r in cells.get((layout, "lora_float"), [])}
        over = [r["state_mb"] / floats[r["rank"]] for r in ranks if floats.get(r["rank"])]
        rows.append([layout, method, f"{max(r['state_mb'] for r in ranks):.2f}", ratio(max(over)) if over else "-",
                     f"{1e3 * max(r['step_s'] for r in ranks):.0f}", ""])
    setting = data["layout_setting"]
    notes = [f"Llama of hidden {setting['hidden']}, {setting['layers']} layers, adapter rank {setting['r']}, "
             f"{setting['steps']} steps on two ranks; memory: {data['memory_column']}"]
    return Table(["layout", "method", "state MB (largest rank)", "over LoRA on float (worst rank)",
                  "step ms (slowest rank)", "error"], rows, notes)


def observability(data: dict[str, Any]) -> Table:
    rows = []
    for name in dict.fromkeys(row["config"] for row in data["rows"]):
        arms = {flag: [row for row in data["rows"] if row["config"] == name and row["metrics"] is flag]
                for flag in (False, True)}
        times = {flag: [row["step_s"] for row in arm if row["step_s"] is not None] for flag, arm in arms.items()}
        hooks = [row["hook_s_per_step"] for row in arms[True] if row.get("hook_s_per_step") is not None]
        medians = {flag: statistics.median(values) if values else None for flag, values in times.items()}
        overhead = (medians[True] / medians[False]) if medians[True] and medians[False] else None
        rows.append([name, *(f"{medians[flag] * 1e3:.1f}" if medians[flag] else "-" for flag in (False, True)),
                     ratio(overhead) if overhead else "-",
                     f"{statistics.median(hooks) * 1e3:.2f}" if hooks else "-", len(times[True])])
    return Table(["config", "step ms without", "step ms with", "with / without", "ms in the callback's hooks",
                  "repetitions"], rows, [])


def dynapipe(data: dict[str, Any]) -> Table:
    rows = [[r["layout"], r["mode"], f"{r['step_ms']:.0f}", f"{r['real_tokens_per_s']:.0f}",
             percent(r["padding_fraction"]), percent(r["bubble"]), r["micro_batches_per_replica"]]
            for r in data["rows"]]
    settings = data["settings"]
    notes = ["dynamic over pack / over pad per layout (goals: the worst layout): "
             + "; ".join(f"{layout}: {ratio(s['vs_pack'])} / {ratio(s['vs_pad'])}"
                         for layout, s in sorted(data["speedups_by_layout"].items())),
             f"attention: {data['model']['attn_implementation']} in every mode (transformers' default is sdpa)",
             f"loss, dynamic vs pad over the same samples: max relative difference {data['loss_max_rel_diff']:.1e}",
             f"context {settings['context']} tokens, {settings['batch']}-sample global batches, "
             f"{settings['measured']} measured steps; {data['note']}"]
    return Table(["layout", "mode", "step ms", "real tokens/s", "padding", "bubble", "micro-batches per replica"],
                 rows, notes)


def context_parallel(data: dict[str, Any]) -> Table:
    """Per cluster, network and sequence: cp=1's step and saved bytes, each context-parallel row's against them."""
    rows: list[Sequence[object]] = []
    for r in data["rows"]:
        case = [r["cluster"], r["network"], r["method"], r["cp"], r["seq"]]
        if r.get("refused") or r.get("error"):
            status = f"refused: {brief(r['refused'])}" if r.get("refused") else f"failed: {brief(r['error'])}"
            rows.append([*case, "-", "-", "-", "-", status])
            continue
        share = "-" if r.get("activation_ratio") is None else (
            f"{percent(r['activation_ratio'])} (ideal {percent(r['ideal_ratio'])})")
        loss = r.get("loss_max_rel_diff")
        rows.append([*case, f"{r['step_ms']:.0f}", f"{r['saved_mib']:.1f}", share, percent(r.get("efficiency")),
                     "-" if loss is None else f"{loss:.1e}"])
    leg = data["longest_sequence_leg"]
    ladder = (f"longest sequence within {leg['cap_rule']}, cp={leg['cp']}: " + (
        f"failed: {brief(leg['error'])}" if "error" in leg else
        ", ".join(f"{method} {seq}" for method, seq in leg["longest"].items())
        + "; over cp=1: " + ", ".join(f"{method} {ratio(value)}" for method, value in leg["ratio"].items())))
    notes = [ladder, *planner_leg_notes(data.get("planner_leg")), f"baseline: {data['baseline']}",
             *(f"{n} ranks: {record['emulation']}" for n, record in data["rank_cpu"].items()),
             *(f"`{goal['key']}` has no figure: {goal['note']}" for goal in data.get("goals", [])
               if goal["value"] is None and goal.get("note"))]
    return Table(["cluster", "network", "method", "cp", "seq", "step ms", "saved MiB per rank",
                  "saved bytes vs cp=1", "efficiency vs cp=1", "loss rel. diff vs cp=1"], rows, notes)


def planner_leg_notes(leg: Optional[dict[str, Any]]) -> list[str]:
    """One line per plan of the context-parallel planner leg: the choice, the fastest measured layout, the regret,
    the rankings' agreement, and each layout's predicted / measured step and rank."""
    if not leg:
        return []

    def number(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.2f}"

    def layout(row: dict[str, Any]) -> str:
        if row.get("refused"):
            return f"{row['layout']} refused for memory"
        if "measured_step_ms" not in row:
            return f"{row['layout']} failed"
        return (f"{row['layout']} {row['predicted_step_ms']:.0f}/{row['measured_step_ms']:.0f} ms "
                f"(#{row['predicted_rank']}/#{row['measured_rank']})")

    notes = []
    for group in leg["groups"]:
        head = (f"planner leg (context_parallel='auto', {leg['world_size']} ranks, global batch {leg['global_batch']}),"
                f" seq {group['seq']} {group['network']}: ")
        if group.get("regret") is None:
            notes.append(head + f"failed: {brief(group.get('error', 'no regret'))}")
            continue
        notes.append(head + f"chose {group['chosen']}, fastest measured {group['best_measured']}, regret "
                     f"{100 * group['regret']:+.1f}%; Spearman {number(group['spearman'])}, Kendall "
                     f"{number(group['kendall_tau_b'])}; predicted/measured step (rank): "
                     + ", ".join(layout(row) for row in group["candidates"]))
    return notes


def muon(data: dict[str, Any]) -> Table:
    """Per layout: AdamW's, our Muon's and the common port's step, and the part after the backward."""
    rows: list[Sequence[object]] = []
    for r in data["rows"]:
        if "error" in r:
            rows.append([r["layout"], r["optimizer"], "-", "-", "-", f"failed: {brief(r['error'])}"])
            continue
        rows.append([r["layout"], r["optimizer"], f"{r['step_ms']:.0f}", f"{r['optimizer_ms']:.0f}",
                     ratio(r.get("over_adamw")), f"{r['loss_last']:.4f}"])
    notes = [f"workload: {data['workload_description']}; baseline: {data['baseline']}",
             f"ranks: {data['rank_cpu']['emulation']}; {data['network_note']}"]
    if data.get("machine", {}).get("cpu_bfloat16") is False:
        notes.append("this CPU multiplies bfloat16 without native support, so torch's bfloat16 Newton–Schulz (ours "
                     "and the port at their defaults) outweighs the forward and backward and sets both step goals' "
                     "figures here; figures from a CPU that multiplies it natively: "
                     "docs/design/data-parallel-sharding.md")
    if any(r["optimizer"] == "muon_float32" for r in data["rows"]):
        notes.append("muon_float32: ours with optim.newton_schulz_dtype=float32 (the Newton–Schulz iteration in "
                     "float32 instead of torch.optim.Muon's bfloat16), a labelled row in no goal")
    return Table(["layout", "optimizer", "step ms", "after backward ms", "step vs AdamW", "last loss"], rows, notes)


def compile_area(data: dict[str, Any]) -> Table:
    """Per width and layout: eager and compiled tokens/s, the speedup, its share of the bare block's, the counters."""
    rows: list[Sequence[object]] = []
    for r in data["rows"]:
        if "error" in r:
            rows.append([r["hidden"], r["layout"], r["mode"], "-", "-", "-", "-", f"failed: {brief(r['error'])}"])
            continue
        rows.append([r["hidden"], r["layout"], r["mode"], f"{r['tokens_per_s']:.0f}", ratio(r.get("speedup")),
                     ratio(r.get("efficiency")), f"{r['breaks']} / {r['recompiles']}", f"{r['step_ms']:.0f} ms"])
    bare = "; ".join(f"hidden {hidden}: {figures['speedup']:.2f}x ({figures['eager_ms']:.1f} -> "
                     f"{figures['compiled_ms']:.1f} ms)" for hidden, figures in data["bare_block"].items())
    notes = [f"bare block (two Llama blocks, forward and backward, one thread) compiled over eager: {bare}",
             f"baseline: {data['baseline']}; GPU leg: {data['gpu_leg']}"]
    return Table(["hidden", "layout", "mode", "tokens/s", "speedup", "vs bare block", "breaks / recompiles",
                  "step"], rows, notes)


AREAS: dict[str, Callable[[dict[str, Any]], Table]] = {
    "collectives": collectives, "merak3d": merak3d, "overlap_tp": overlap_tp, "planner": planner,
    "delta": delta, "sparse_comm": sparse_comm, "moe": moe, "adapters": adapters,
    "adapters_layouts": adapters_layouts, "scale": scale,
    "sharding": sharding, "dynapipe": dynapipe, "replay": replay, "moe_families": moe_families,
    "observability": observability, "context_parallel": context_parallel, "muon": muon, "compile": compile_area,
}
AUXILIARY: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "adapters_lr_sweep": ("adapters", adapters_lr_sweep),
    "scale.gpu": ("scale", scale_gpu),
    "delta.gpu": ("delta", delta_gpu),
    "sharding.gpu": ("sharding", sharding_gpu),
    "moe_families.gpu": ("moe_families", moe_families_gpu),
    "planner_moe": ("planner", planner_moe),
    "context_parallel_variable": ("context_parallel", context_parallel_variable),
}


# ---------------------------------------------------------------- files and page


@dataclass
class Result:
    path: Path
    name: str
    quick: bool
    data: dict[str, Any]


def load(path: Path) -> Result:
    """Read one results file and check it against the naming rule."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ResultsError(f"{path}: cannot read: {error}") from error
    if not isinstance(data, dict) or not {"label", "machine", "rows"} <= data.keys():
        raise ResultsError(f"{path}: not a benchmark result (needs label, machine and rows)")
    quick = path.name.endswith(".quick.json")
    name = path.name.removesuffix(".quick.json" if quick else ".json")
    said = data.get("quick", {"quick": True, "full": False}.get(data.get("mode")))
    if said is not None and said != quick:
        raise ResultsError(f"{path}: the file says it is a {'quick' if said else 'full'} run, its name says otherwise "
                           f"(NAME.json is a full run, NAME.quick.json a --quick run)")
    return Result(path, name, quick, data)


def with_runs(result: Result, results_dir: Path) -> Result:
    """A full run with ``goal_runs`` combined afresh from its run files (``run_files``, :func:`combine_runs`) and
    their code revisions as ``run_revisions``: the page follows the run files, not the combination stored when the
    latest run was written."""
    files = result.data.get("run_files")
    if not files:
        return result
    try:
        runs = [json.loads((results_dir / name).read_text()) for name in files]
        goal_runs = combine_runs(runs)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ResultsError(f"{result.path}: its run files ({', '.join(files)}): {error}") from error
    result.data = {**result.data, "goal_runs": goal_runs, "run_revisions": [run.get("revision") for run in runs]}
    return result


def machine_line(result: Result, page: Path) -> str:
    m = result.data["machine"]
    source = result.path.relative_to(REPO_ROOT) if result.path.is_relative_to(REPO_ROOT) else result.path
    link = os.path.relpath(result.path, page.resolve().parent)
    return (f"From [`{source}`]({link}) ({'quick' if result.quick else 'full'} run), "
            f"label **{result.data['label']}**; machine: {m['cpu_count']} CPUs ({m['usable_cpus']} usable), "
            f"{m['arch']}{cpu_features(m)}, kernel {m['kernel']}, Python {m['python']}, torch {m['torch']}; "
            f"{revisions_text(result.data)}.")


def revisions_text(data: dict[str, Any]) -> str:
    """The code revision of an area's runs (``run_revisions`` of a full run's runs, else the file's own); runs of
    more than one revision are named run by run, in bold, since their figures come from different code."""
    revisions = [revision_text(revision) for revision in data.get("run_revisions") or [data.get("revision")]]
    if len(set(revisions)) == 1:
        return f"code {revisions[0]}" + (f" (all {len(revisions)} runs)" if len(revisions) > 1 else "")
    by_revision: dict[str, list[str]] = {}
    for index, text in enumerate(revisions, start=1):
        by_revision.setdefault(text, []).append(str(index))
    return (f"**runs from {len(by_revision)} code revisions**: "
            + "; ".join(f"run{'s' if len(runs) > 1 else ''} {', '.join(runs)}: {text}"
                        for text, runs in by_revision.items()))


def cpu_features(machine: dict[str, Any]) -> str:
    """The CPU's vector capability as torch reads it, and whether it multiplies bfloat16 natively (older records
    have neither)."""
    if "cpu_capability" not in machine:
        return ""
    native = "native" if machine.get("cpu_bfloat16") else "no native"
    return f" ({machine['cpu_capability']}, {native} bfloat16 products)"


def markdown(table: Table) -> list[str]:
    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(table.headers), line(["---"] * len(table.headers)), *(line(r) for r in table.rows)]


def area_section(name: str, result: Result | None, extra: list[str], page: Path) -> list[str]:
    lines = [f"## {name}", ""]
    if result is None:
        return [*lines, f"No `{name}.json` or `{name}.quick.json` in benchmarks/results/.", ""]
    try:
        table = AREAS[name](result.data)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ResultsError(f"{result.path}: unexpected content for {name}: {error!r}") from error
    notes = [*table.notes, *extra]
    goals = [f"goal: {goal_line(entry)} — {entry['definition']}" for entry in result.data.get("goal_runs", {}).values()]
    return [*lines, machine_line(result, page), "", *markdown(table), "",
            *(f"- {note}" for note in [*goals, *notes]), ""]


def goals_section(chosen: dict[str, Result | None]) -> list[str]:
    """Every goal of every area, over its full runs: the figure a reader checks first."""
    rows = []
    for name, result in chosen.items():
        for entry in ([] if result is None else result.data.get("goal_runs", {}).values()):
            spread = "-" if entry["min"] is None else f"{entry['min']:.3g} – {entry['max']:.3g}"
            median = "-" if entry["median"] is None else f"{entry['median']:.3g}"
            verdict = {True: "met", False: "**missed**", None: undecided(entry)}[entry["met"]]
            unmeasured = entry.get("unmeasured_runs", 0)
            worst = ", ".join(dict.fromkeys(str(c) for c in entry["worst_configs"] if c is not None)) or "-"
            rows.append([name, f"`{entry['key']}`", entry["definition"], f"{entry['direction']} {entry['target']:g}",
                         median, spread,
                         entry["runs_meeting_goal"] + (f" ({unmeasured} without a figure)" if unmeasured else ""),
                         verdict, worst,
                         f"#{entry['issue']}" + (" (quick run)" if result.quick else "")])
    if not rows:
        return []
    table = Table(["area", "goal", "definition", "target", "median", "min – max", "runs meeting", "verdict",
                   "worst configuration", "set by"], rows)
    return ["## Goals", "", "Each goal's figure is its worst configuration in a run; median and spread over the "
            "full runs that measured it (a run without a figure for a goal, its leg not run, is not counted). A goal "
            "is decided after three such runs.", "", *markdown(table), ""]


def _with_leg_goals(data: dict[str, Any], leg_goals: dict[str, Any]) -> dict[str, Any]:
    """``data`` (an area's main run) with the goals a leg of its own measured (``leg_goals``: its goal runs) in
    place of the main run's records of them (which say the main run does not measure them)."""
    return {**data, "goals": [goal for goal in data.get("goals", []) if goal["key"] not in leg_goals],
            "goal_runs": {**data.get("goal_runs", {}), **leg_goals}}


def build(results_dir: Path, page: Path) -> tuple[str, list[str]]:
    """The page's text and a log of the files used."""
    files = sorted(results_dir.glob("*.json"))
    skipped = [p for p in files if p.name.endswith(NOT_RESULTS)]
    results = [with_runs(load(p), results_dir) for p in files if p not in skipped]
    chosen = {}
    for name in AREAS:
        candidates = {r.quick: r for r in results if r.name == name}
        chosen[name] = candidates.get(False) or candidates.get(True)
    extras: dict[str, list[str]] = {name: [] for name in AREAS}
    log = []
    for result in results:
        if result.name in AUXILIARY:
            area, describe = AUXILIARY[result.name]
            try:
                extras[area].append(f"{describe(result.data)} (from `{result.path.name}`)")
            except (KeyError, TypeError, ValueError) as error:
                raise ResultsError(f"{result.path}: unexpected content: {error!r}") from error
            log.append(f"used     {result.path.name} (auxiliary, in the {area} section)")
        elif result.name in chosen and chosen[result.name] is result:
            log.append(f"used     {result.path.name} ({'quick' if result.quick else 'full'} run of {result.name})")
        elif result.name in AREAS:
            log.append(f"read     {result.path.name} (not shown: a full run of {result.name} exists)")
        else:
            log.append(f"read     {result.path.name} (no area of this page)")
    log += [f"skipped  {p.name} (trace, not a result)" for p in skipped]
    for result in results:  # a leg run on its own decides its goals in its area, over the main run's placeholder
        main_result = chosen.get(AUXILIARY[result.name][0]) if result.name in AUXILIARY else None
        if main_result is not None and not result.quick and result.data.get("goal_runs"):
            main_result.data = _with_leg_goals(main_result.data, result.data["goal_runs"])
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.results_table` from `benchmarks/results/*.json`; do not edit by hand,",
        "rerun the command. Each area shows its full run (`NAME.json`), or its `--quick` run (`NAME.quick.json`)",
        "where no full run exists. Labels: *measured* (real runs on the machine named), *emulated* (network shaped",
        "by `lightning_merak/testing/netem.py`), *simulated* (cost model). Design decisions behind the figures:",
        "[design notes](design/README.md).",
        "",
        "## Rules these figures follow",
        "",
        RULES,
        "",
        *goals_section(chosen),
    ]
    for name in AREAS:
        lines += area_section(name, chosen[name], extras[name], page)
    return "\n".join(lines).rstrip() + "\n", log


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="directory of result JSON files")
    parser.add_argument("--out", type=Path, default=DEFAULT_PAGE, help=f"page to write (default {DEFAULT_PAGE})")
    args = parser.parse_args(argv)
    try:
        text, log = build(args.results.resolve(), args.out)
    except ResultsError as error:
        print(f"results_table: {error}", file=sys.stderr)
        return 1
    print("\n".join(log))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
