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
from typing import Any

from benchmarks._auxiliary_lines import (
    adapters_lr_sweep,
    delta_gpu,
    moe_families_gpu,
    planner_moe,
    scale_gpu,
    sharding_gpu,
)
from benchmarks._table_cells import ResultsError, Table, brief, flat, met, percent, ratio
from benchmarks.report import RESULTS_DIR

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
        elif section == "memory_cap":
            value = f"{r['completed_steps']}/{r['of_steps']}" + (f" ({brief(r['error'])})" if r["error"] else "")
            rows.append([section, f"{r['strategy']} {r['layout']}", "steps completed under the cap", value,
                         r["label"]])
    notes = [f"{name}: {text}" for name, text in data["workloads"].items()]
    notes.append(f"memory cap: baseline + {data['cap_param_multiple']} × parameter bytes per rank")
    return Table(["part", "case", "figure", "value", "label"], rows, notes)


def _tp_variant(row: dict[str, Any]) -> str:
    name = "SP" if row["sequence_parallel"] else "TP"
    name += f" k={row['tp_overlap']}" if row["tp_overlap"] > 1 else ""
    return name + (" +wgrad" if row.get("weight_grad_overlap") else "")


def overlap_tp(data: dict[str, Any]) -> Table:
    variants = list(dict.fromkeys(_tp_variant(r) for r in data["rows"]))[1:]  # the first is plain TP
    groups: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in data["rows"]:
        groups.setdefault((r["ranks"], r["network"]), {})[_tp_variant(r)] = r
    rows = []
    for (ranks, network), by_variant in groups.items():
        plain = by_variant["TP"]
        passing = {target: ", ".join(v for v in variants if by_variant.get(v, {}).get(target) == "PASS") or "none"
                   for target in ("speedup_target", "exposed_target")}
        rows.append([ranks, network, f"{plain['step_ms']:.0f}", percent(plain["comm_of_plain_step"]),
                     *(ratio(by_variant[v]["speedup_vs_plain_tp"]) if v in by_variant else "-" for v in variants),
                     passing["speedup_target"], passing["exposed_target"]])
    unequal = [f"{r['ranks']} ranks {r['network']} {_tp_variant(r)}" for r in data["rows"] if r["loss_equal"] == "FAIL"]
    targets = ", ".join(f"{k} {v}" for k, v in data["targets"].items())
    return Table(
        ["ranks", "link", "plain TP ms", "comm of plain step", *variants, "speedup target met", "exposed target met"],
        rows,
        [f"variant columns: plain TP's step time / the variant's (>1 is faster); k = `tp_overlap`, "
         f"+wgrad = `tp_weight_grad_overlap`, SP = sequence parallelism; the JSON judges SP variants against SP "
         f"without overlap. Targets: {targets}.",
         "losses equal to plain TP in every run" if not unequal else f"losses differ: {', '.join(unequal)}"],
    )


def planner(data: dict[str, Any]) -> Table:
    rows = [[r["layout"], f"{1e3 * r['measured_s']:.0f}", f"{1e3 * r['predicted_s']:.0f}",
             percent(r["error"], signed=True), percent(r.get("paired_error"), signed=True),
             f"{1e3 * r['replay_predicted_s']:.0f}" if "replay_predicted_s" in r else "-",
             percent(r.get("replay_error"), signed=True), percent(r.get("replay_paired_error"), signed=True)]
            for r in data["rows"]]
    s = data["summary"]
    notes = [
        f"cost model: mean |error| {percent(s['mean_abs_error'])}, max {percent(s['max_abs_error'])}; paired mean "
        f"{percent(s.get('mean_abs_paired_error'))}, max {percent(s.get('max_abs_paired_error'))}",
        f"trace replay: mean |error| {percent(s.get('mean_abs_replay_error'))}, max "
        f"{percent(s.get('max_abs_replay_error'))}; paired by round mean "
        f"{percent(s.get('mean_abs_replay_paired_error'))}, "
        f"max {percent(s.get('max_abs_replay_paired_error'))}; its pick {s.get('replay_pick', '-')}, regret "
        f"{percent(s.get('replay_regret'))}",
        f"picked {s['pick']}, fastest measured {s['best_measured']}, regret {percent(s['regret'])}",
        "targets: " + ", ".join(f"{k.removesuffix('_target_met')} {met(v)}" for k, v in s.items()
                                if k.endswith("_target_met")),
        f"{data['rounds']} rounds; {data['workload']}, {data['world_size']} ranks; {data['predictions']}",
    ]
    return Table(["layout", "measured ms", "predicted ms", "error", "paired error", "replay ms", "replay error",
                  "replay paired"], rows, notes)


