"""One-line notes that auxiliary results files (GPU legs, the adapters' learning-rate sweep) add to an area of
``docs/results.md``."""

from __future__ import annotations

from typing import Any

from benchmarks._table_cells import brief, percent, ratio


def adapters_lr_sweep(data: dict[str, Any]) -> str:
    """One line for the adapters section: the best validation rate of each method."""
    best: dict[str, dict[str, Any]] = {}
    for r in data["rows"]:
        if r["method"] not in best or r["accuracy"] > best[r["method"]]["accuracy"]:
            best[r["method"]] = r
    return "learning-rate sweep (validation accuracy on `max`): best " + ", ".join(
        f"{m} {r['lr']:g} ({percent(r['accuracy'])})" for m, r in best.items())


def scale_gpu(data: dict[str, Any]) -> str:
    """One line for the scale section: the one-GPU leg's memory and load against its baselines."""
    memory = [r for r in data["rows"] if r["section"] == "memory"]
    loads = {r["leg"]: r for r in data["rows"] if r["section"] == "load"}
    ours = next(r for r in loads.values() if r["leg"].startswith("merak3d"))
    reference = next(r for r in loads.values() if r["leg"].startswith("from_pretrained"))
    return (f"GPU leg ({data['device']}, torch {data['machine']['torch']}, {data['workload']}, fp32, one rank): "
            "peak CUDA allocation / ideal " + ", ".join(
                f"{r['leg']} {ratio(r.get('peak_over_ideal'))} (step {r['step_s']:.2f} s)" if r.get("error") is None
                else f"{r['leg']} failed: {brief(r['error'])}" for r in memory)
            + f"; load {ours['gb_per_s']:.2f} GB/s vs from_pretrained(device_map=cuda) {reference['gb_per_s']:.2f} "
            f"({ours['gb_per_s'] / reference['gb_per_s']:.2f}×), logits rel err {ours['logits_rel_err']:.1e}; "
            f"not run: {data['not_run']}")


def delta_gpu(data: dict[str, Any]) -> str:
    """One line for the delta section: the one-GPU leg's activation memory and step time against ``none``."""
    setting = data["setting"]
    cells = [f"{r['config']} failed: {brief(r['error'])}" if r.get("error") else
             f"{r['config']} {ratio(r['activation_vs_none'])} memory, {ratio(r['time_vs_none'])} time"
             for r in data["rows"]]
    return (f"GPU leg ({data['device']}, torch {data['machine']['torch']}; BenchGPT hidden {setting['hidden']}, "
            f"{setting['layers']} layers, batch {setting['batch']} × {setting['seq']}; budget "
            f"{data['delta_budget_fraction']:g} of none's saved activations; CUDA allocator peak above the start): "
            + ", ".join(cells) + f"; targets {data['targets']}")


def sharding_gpu(data: dict[str, Any]) -> str:
    """One line for the sharding section: the one-GPU precision leg against Lightning's single-device training."""
    cells = []
    for r in data["rows"]:
        if r.get("refused"):
            cells.append(f"{r['precision']} refused by Lightning here ({brief(r['refused'])})")
        elif r.get("error"):
            cells.append(f"{r['precision']} failed: {brief(r['error'])}")
        else:
            floor = r.get("lightning_rerun_rel_diff")
            cells.append(f"{r['precision']} loss rel diff {r['loss_max_rel_diff']:.1e}"
                         + ("" if floor is None else f" (Lightning against itself {floor:.1e})") + ", step "
                         f"{ratio(r['step_over_lightning'])}, peak {ratio(r['peak_over_lightning'])}, optimizer "
                         f"in {r['optimizer_dtype']}")
    return (f"GPU leg ({data['device']}, torch {data['machine']['torch']}, {data['workload']}, {data['steps']} steps, "
            "merak3d dp1 against Lightning's single-device training): " + "; ".join(cells)
            + f"; not run: {data['not_run']}")


def planner_moe(data: dict[str, Any]) -> str:
    """One line for the planner section: each merak_ep layout's predicted step against its measured one."""
    cells = [f"{r['layout']} predicted {1e3 * r['predicted_s']:.0f} ms (exchange "
             f"{1e3 * r['predicted_components_s']['expert_all_to_all']:.0f}) vs measured "
             f"{1e3 * r['measured_s']:.0f} ms ({percent(r['error'], signed=True)})" for r in data["rows"]]
    return (f"MoE layouts (`--moe`, {data['workload']}, {data['rounds']} rounds, medians; moe.experts=merak_ep, the "
            "plan's own profile): " + "; ".join(cells))


def context_parallel_variable(data: dict[str, Any]) -> str:
    """One line for the context-parallel section: each mode's step in the latest run of ``--leg variable`` (its goal
    is in the section's goal lines), and the per-sample mode planned on the model shape's cost, a row of its own."""
    steps: dict[str, list[float]] = {}
    for r in data["rows"]:
        steps.setdefault(str(r["mode"]), []).append(r["step_s"])
    cells = [f"{f'fixed cp={mode}' if mode.isdigit() else mode} {1e3 * sorted(values)[len(values) // 2]:.0f} ms"
             for mode, values in steps.items()]
    line = f"variable-length leg (`--leg variable`, {data['mix']}): median step " + ", ".join(cells)
    shape_cost = data.get("shape_cost_speedup_by_run")
    if shape_cost:
        line += (f"; best fixed over per_micro_batch planned on the shape's FLOP ratios (nothing measured) "
                 f"{min(shape_cost.values()):.2f}–{max(shape_cost.values()):.2f} over this run's repetitions (not "
                 "the goal's row)")
    return line
