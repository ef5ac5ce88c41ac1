"""MoE balance and speed on an emulated cluster: ours vs DeepSpeed-MoE, dropless dispatch and shadowing.

Run from the repo root, as root (shaped links need network namespaces)::

    python -m benchmarks.moe [--quick] [--out PATH] [--configs NAME ...] [--policies POLICY ...]
                             [--world-size N]

Four ranks (issue #49; ``--world-size 2`` is the earlier setting) emulate one device each on this 2-core
machine. Unquota'd, the scheduler hands an idle rank's core to the busiest one (measured: a rank computing
alone ran 3.3× its shared rate), so an imbalance costs less than its rows would on a GPU cluster and the
online plan check finds replication no faster. So with more ranks than cores every rank runs under a fixed
CPU quota of cores/ranks (:func:`rank_quota`, ``docs/design/machine.md``), the same for ours and every
baseline (they take turns in the same ranks of one cluster), with one compute thread each; the JSON records
it (``rank_cpu``) and whether it held at a layer call's scale: ours' calibration times an expert alone and with
every rank computing, and a ratio well above 1 (``no_lending_at_call_scale`` false) means idle ranks still lent
cores within a quota period. Ranks are not pinned: the product does not pin a user's ranks. They start with the
launcher's heap settings (:data:`lightning_merak.distributed.host_memory.HEAP_TUNABLES`), as a user's do.

Each rank sits in its own network namespace on a tbf-shaped link (``lightning_merak.testing.netem``;
this kernel cannot emulate latency, only rate), so figures are labelled *emulated*; one cluster
is launched per link rate. Model: ``layers`` blocks of [dense residual layer → MoE layer] with
``experts`` experts over all ranks (ep_size = world size), top-2. The gate is fixed and no optimizer
steps, so every policy sees the same routing; policies take turns step by step on identical data.

Routings (:mod:`benchmarks._moe_routing`): a Zipf law whose hot order drifts by one expert every 4
steps (issue #5's), and hot sets redrawn every k = 1, 3, 10 steps. The sweep varies one of skew,
link rate, expert size and tokens per rank at a time around the base configuration.

Policies (:mod:`benchmarks._moe_worker`, which states each one's options):

* baselines (:data:`~benchmarks._moe_worker.BASELINE_LABELS`): ``deepspeed`` (DeepSpeed-MoE's own layer,
  ``drop_tokens=False``), ``dropless`` (our layer, no replication) and ``shadowing`` (our layer with
  FasterMoE-style shadowing planned from each step's counts, ``lancet_chunks=1``: not FasterMoE itself);
* ``ours``: our layer with the placement feature on (dropless dispatch, ``placement="auto"``) and every other
  option at its default (rule 2);
* full run only, drift4 and rotate1 routings, separate labelled rows: ``ours_lancet_auto`` (``lancet_chunks=
  "auto"``), ``deepspeed_cf1.25`` (drops tokens), ``ours_previous`` (Pro-Prophet as published: plans from the
  previous step's counts), ``ours_no_dw_overlap``, ``ours_block`` (block-scope Lancet), ``ours_model_only`` (no
  online plan check);
* diagnostics, on request (``--policies``, with ``--configs`` to run a few configurations):
  ``ours_shadowing``, ``ours_sets`` and ``ours_speed_only``.

Every policy runs 4 untimed warm-up steps. Per configuration and policy: the load max/mean of tokens computed
per rank of each timed step, taken at the step's worst layer call (``max_over_mean_per_step``; its maximum is
``max_over_mean_worst_step``), step time (median over timed steps of the slowest rank), the kinds ours ran and
what the online plan check did. Speed is paired: per timed step the baseline's time over ours (they ran back to
back), the median over steps; the best baseline is the one with the lowest such median.

Goals (issue #49, each the worst case over every configuration, :mod:`benchmarks.goals`):
:data:`WORST_STEP` and :data:`OURS_OVER_BEST` on the measured rows, and the same two on a second,
*simulated* table that prices 8–64 ranks on the same routings with the cost model ours calibrated in this
run's quota'd ranks (:mod:`benchmarks._moe_simulate`). The JSON also counts the configurations where
dropless dispatch alone meets the balance goal (``dropless_meets_balance``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks._moe_routing import Routing
from benchmarks._moe_simulate import simulate
from benchmarks._moe_worker import (
    BASELINE_LABELS,
    BASELINES,
    DIAGNOSTIC_KINDS,
    EXTRA_POLICIES,
    OURS_OPTIONS,
    RANKS_TIMEOUT_S,
    SPEED_ONLY,
    Config,
    worker,
)
from benchmarks.goals import Goal, print_goals, worst_case, write_run
from benchmarks.report import RESULTS_DIR, out_help
from lightning_merak.testing.cpu_quota import CpuQuota, device_per_rank_quota, emulation_record

REPO_ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 4
ROUTINGS = (Routing("drift", 4), Routing("rotate", 1), Routing("rotate", 3), Routing("rotate", 10))

WORST_STEP = Goal(
    "worst_step_max_over_mean", 1.25, "<=",
    "emulated 4 ranks, 8 experts top-2, every routing and sweep configuration: ours (dropless, placement=auto, "
    "other options default), tokens computed per rank max/mean of the worst single timed step (a step taken at "
    "its worst layer call), worst over steps and configurations", 49, runs_required=2)
OURS_OVER_BEST = Goal(
    "ours_over_best_baseline_min", 1.0, ">=",
    "emulated 4 ranks, every configuration: per configuration the median over timed steps of the paired step-time "
    "ratio baseline/ours, for the best of DeepSpeed-MoE (drop_tokens=False), dropless and our layer with "
    "FasterMoE-style shadowing (lancet_chunks=1); worst over configurations", 49, runs_required=2)
SIMULATED_WORST_STEP = Goal(
    "simulated_worst_step_max_over_mean", 1.25, "<=",
    "[sim] 8-64 ranks (1 expert per rank, this run's calibrated cost model), every routing: ours' tokens "
    "computed per rank max/mean of the worst single step, worst over steps and configurations", 49,
    runs_required=2)
SIMULATED_OURS_OVER_BEST = Goal(
    "simulated_ours_over_best_baseline_min", 1.0, ">=",
    "[sim] 8-64 ranks, every routing: predicted time over all steps of the best baseline (DeepSpeed-MoE "
    "padded, dropless, shadowing) over ours', worst over configurations", 49, runs_required=2)


def configs(quick: bool, world_size: int = WORLD_SIZE) -> list[Config]:
    """The base configuration on every routing, then one-factor sweeps on hot sets rotating every 3 steps."""
    base = Config(name="", routing=ROUTINGS[0], rate_mbit=400, hidden=128, ffn=512,
                  tokens_per_rank=1024 if quick else 2048, layers=2, experts=8,
                  warmup_steps=4, steps=10 if quick else 16, world_size=world_size)
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


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What every rank of every policy starts with: one compute thread, the repo importable, and the heap
    settings the product's launcher gives a user's ranks."""
    from lightning_merak.distributed.host_memory import with_heap_tunables

    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT),
            "GLIBC_TUNABLES": with_heap_tunables(environ)}