def delta(data: dict[str, Any]) -> Table:
    rows = []
    for r in data["rows"]:
        if r["config"] == "none":
            continue
        if r["leg"] == "max batch":
            rows.append([r["leg"], r["config"], "-", "-", "-", f"{r['batch']} ({ratio(r['batch_vs_none'])})"])
        else:
            rows.append([r["leg"], r["config"], percent(r["activation_vs_none"]),
                         percent(r.get("allocated_vs_none")), ratio(r["time_vs_none"]), "-"])
    notes = ["targets: " + ", ".join(f"{k} {met(v)}" for k, v in flat(data["targets"]).items()),
             f"GPU leg: {data['gpu_leg']}"]
    return Table(["leg", "config", "activation RSS, share of none's", "allocator in-use, share of none's",
                  "step time vs none", "max batch (vs none)"], rows, notes)


def sparse_comm(data: dict[str, Any]) -> Table:
    targets = {(t["ranks"], t["network"], t["method"]): t for t in data["targets"]}
    rows = []
    for r in data["rows"]:
        if r["method"] == "dense":
            continue
        checks = {k: v for k, v in targets.get((r["ranks"], r["network"], r["method"]), {}).items()
                  if k not in ("ranks", "network", "method")}
        failed = [k for k, v in checks.items() if v is False]
        verdict = "-" if not checks else ("all met" if not failed else "not met: " + ", ".join(failed))
        rows.append([r["ranks"], r["network"], r["method"], percent(r["emb_bytes_vs_dense"]),
                     ratio(r["speedup_vs_dense"]), percent(r["loss_vs_dense"], signed=True), verdict])
    checked = dict.fromkeys(k for t in data["targets"] for k in t if k not in ("ranks", "network", "method"))
    notes = [f"workload: {', '.join(f'{k} {v}' for k, v in data['workload'].items())}",
             f"targets checked: {', '.join(checked)}", f"GPU leg: {data['gpu_leg']}"]
    return Table(["ranks", "link", "method", "embedding bytes vs dense", "speed vs dense", "final loss vs dense",
                  "targets"], rows, notes)


def moe(data: dict[str, Any]) -> Table:
    rows = []
    for r in data["rows"]:
        p = r["policies"]
        rows.append([r["config"], f"{p['ours']['max_over_mean_all_steps']:.3f}",
                     f"{p['ours']['max_over_mean_worst_step']:.3f}", f"{p['dropless']['max_over_mean_all_steps']:.3f}",
                     ratio(p["deepspeed"]["step_ms"] / p["ours"]["step_ms"]),
                     f"{ratio(r['ours_over_best_baseline'])} ({r['best_baseline']})",
                     ", ".join(f"{k} {n}" for k, n in p["ours"]["kinds"].items()),
                     str(p["ours"].get("explored_calls", "-")),
                     ratio(p["ours_model_only"]["step_ms"] / p["ours"]["step_ms"]) if "ours_model_only" in p else "-"])
    simulated = data["simulated"]["rows"]
    goals = data["goals"]
    notes = [
        f"{data['world_size']} ranks, 8 experts, top-2; configurations: base at 400 Mbit/s on each routing "
        "(drift4: Zipf 1.2 shifting every 4 steps; rotateK: hot set redrawn every K steps), then one factor "
        "swept on rotate3",
        f"all_steps_max_over_mean {data['all_steps_max_over_mean']:.3f} ({data['all_steps_max_over_mean_config']}) "
        f"{met(goals['all_steps_max_over_mean_le_1.15'])} (goal ≤ 1.15); ours_over_best_baseline_min "
        f"{data['ours_over_best_baseline_min']:.3f} ({data['ours_over_best_baseline_min_config']}) "
        f"{met(goals['ours_over_best_baseline_min_ge_1.0'])} (goal ≥ 1.0)",
        f"{data['simulated']['label']} with this run's calibrated cost model, ours over the best baseline: "
        + ", ".join(f"{s['ranks']} ranks {s['routing']} {ratio(s['ours_over_best_baseline'])}" for s in simulated),
    ]
    return Table(["configuration", "ours load max/mean (all steps)", "ours worst step", "dropless all steps",
                  "ours vs DeepSpeed-MoE", "ours vs best baseline", "kinds ours ran (layer-steps)",
                  "explored (online check)", "ours vs model only"], rows, notes)


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


