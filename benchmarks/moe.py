"""MoE balance and speed on an emulated cluster: ours vs DeepSpeed-MoE, dropless dispatch and FasterMoE shadowing.

Run from the repo root, as root (shaped links need network namespaces)::

    python -m benchmarks.moe [--quick] [--out PATH] [--configs NAME ...] [--policies POLICY ...]
                             [--world-size N] [--unpinned]

Two ranks, each pinned to one core of this 2-core machine (:func:`lightning_merak.testing.cores.pin_rank_to_core`),
emulate one device per rank. Four ranks on the two cores do not: the scheduler hands an idle rank's core
to the busiest one (measured: a rank computing alone runs 2.0× its shared rate unpinned, 3.1× pinned two
to a core, 1.05× pinned one to a core), so an imbalance costs less than its rows, and a replica's copy
competes with expert compute for the same cores; both favour unbalanced plans in a way a GPU cluster
would not. Balance is easier at two ranks (four experts per rank average out: dropless dispatch reads
max/mean 1.05–1.11 on the base routings against 1.33–1.41 at four), so the JSON records each
configuration's dropless max/mean beside ours. ``--world-size 4 --unpinned`` is the earlier setting.

Each rank sits in its own network namespace on a tbf-shaped link (``lightning_merak.testing.netem``;
this kernel cannot emulate latency, only rate), so figures are labelled *emulated*; one cluster
is launched per link rate. Model: ``layers`` blocks of [dense residual layer → MoE layer] with
``experts`` experts over all ranks (ep_size = world size), top-2. The gate is fixed and no optimizer
steps, so every policy sees the same routing; policies take turns step by step on identical data.

Routings (:mod:`benchmarks._moe_routing`): a Zipf law whose hot order drifts by one expert every 4
steps (issue #5's), and hot sets redrawn every k = 1, 3, 10 steps. The sweep varies one of skew,
link rate, expert size and tokens per rank at a time around the base configuration.

Policies (:mod:`benchmarks._moe_worker`):

* ``deepspeed``: ``deepspeed.moe.layer.MoE`` itself, ``drop_tokens=False`` (capacity = the largest
  count, so imbalance costs time instead of dropping tokens);
* ``dropless``: our layer, dropless split-size all-to-all, no replication;
* ``fastermoe``: our layer, dropless, FasterMoE shadowing planned from each step's counts;
* ``ours``: our layer, dropless, the step planner (``placement="auto"``: no replication, shadowing
  or Pro-Prophet replica sets priced on each step's counts, the previous step's plan prefetched
  where it pays) + Lancet chunks (auto) + expert weight gradients under the backward all-to-all;
* full run only, drift4 and rotate1 routings: ``deepspeed_cf1.25`` (drops tokens), ``ours_previous`` (Pro-Prophet
  as published: plans from the previous step's counts), ``ours_one_chunk`` (no Lancet chunks),
  ``ours_no_dw_overlap``, ``ours_block`` (block-scope Lancet), ``ours_model_only`` (no online plan check:
  the cost model's choice every call);
* diagnostics, on request (``--policies``, with ``--configs`` to run a few configurations):
  ``ours_shadowing`` (ours' code path offered only shadowing: its overhead beside ``fastermoe``) and
  ``ours_sets`` (only Pro-Prophet's replica sets, no check: what balance costs in time) and
  ``ours_speed_only`` (the check choosing on speed alone, ``balance_tolerance=0``).

Every policy runs 4 untimed warm-up steps (8 layer calls): besides the first calls' one-off costs, they
cover most of the online plan check's first run of each arm (explorations in timed steps are counted).
Per configuration and policy: load max/mean of tokens computed per rank, per step and over all
steps; step time (median over timed steps of the slowest rank); the kinds ours ran, with chunks, how
many calls the online plan check explored, and per arm the median measured exchange time (this rank's
forward + backward) over the cost model's prediction; per layer call the planning time, per kind the
exchange time, and per timed step its time and the kinds its layers ran (``steps``). Top level:
``all_steps_max_over_mean`` (ours, worst configuration, every step counted; goal ≤ 1.15) and
``ours_over_best_baseline_min`` (worst configuration's fastest baseline over ours; goal ≥ 1.0). That
ratio is paired: per timed step the baseline's time over ours (they ran back to back), the median over
steps, its quartiles beside it; a load that changes more slowly than a step cancels, where a ratio of two
medians keeps it (step times move ±10–30 % from step to step on a shared machine). A second table
prices 8–64 ranks on the same routings with the cost model calibrated in
this run: it is *simulated* (:mod:`benchmarks._moe_simulate`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks._moe_routing import Routing
from benchmarks._moe_simulate import simulate
from benchmarks._moe_worker import (
    BASELINES,
    DIAGNOSTIC_KINDS,
    EXTRA_POLICIES,
    RANKS_TIMEOUT_S,
    SPEED_ONLY,
    Config,
    worker,
)
from benchmarks.report import default_out, out_help

REPO_ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2
GOAL_MAX_OVER_MEAN = 1.15
GOAL_OURS_OVER_BEST = 1.0
ROUTINGS = (Routing("drift", 4), Routing("rotate", 1), Routing("rotate", 3), Routing("rotate", 10))


def configs(quick: bool, world_size: int = WORLD_SIZE, pin_ranks: bool = True) -> list[Config]:
    """The base configuration on every routing, then one-factor sweeps on hot sets rotating every 3 steps."""
    base = Config(name="", routing=ROUTINGS[0], rate_mbit=400, hidden=128, ffn=512,
                  tokens_per_rank=1024 if quick else 2048, layers=2, experts=8,
                  warmup_steps=4, steps=10 if quick else 16, world_size=world_size, pin_ranks=pin_ranks)
    out = []
    for routing in ROUTINGS:
        extras = not quick and routing in ROUTINGS[:2]
        policies = base.policies + EXTRA_POLICIES if extras else base.policies
        out.append(replace(base, name=f"base/{routing.label}", routing=routing, policies=policies))
    swept = replace(base, routing=Routing("rotate", 3))
    skews = (0.8, 1.6) if quick else (0.6, 1.6, 2.0)
    rates = (200, 1000)
    ffns = (256, 1024)
    tokens = (512, 2048) if quick else (1024, 4096)
    out += [replace(swept, name=f"skew/{s:g}", routing=Routing("rotate", 3, s)) for s in skews]
    out += [replace(swept, name=f"rate/{r}Mbit", rate_mbit=r) for r in rates]
    out += [replace(swept, name=f"expert/ffn{f}", ffn=f) for f in ffns]
    out += [replace(swept, name=f"tokens/{t}", tokens_per_rank=t) for t in tokens]
    return out


def _launch(group: list[Config], quick: bool, tmp: Path) -> list[dict[str, Any]]:
    from lightning_merak.testing.netem import EmulatedCluster, LinkSpec

    configs_path, result_path = tmp / "configs.json", tmp / "records.json"
    configs_path.write_text(json.dumps([asdict(c) for c in group]))
    result_path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "benchmarks.moe", "--worker", str(configs_path), str(result_path)]
    with EmulatedCluster(group[0].world_size, LinkSpec(rate_mbit=group[0].rate_mbit)) as cluster:
        cluster.run(argv, timeout_s=RANKS_TIMEOUT_S, cwd=REPO_ROOT,
                    extra_env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)})
    return json.loads(result_path.read_text())


def _loads(step: dict[str, Any], experts: int) -> list[list[int]]:
    """Tokens computed per rank in each layer of one step, under the plan that step ran."""
    from lightning_merak.plugins.moe import Padding, PlacementPlan, Replication, rank_loads

    out = []
    for layer in step["layers"]:
        world = len(layer["counts"])
        plan = PlacementPlan(experts, world, tuple(Replication(r["expert"], r["owner"], tuple(r["replicas"]))
                                                  for r in layer["plan"]))
        out.append(rank_loads(layer["counts"], plan, Padding("dropless"), experts // world).computed)
    return out


def _ratio(loads: list[int]) -> float:
    return max(loads) / statistics.mean(loads)


def _check_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """What the online plan check did: arms run (kind/timing/chunks), explorations, measured over predicted."""
    layers = [layer for s in steps for layer in s["layers"] if layer.get("corrected_s") is not None]
    if not layers:
        return {}
    arms = [f"{layer['kind']}/{layer['timing']}/x{layer['chunks']}" for layer in layers]
    ratios: dict[str, list[float]] = {}
    for arm, layer in zip(arms, layers):
        if layer["predicted_s"] > 0 and layer["measured_s"] > 0:
            ratios.setdefault(arm, []).append(layer["measured_s"] / layer["predicted_s"])
    return {"arms": {a: arms.count(a) for a in sorted(set(arms))},
            "explored_calls": sum(layer["explored"] for layer in layers),
            "measured_over_predicted": {a: round(statistics.median(r), 3) for a, r in sorted(ratios.items())}}


def _call_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per layer call (this rank): planning seconds (the plan for this call, before the dispatch; the prediction
    for the next call, under the dispatch's wait), discarded prefetches, and per kind the exchange time."""
    layers = [layer for s in steps for layer in s["layers"] if "planning_s" in layer]
    if not layers:
        return {}
    by_kind: dict[str, list[float]] = {}
    for layer in layers:
        by_kind.setdefault(f"{layer['kind']}/{layer['timing']}", []).append(layer["measured_s"])
    return {"planning_ms_per_call": round(1000 * statistics.median(layer["planning_s"] for layer in layers), 3),
            "next_plan_ms_per_call": round(1000 * statistics.median(layer.get("next_plan_s", 0.0) for layer in layers),
                                           3),
            "discarded_trans_ms_per_step": round(1000 * sum(layer["discarded_trans_s"] for layer in layers)
                                                 / len(steps), 3),
            "exchange_ms_by_kind": {k: round(1000 * statistics.median(v), 1) for k, v in sorted(by_kind.items())},
            "steps": [[round(1000 * s["step_s"], 1)] + [layer["kind"] for layer in s["layers"]] for s in steps]}