def rank_quota(world_size: int) -> CpuQuota | None:
    """The CPU quota every cluster of this run gives its ranks (None at no more ranks than cores, or where
    quotas are unavailable): without it an idle rank's core runs the busiest, so imbalance looks cheap."""
    return device_per_rank_quota(world_size)


LENDING_TOLERANCE = 1.2
"""Lone-rank over shared expert rate above which ranks still lent cores at a layer call's timescale."""


def rank_cpu_record(quota: CpuQuota | None, world_size: int, checks: Sequence[float] = (),
                    cost_models: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The JSON's ``rank_cpu``: how ranks shared the CPU; per cluster the CPU share a lone process got in a rank's
    group within 10 ms bursts of work after idle gaps (its quota if the quota held at a layer call's scale); and
    per configuration the expert rate of a rank computing alone over all computing at once, from ours'
    calibration, which tells whether an idle rank's core still ran the busiest (a ratio near 1: it did not)."""
    record: dict[str, Any] = {**emulation_record(quota, world_size), "policies": "ours and every baseline alike "
                              "(they take turns in the same ranks of one cluster)", "compute_threads_per_rank": 1}
    if checks:
        record["lone_rank_burst_cpu_share_per_cluster"] = [round(c, 3) for c in checks]
    if cost_models:
        lending = {name: round((c.get("expert_tokens_per_s_alone") or c["expert_tokens_per_s"])
                               / c["expert_tokens_per_s"], 3) for name, c in cost_models.items()}
        record["lone_over_shared_expert_rate"] = lending
        record["no_lending_at_call_scale"] = max(lending.values()) <= LENDING_TOLERANCE
    return record


def _launch(group: list[Config], tmp: Path, quota: CpuQuota | None) -> tuple[list[dict[str, Any]], float | None]:
    """Run ``group`` (one link rate) in one cluster whose every rank has ``quota``; the records and, quota'd, the
    CPU share a lone process got in a rank's group within short bursts of work, just before."""
    from lightning_merak.testing.netem import EmulatedCluster, LinkSpec

    configs_path, result_path = tmp / "configs.json", tmp / "records.json"
    configs_path.write_text(json.dumps([asdict(c) for c in group]))
    result_path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "benchmarks.moe", "--worker", str(configs_path), str(result_path)]
    with EmulatedCluster(group[0].world_size, LinkSpec(rate_mbit=group[0].rate_mbit), cpu_quota=quota) as cluster:
        check = quota.check().burst_share if quota is not None else None
        cluster.run(argv, timeout_s=RANKS_TIMEOUT_S, cwd=REPO_ROOT, extra_env=rank_env(os.environ))
    return json.loads(result_path.read_text()), check


def run_clusters(plan: Sequence[Config], quota: CpuQuota | None) -> tuple[list[dict[str, Any]], list[float]]:
    """One cluster per link rate, each with the same ``quota``; every policy of a configuration runs in that
    cluster's ranks, so ours and the baselines compute under the same CPU share. Records and quota checks."""
    results: list[dict[str, Any]] = []
    checks: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)
        for rate in dict.fromkeys(c.rate_mbit for c in plan):
            records, check = _launch([c for c in plan if c.rate_mbit == rate], Path(tmp), quota)
            results += records
            checks += [check] if check is not None else []
    return results, checks


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