def scale(data: dict[str, Any]) -> Table:
    top = max(data["ladder_layers"])
    runs = {r["leg"]: r for r in data["rows"] if r["section"] == "memory" and r["layers"] == top}
    loads = {r["leg"]: r for r in data["rows"] if r["section"] == "load"}
    rows = []
    for r in (r for r in data["rows"] if r["section"] == "largest"):
        run, load = runs.get(r["leg"], {}), loads.get(r["leg"], {})
        if r["refused"]:
            rows.append([r["leg"], f"refused: {brief(r['error'])}", "-", "-", "-", "-"])
            continue
        fitted = "none" if r["layers"] is None else (
            f"{r['layers']} layers, {r['params_m']:.1f} M params" + (" (weights + AdamW exceed the cap)"
                                                                     if r["full_state_exceeds_cap"] else ""))
        used = "-" if run.get("max_used_mb") is None else f"{run['max_used_mb']:.0f}"
        rows.append([r["leg"], fitted, used, ratio(run.get("peak_over_ideal")),
                     "-" if load.get("load_s") is None else f"{load['load_s']:.2f}",
                     "-" if load.get("gb_per_s") is None else f"{load['gb_per_s']:.2f}"])
    reference = loads.get("from_pretrained (1 process)")
    if reference:
        rows.append([reference["leg"], "-", "-", "-", f"{reference['load_s']:.2f}", f"{reference['gb_per_s']:.2f}"])
    goal, rel_err = data["peak_over_ideal_goal"], data["logits_max_rel_err"]
    notes = [
        f"{data['workload']}; cap {data['cap_mb']:.0f} MiB per rank above the baseline; ladder "
        f"{data['ladder_layers']} decoder layers; {data['steps']} training steps per run",
        f"peak/ideal: worst rank's (peak RSS − baseline) / (4 × its parameter bytes + measured activations); "
        f"worst merak3d layout {ratio(data['peak_over_ideal'])} ({data['peak_over_ideal_layout']}), goal ≤ {goal} "
        f"{met(None if data['peak_over_ideal'] is None else data['peak_over_ideal'] <= goal)}",
        *([f"with compact_host_memory=True: worst {ratio(data['peak_over_ideal_compact'])} "
           f"({data['peak_over_ideal_compact_layout']}), "
           f"{met(data['peak_over_ideal_compact'] <= goal)}; step time up to "
           f"{data['compact_step_time_ratio_max']:.2f}× the default's"]
          if data.get("peak_over_ideal_compact") is not None else []),
        f"logits vs from_pretrained, max relative error over layouts: {'-' if rel_err is None else f'{rel_err:.1e}'}; "
        f"export round trip (load → merak3d checkpoint → merak-export) max |diff|: {data['export_roundtrip_max_abs']}",
    ]
    return Table(["leg", "largest model under the cap", f"MiB above baseline, {top} layers",
                  f"peak/ideal, {top} layers", "load s", "load GB/s"], rows, notes)