def _paired_ratios(baseline: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[float]:
    """Per timed step, the baseline's time over ours: the two ran back to back (policies take turns each
    step), so load that changes more slowly than a step cancels in the ratio."""
    return [b["step_s"] / o["step_s"] for b, o in zip(baseline, ours)]


def _quartiles(values: list[float]) -> tuple[float, float]:
    """The spread reported beside a median: first and third quartiles."""
    if len(values) < 2:
        return values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4)
    return low, high


def summarise(result: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[list, list]]]:
    """One row per configuration: per policy balance per step and over all steps, step time, ours' kinds."""
    config = Config.from_dict(result["config"])
    row: dict[str, Any] = {"config": config.name, "routing": config.routing.label, "rate_mbit": config.rate_mbit,
                           "ffn": config.ffn, "tokens_per_rank": config.tokens_per_rank, "policies": {}}
    maps = {}
    for policy, steps in result["steps"].items():
        per_step = [statistics.mean(_ratio(loads) for loads in _loads(s, config.experts)) for s in steps]
        kinds = [f"{layer['kind']}/{layer['timing']}" for s in steps for layer in s["layers"]]
        row["policies"][policy] = {
            "step_ms": 1000 * statistics.median(s["step_s"] for s in steps),
            "max_over_mean_all_steps": statistics.mean(per_step),
            "max_over_mean_worst_step": max(per_step),
            "max_over_mean_per_step": [round(v, 4) for v in per_step],
            "replicas_per_step": statistics.mean(sum(len(r["replicas"]) for layer in s["layers"] for r in layer["plan"])
                                                 for s in steps),
            "kinds": {k: kinds.count(k) for k in sorted(set(kinds))},
            **_check_summary(steps),
            **_call_summary(steps),
        }
        maps[policy] = ([_loads(dict(s, layers=[dict(layer, plan=[]) for layer in s["layers"]]), config.experts)[0]
                         for s in steps], [_loads(s, config.experts)[0] for s in steps])
    policies = row["policies"]
    paired = {p: _paired_ratios(result["steps"][p], result["steps"]["ours"]) for p in BASELINES}
    best = min(BASELINES, key=lambda p: statistics.median(paired[p]))
    row["best_baseline"] = best
    row["ours_over_best_baseline"] = statistics.median(paired[best])
    row["ours_over_best_baseline_quartiles"] = [round(q, 4) for q in _quartiles(paired[best])]
    row["ours_over_best_baseline_of_medians"] = policies[best]["step_ms"] / policies["ours"]["step_ms"]
    row["ours_speedup_vs_deepspeed"] = policies["deepspeed"]["step_ms"] / policies["ours"]["step_ms"]
    return row, maps