def _ratio(loads: Sequence[int]) -> float:
    return max(loads) / statistics.mean(loads)


def step_max_over_mean(step: dict[str, Any], experts: int) -> float:
    """One step's load max/mean: its worst layer call's (layers run one after another, each waiting for its
    busiest rank, so one layer's imbalance is not made up by another's)."""
    return max(_ratio(loads) for loads in _loads(step, experts))


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


def _warmup_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The arms the online check ran in the untimed warm-up (``*``: an exploration), per step and layer: an arm
    first measured there in a bad moment can stay unchosen through every timed step."""
    if not any(layer.get("corrected_s") is not None for s in steps for layer in s["layers"]):
        return {}
    return {"warmup_arms": [[f"{layer['kind']}/{layer['timing']}{'*' if layer['explored'] else ''} "
                             f"{layer['measured_s'] / layer['predicted_s']:.2f}" if layer["predicted_s"] > 0 else
                             f"{layer['kind']}/{layer['timing']}" for layer in s["layers"]] for s in steps]}


def paired_ratios(baseline: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[float]:
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
    """One row per configuration: per policy the load max/mean of every timed step, step time, ours' kinds."""
    config = Config.from_dict(result["config"])
    row: dict[str, Any] = {"config": config.name, "routing": config.routing.label, "rate_mbit": config.rate_mbit,
                           "ffn": config.ffn, "tokens_per_rank": config.tokens_per_rank, "policies": {}}
    maps = {}
    for policy, steps in result["steps"].items():
        per_step = [step_max_over_mean(s, config.experts) for s in steps]
        kinds = [f"{layer['kind']}/{layer['timing']}" for s in steps for layer in s["layers"]]
        row["policies"][policy] = {
            "step_ms": 1000 * statistics.median(s["step_s"] for s in steps),
            "max_over_mean_worst_step": max(per_step),
            "max_over_mean_per_step": [round(v, 4) for v in per_step],
            "replicas_per_step": statistics.mean(sum(len(r["replicas"]) for layer in s["layers"] for r in layer["plan"])
                                                 for s in steps),
            "kinds": {k: kinds.count(k) for k in sorted(set(kinds))},
            **_check_summary(steps),
            **_call_summary(steps),
            **_warmup_summary(result.get("warmup", {}).get(policy, [])),
        }
        maps[policy] = ([_loads(dict(s, layers=[dict(layer, plan=[]) for layer in s["layers"]]), config.experts)[0]
                         for s in steps], [_loads(s, config.experts)[0] for s in steps])
    paired = {p: paired_ratios(result["steps"][p], result["steps"]["ours"]) for p in BASELINES}
    best = min(BASELINES, key=lambda p: statistics.median(paired[p]))
    row["best_baseline"] = best
    row["ours_over_best_baseline"] = statistics.median(paired[best])
    row["ours_over_best_baseline_quartiles"] = [round(q, 4) for q in _quartiles(paired[best])]
    row["ours_over_baseline"] = {p: round(statistics.median(paired[p]), 4) for p in BASELINES}
    return row, maps