def sharding(data: dict[str, Any]) -> Table:
    rows = []
    for r in (r for r in data["rows"] if r["section"] == "modes"):
        if r["error"]:
            rows.append([r["layout"], r["name"], ("refused: " if r["refused"] else "failed: ") + brief(r["error"]),
                         *["-"] * 7])
            continue
        worst = r["worst_rank"]
        fraction = r.get("exposed_grad_comm_fraction")
        rows.append([r["layout"], r["name"], f"{r['step_ms']:.0f}", ratio(r.get("step_over_merak3d_none")),
                     ratio(r.get("step_over_ddp")), ratio(r.get("step_over_fsdp2")),
                     ratio(r.get("optimizer_state_ratio")), "-" if fraction is None else f"{fraction:.2f}",
                     "-" if r.get("loss_max_rel_diff_vs_ddp") is None else f"{r['loss_max_rel_diff_vs_ddp']:.1e}",
                     f"{r['used_mb'][worst]:.0f} ({ratio(r['peak_over_ideal'])})"])
    largest = ", ".join(f"{r['name']} {r['largest_layers']} layers ({r['params_m']:.1f} M)" if r["params_m"]
                        else f"{r['name']} {'none' if r['error'] is None else brief(r['error'])}"
                        for r in data["rows"] if r["section"] == "largest")
    met_goals = data["goals_met"]
    notes = [
        f"{data['workload']}, {data['steps']} steps, network {data['network']}; step time: median of the slowest "
        "rank; exposed: reduction wait with overlap over without; MiB: worst rank's peak above its baseline "
        + (f"in a {data['memory_steps']}-step run with glibc's mmap threshold pinned, so that freed tensors leave "
           "the resident size " if data.get("memory_steps") else "")
        + "(its peak over the ideal: parameters, the mode's gradients and AdamW state, activations)",
        "goals: " + ", ".join(f"{key} {'-' if data[key] is None else f'{data[key]:.3g}'} ({data['goals'][key]}: "
                              f"{met(met_goals[key])})" for key in data["goals"]),
        f"largest model under {data['cap_mb']:.0f} MiB per rank, 4 ranks ({data['search_workload']}): {largest}",
    ]
    short = data.get("exposed_grad_comm_fraction_short_sequences")
    if data.get("exposed_grad_comm_fraction_workload"):
        notes.append(f"exposed_grad_comm_fraction measured on {data['exposed_grad_comm_fraction_workload']}; on the "
                     f"short sequences {'-' if short is None else f'{short:.2f}'}, where a rank's backward is shorter "
                     "than reducing its gradients at 1 Gbit/s")
    default_zero1 = data.get("zero1_default_step_over_merak3d_none")
    if default_zero1 is not None:
        notes.append(f"ZeRO-1 step over merak3d none (worst layout): {ratio(default_zero1)} by default, "
                     f"{ratio(data['zero1_step_over_ddp'])} with overlap_param_gather=True (each layout's median of "
                     "back-to-back pairs); the latter over "
                     f"Lightning DDP {ratio(data.get('zero1_step_over_lightning_ddp'))}")
    return Table(["layout", "run", "step ms", "vs merak3d none", "vs DDP", "vs FSDP2", "optimizer bytes vs none",
                  "exposed reduce", "loss vs DDP", "MiB (peak/ideal)"], rows, notes)


def dynapipe(data: dict[str, Any]) -> Table:
    rows = [[r["layout"], r["mode"], f"{r['step_ms']:.0f}", f"{r['real_tokens_per_s']:.0f}",
             percent(r["padding_fraction"]), percent(r["bubble"]), r["micro_batches_per_replica"]]
            for r in data["rows"]]
    settings = data["settings"]
    notes = [f"dynamic over pack {ratio(data['speedup_vs_pack'])} (goal 1.3x), "
             f"over pad {ratio(data['speedup_vs_pad'])} (goal 2x) at {data['headline_layout']}; "
             + "; ".join(f"{layout}: {ratio(s['vs_pack'])} / {ratio(s['vs_pad'])}"
                         for layout, s in sorted(data["speedups_by_layout"].items())),
             f"loss, dynamic vs pad over the same samples: max relative difference {data['loss_max_rel_diff']:.1e}",
             f"context {settings['context']} tokens, {settings['batch']}-sample global batches, "
             f"{settings['measured']} measured steps; {data['note']}"]
    return Table(["layout", "mode", "step ms", "real tokens/s", "padding", "bubble", "micro-batches per replica"],
                 rows, notes)