def _print(rows: list[dict[str, Any]]) -> None:
    from benchmarks.report import print_table

    flat = []
    for row in rows:
        p = row["policies"]
        flat.append({"config": row["config"], "routing": row["routing"],
                     **{f"{name}_ms": p[name]["step_ms"] for name in BASELINES + ("ours",)},
                     "ours_over_best": row["ours_over_best_baseline"],
                     "quartiles": "–".join(f"{q:.2f}" for q in row["ours_over_best_baseline_quartiles"]),
                     "ours_mom_all": p["ours"]["max_over_mean_all_steps"],
                     "ours_mom_worst": p["ours"]["max_over_mean_worst_step"],
                     "dropless_mom_all": p["dropless"]["max_over_mean_all_steps"]})
    print_table(flat)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, tokens and sweep points (≤ 5 minutes)")
    parser.add_argument("--out", type=Path, help=out_help("moe"))
    parser.add_argument("--records", type=Path, help="raw per-step records: summarise these if the file exists, "
                        "else run and keep them there")
    parser.add_argument("--configs", nargs="+", metavar="NAME", help="run only these configurations: a full name, "
                        "a name less its routing suffix (base/rotate1) or a group (base, skew, rate, expert, tokens)")
    parser.add_argument("--policies", nargs="+", default=(),
                        choices=EXTRA_POLICIES + tuple(DIAGNOSTIC_KINDS) + (SPEED_ONLY,),
                        help="extra policies for every configuration run (diagnostics: ours_shadowing, ours_sets, "
                        f"{SPEED_ONLY})")
    parser.add_argument("--world-size", type=int, default=WORLD_SIZE, help="ranks (= expert-parallel size; "
                        f"default {WORLD_SIZE}: one per core of a 2-core machine)")
    parser.add_argument("--unpinned", action="store_true", help="let the scheduler move ranks between cores "
                        "(an idle rank's core then speeds up the busiest; see the module docstring)")
    parser.add_argument("--worker", type=Path, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(*args.worker)
        return
    if args.world_size < 2 or 8 % args.world_size:
        parser.error(f"--world-size {args.world_size}: use 2, 4 or 8 (it must divide the 8 experts)")
    args.out = args.out or default_out("moe", args.quick)

    from benchmarks.report import write_json
    from lightning_merak.callbacks.moe.placement import plot_load_heatmap

    started = time.perf_counter()
    plan = configs(args.quick, args.world_size, not args.unpinned)
    if args.configs:
        plan = [c for c in plan if any(name in (c.name, c.name.split("/")[0]) or c.name.startswith(name + "_")
                                       for name in args.configs)]
        if not plan:
            parser.error(f"--configs {args.configs} matches none of {[c.name for c in configs(args.quick)]}")
    plan = [replace(c, policies=tuple(dict.fromkeys(c.policies + tuple(args.policies)))) for c in plan]
    results: list[dict[str, Any]] = []
    if args.records is not None and args.records.exists():
        results = json.loads(args.records.read_text())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o777)
            for rate in dict.fromkeys(c.rate_mbit for c in plan):
                results += _launch([c for c in plan if c.rate_mbit == rate], args.quick, Path(tmp))
        if args.records is not None:
            args.records.write_text(json.dumps(results))
    rows, maps = [], {}
    for result in results:
        row, config_maps = summarise(result)
        rows.append(row)
        maps[row["config"]] = config_maps
    pinned = "unpinned" if args.unpinned else "each pinned to a core"
    print(f"emulated: {args.world_size} ranks ({pinned}), 8 experts, top-2, 2 layers")
    _print(rows)
    base_cost = next(r["cost_model"] for r in results if r["config"]["name"] == plan[0].name)
    simulated = simulate(base_cost, plan[0].tokens_per_rank, ROUTINGS, steps=4 if args.quick else 8)
    print("\nSIMULATED with this run's calibrated cost model (1 expert per rank, not measured):")
    from benchmarks.report import print_table

    print_table([{k: v for k, v in r.items() if k != "ours_kinds"} for r in simulated])
    worst_balance = max(rows, key=lambda r: r["policies"]["ours"]["max_over_mean_all_steps"])
    worst_speed = min(rows, key=lambda r: r["ours_over_best_baseline"])
    dropless_all_steps = max(r["policies"]["dropless"]["max_over_mean_all_steps"] for r in rows)
    all_steps = worst_balance["policies"]["ours"]["max_over_mean_all_steps"]
    ours_over_best = worst_speed["ours_over_best_baseline"]
    goals = {"all_steps_max_over_mean_le_1.15": all_steps <= GOAL_MAX_OVER_MEAN,
             "ours_over_best_baseline_min_ge_1.0": ours_over_best >= GOAL_OURS_OVER_BEST}
    wall = time.perf_counter() - started
    print(f"\nall_steps_max_over_mean {all_steps:.3f} ({worst_balance['config']}), ours_over_best_baseline_min "
          f"{ours_over_best:.3f} ({worst_speed['config']}); goals {goals}; wall {wall:.0f} s")
    heatmaps = {}
    shown = next((c.name for c in plan if c.routing == ROUTINGS[1]), plan[0].name)
    for policy in ("ours", "fastermoe"):
        before, after = maps[shown][policy]
        path = args.out.with_name(f"{args.out.stem}_heatmap_{policy}.png")
        plot_load_heatmap(before, after, path, f"{shown}, layer 0 tokens computed per rank: {policy}")
        heatmaps[policy] = str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)
    write_json(args.out, rows, "emulated", world_size=args.world_size, pinned_ranks=not args.unpinned,
               all_steps_max_over_mean=all_steps,
               all_steps_max_over_mean_config=worst_balance["config"],
               dropless_all_steps_max_over_mean=dropless_all_steps, ours_over_best_baseline_min=ours_over_best,
               ours_over_best_baseline_min_config=worst_speed["config"], goals=goals, wall_s=wall,
               heatmaps=heatmaps, cost_models={r["config"]["name"]: r["cost_model"] for r in results},
               simulated={"label": "simulated", "rows": simulated})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