def simulated_note(rank_cpu: Mapping[str, Any]) -> str:
    """Where the simulated rows' cost model comes from: ours' calibration in this run's ranks, quota'd or not."""
    source = ("ranks under a fixed CPU quota of cores/ranks each" if "quota_us" in rank_cpu
              else f"ranks without a CPU quota ({rank_cpu['emulation']})")
    return (f"1 expert per rank, priced by the cost model ours calibrated in this run's {source}; not measured")


def goal_records(rows: Sequence[Mapping[str, Any]], simulated: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The run's four goals, each the worst case over its leg's configurations (measured, then simulated)."""
    def sim_name(row: Mapping[str, Any]) -> str:
        return f"{row['ranks']} ranks/{row['routing']}"

    return [
        worst_case(WORST_STEP, {r["config"]: r["policies"]["ours"]["max_over_mean_worst_step"] for r in rows}),
        worst_case(OURS_OVER_BEST, {r["config"]: r["ours_over_best_baseline"] for r in rows}),
        worst_case(SIMULATED_WORST_STEP, {sim_name(r): r["ours_worst_step_max_over_mean"] for r in simulated},
                   note="simulated"),
        worst_case(SIMULATED_OURS_OVER_BEST, {sim_name(r): r["ours_over_best_baseline"] for r in simulated},
                   note="simulated"),
    ]


def dropless_meets_balance(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """In how many configurations dropless dispatch alone (no replication) meets the balance goal."""
    meeting = [r["config"] for r in rows if WORST_STEP.meets(r["policies"]["dropless"]["max_over_mean_worst_step"])]
    return {"meeting": len(meeting), "configurations": len(rows), "configs": meeting}


def _print(rows: list[dict[str, Any]]) -> None:
    from benchmarks.report import print_table

    flat = []
    for row in rows:
        p = row["policies"]
        flat.append({"config": row["config"], "routing": row["routing"],
                     **{f"{name}_ms": p[name]["step_ms"] for name in BASELINES + ("ours",)},
                     "ours_over_best": row["ours_over_best_baseline"], "best": row["best_baseline"],
                     "quartiles": "–".join(f"{q:.2f}" for q in row["ours_over_best_baseline_quartiles"]),
                     "ours_worst_step": p["ours"]["max_over_mean_worst_step"],
                     "dropless_worst_step": p["dropless"]["max_over_mean_worst_step"]})
    print_table(flat)


def _heatmaps(rows_maps: dict[str, dict[str, tuple[list, list]]], shown: str, prefix: Path) -> dict[str, str]:
    """Layer 0's tokens computed per rank, before and after the plan, for ours and the shadowing baseline."""
    from lightning_merak.callbacks.moe.placement import plot_load_heatmap

    heatmaps = {}
    for policy in ("ours", "shadowing"):
        before, after = rows_maps[shown][policy]
        path = prefix.with_name(f"{prefix.name}_heatmap_{policy}.png")
        plot_load_heatmap(before, after, path, f"{shown}, layer 0 tokens computed per rank: {policy}")
        heatmaps[policy] = str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)
    return heatmaps