def replay(data: dict[str, Any]) -> Table:
    """Trace replay (dPRO): the traced steps replayed, what-ifs against measured runs, simulated rank counts."""
    rows = [[r["kind"], r["what"], f"{r['predicted_ms']:.0f}",
             "-" if r.get("measured_ms") is None else f"{r['measured_ms']:.0f}",
             percent(r.get("error"), signed=True)] for r in data["rows"]]
    overhead = data.get("recording_overhead", {})
    notes = [f"replay error {percent(data['replay_error'])} (goal ≤ {percent(data['replay_target'])}), what-if error "
             f"max {percent(data['whatif_error_max'])} (goal ≤ {percent(data['whatif_target'])}; without the "
             f"probes {percent(data.get('whatif_error_max_without_probes'))}; paired by repeat "
             f"{percent(data.get('whatif_error_max_paired'))})",
             f"recording costs {overhead.get('overhead_per_op_us', float('nan')):.0f} µs per collective or "
             f"point-to-point op; Perfetto example: benchmarks/results/{data['perfetto_example']}",
             f"{data['workload']}; {data['note']}"]
    return Table(["kind", "what", "predicted ms", "measured ms", "error"], rows, notes)


def moe_families(data: dict[str, Any]) -> Table:
    rows = [[r["family"], "failed", brief(r["error"]), "", "", "", "", ""] if "error" in r else
            [r["family"], f"{r['num_experts']} / top-{r['top_k']}", f"{r['output_diff']:.1e} / {r['grad_diff']:.1e}",
             *(f"{r['step_ms'][v]:.1f}" for v in ("eager", "grouped_mm", "ours")),
             f"{ratio(r['speedup_vs_eager'])} / {ratio(r['speedup_vs_grouped_mm'])}", ratio(r["exchange_cost"])]
            for r in data["rows"]]
    goals = data["goals"]
    notes = [
        f"ep={data['ep']} on {data['world_size']} {data['backend']} ranks, tiny configs from each family's config "
        f"class (hidden {data['size']['hidden']}, batch {data['size']['batch']} × {data['size']['seq']} per rank"
        + (", the family's own routing and width proportions" if data["size"].get("intermediate") == "family"
           else "") + "), "
        f"ours: {data.get('ours', 'merak_ep')}; speedups: median over {_timed_steps(data)} interleaved rounds of "
        "the per-round ratio (ratios of medians and of fastest steps in the JSON); eager and grouped_mm hold every "
        "expert on every rank; exchange cost: ours over our grouped core without expert parallelism",
        f"families_exact: {', '.join(data['families_exact'])}; max_output_diff {data['max_output_diff']:.1e} "
        f"{met(goals['max_output_diff_le_1e-5'])} (goal ≤ 1e-5); speedup_vs_hf_min "
        f"{ratio(data['speedup_vs_hf_min'])} {met(goals['speedup_vs_hf_min_ge_1.3'])} (goal ≥ 1.3)",
        "refused: " + ", ".join(sorted(data["families_refused"])),
        _pp2_ep2_note(data["pp2_ep2"]),
    ]
    legs = (("few_experts", "8–16 experts per family, narrow widths"), ("large", "larger size"))
    notes.extend(_size_leg_note(name, data[key]) for key, name in legs if data.get(key, {}).get("rows"))
    replicated = [r["replicated_over_ours"] for r in data["rows"] if "replicated_over_ours" in r]
    if replicated:
        notes.append(f"each layer's hottest expert shadowed on every rank (Pro-Prophet/FasterMoE replicas run by "
                     f"merak_ep): max diff from ours {data['max_replicated_diff']:.1e}, step "
                     f"{ratio(min(replicated))}–{ratio(max(replicated))} of ours")
    return Table(["family", "experts / k", "output / grad max diff", "eager ms", "grouped_mm ms", "ours ms",
                  "ours vs eager / grouped_mm", "exchange cost"], rows, notes)


def _timed_steps(data: dict[str, Any]) -> str:
    """The goal leg's timed rounds per family: one count, or its range where cheap families ran longer."""
    counts = [r.get("timed_steps", data["steps"]) for r in data["rows"] if "error" not in r] or [data["steps"]]
    return str(min(counts)) if min(counts) == max(counts) else f"{min(counts)}–{max(counts)}"


def _size_leg_note(name: str, leg: dict[str, Any]) -> str:
    """A second size of the families' comparison: its shape and the range of ours over each baseline."""
    speedups = [r["speedup_vs_eager"] for r in leg["rows"] if "speedup_vs_eager" in r]
    versus_mm = [r["speedup_vs_grouped_mm"] for r in leg["rows"] if "speedup_vs_grouped_mm" in r]
    size = leg["size"]
    intermediate = f", intermediate {size['intermediate']}" if "intermediate" in size else ""
    return (f"{name} (hidden {size['hidden']}{intermediate}, batch {size['batch']} × {size['seq']} per rank): "
            f"ours vs eager {ratio(min(speedups))}–{ratio(max(speedups))}, vs grouped_mm "
            f"{ratio(min(versus_mm))}–{ratio(max(versus_mm))}")


def _pp2_ep2_note(leg: dict[str, Any]) -> str:
    """The merak3d pipeline × expert-parallel leg: each family's loss difference and speed, or why it did not run."""
    if leg.get("status") != "measured":
        return f"pp=2 × ep=2: {leg.get('status')} ({leg.get('reason', '')})"
    cells = [f"{r['family']} {ratio(r['speedup_vs_eager'])} / {ratio(r['speedup_vs_grouped_mm'])} (loss diff "
             f"{r['loss_diff']:.1e})" if "error" not in r else f"{r['family']} failed: {brief(r['error'])}"
             for r in leg["rows"]]
    return (f"merak3d pp=2 × ep=2 ({leg['world_size']} ranks, {leg['steps']} steps; ours vs eager / grouped_mm in the "
            "same layout): " + ", ".join(cells))


AREAS: dict[str, Callable[[dict[str, Any]], Table]] = {
    "collectives": collectives, "merak3d": merak3d, "overlap_tp": overlap_tp, "planner": planner,
    "delta": delta, "sparse_comm": sparse_comm, "moe": moe, "adapters": adapters, "scale": scale,
    "sharding": sharding, "dynapipe": dynapipe, "replay": replay, "moe_families": moe_families,
}
AUXILIARY: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "adapters_lr_sweep": ("adapters", adapters_lr_sweep),
    "scale.gpu": ("scale", scale_gpu),
    "delta.gpu": ("delta", delta_gpu),
    "sharding.gpu": ("sharding", sharding_gpu),
    "moe_families.gpu": ("moe_families", moe_families_gpu),
    "planner_moe": ("planner", planner_moe),
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


def machine_line(result: Result, page: Path) -> str:
    m = result.data["machine"]
    source = result.path.relative_to(REPO_ROOT) if result.path.is_relative_to(REPO_ROOT) else result.path
    link = os.path.relpath(result.path, page.resolve().parent)
    return (f"From [`{source}`]({link}) ({'quick' if result.quick else 'full'} run), "
            f"label **{result.data['label']}**; machine: {m['cpu_count']} CPUs ({m['usable_cpus']} usable), "
            f"{m['arch']}, kernel {m['kernel']}, Python {m['python']}, torch {m['torch']}.")


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
    return [*lines, machine_line(result, page), "", *markdown(table), "", *(f"- {note}" for note in notes), ""]


def build(results_dir: Path, page: Path) -> tuple[str, list[str]]:
    """The page's text and a log of the files used."""
    files = sorted(results_dir.glob("*.json"))
    skipped = [p for p in files if p.name.endswith(NOT_RESULTS)]
    results = [load(p) for p in files if p not in skipped]
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
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.results_table` from `benchmarks/results/*.json`; do not edit by hand,",
        "rerun the command. Each area shows its full run (`NAME.json`), or its `--quick` run (`NAME.quick.json`)",
        "where no full run exists. Labels: *measured* (real runs on the machine named), *emulated* (network shaped",
        "by `lightning_merak/testing/netem.py`), *simulated* (cost model). Design decisions behind the figures:",
        "[design notes](design/README.md).",
        "",
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