def main(argv: list[str] | None = None) -> None:
    """Run (or re-summarise ``--records``) and write the JSON; a partial or re-summarised run only with ``--out`` or
    ``--quick``, never as one of the goals' full runs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, tokens and sweep points")
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
                        f"default {WORLD_SIZE})")
    parser.add_argument("--worker", type=Path, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(*args.worker)
        return
    if args.world_size < 2 or 8 % args.world_size:
        parser.error(f"--world-size {args.world_size}: use 2, 4 or 8 (it must divide the 8 experts)")
    partial = [flag for flag, given in (("--configs", args.configs), ("--world-size", args.world_size != WORLD_SIZE),
                                        ("--policies", args.policies),
                                        ("--records", args.records and args.records.exists())) if given]
    if partial and not (args.quick or args.out):
        parser.error(f"{' and '.join(partial)}: not a full run (a part, other ranks or policies, or old records), so "
                     "it must not join the goals' full runs; write it elsewhere with --out PATH (or --quick)")

    started = time.perf_counter()
    plan = configs(args.quick, args.world_size)
    if args.configs:
        plan = [c for c in plan if any(name in (c.name, c.name.split("/")[0]) or c.name.startswith(name + "_")
                                       for name in args.configs)]
        if not plan:
            parser.error(f"--configs {args.configs} matches none of {[c.name for c in configs(args.quick)]}")
    plan = [replace(c, policies=tuple(dict.fromkeys(c.policies + tuple(args.policies)))) for c in plan]
    results: list[dict[str, Any]] = []
    quota, checks = rank_quota(args.world_size), []
    if args.records is not None and args.records.exists():
        results = json.loads(args.records.read_text())
    else:
        results, checks = run_clusters(plan, quota)
        if args.records is not None:
            args.records.write_text(json.dumps(results))
    rank_cpu = rank_cpu_record(quota, args.world_size, checks,
                               {r["config"]["name"]: r["cost_model"] for r in results})
    rows, maps = [], {}
    for result in results:
        row, config_maps = summarise(result)
        rows.append(row)
        maps[row["config"]] = config_maps
    print(f"emulated: {args.world_size} ranks ({rank_cpu['emulation']}), 8 experts, top-2, 2 layers")
    _print(rows)
    base_cost = next(r["cost_model"] for r in results if r["config"]["name"] == plan[0].name)
    simulated = simulate(base_cost, plan[0].tokens_per_rank, ROUTINGS, steps=4 if args.quick else 8)
    print(f"\nSIMULATED ({simulated_note(rank_cpu)}):")
    from benchmarks.report import print_table

    print_table([{k: v for k, v in r.items() if k != "ours_kinds"} for r in simulated])
    goals = goal_records(rows, simulated)
    dropless = dropless_meets_balance(rows)
    wall = time.perf_counter() - started
    print_goals(goals)
    print(f"dropless alone meets {WORST_STEP.key} in {dropless['meeting']} of {dropless['configurations']} "
          f"configurations; wall {wall:.0f} s")
    prefix = args.out.with_suffix("") if args.out else RESULTS_DIR / ("moe.quick" if args.quick else "moe")
    shown = next((c.name for c in plan if c.routing == ROUTINGS[1]), plan[0].name)
    path = write_run("moe", rows, "emulated", goals, args.quick, out=args.out, world_size=args.world_size,
                     pinned_ranks=False, rank_cpu=rank_cpu, rank_glibc_tunables=rank_env({})["GLIBC_TUNABLES"],
                     ours_options=OURS_OPTIONS,
                     baselines=BASELINE_LABELS, dropless_meets_balance=dropless, wall_s=wall,
                     heatmaps=_heatmaps(maps, shown, prefix),
                     cost_models={r["config"]["name"]: r["cost_model"] for r in results},
                     simulated={"label": "simulated", "note": simulated_note(rank_cpu), "rows": simulated})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
