"""MoE load balancing and overlap on an emulated cluster: ours vs DeepSpeed-MoE vs FasterMoE shadowing.

Run from the repo root, as root (shaped links need network namespaces)::

    python -m benchmarks.moe [--quick] [--out PATH]

Each rank sits in its own network namespace on a tbf-shaped link (``lightning_merak.testing.netem``;
this kernel cannot emulate latency, only rate), so figures are labelled *emulated*.
Model: ``LAYERS`` blocks of [dense residual layer → MoE layer] with ``EXPERTS`` experts over
all ranks (ep_size = world size), top-2. Routing is skewed on purpose: every token is
pushed towards an expert drawn from a Zipf law whose hot set rotates every
``DRIFT_EVERY`` steps. The gate is fixed and no optimizer steps, so every policy sees
the same routing; each rank runs every policy in turn on identical data:

* ``deepspeed``: ``deepspeed.moe.layer.MoE`` itself, ``drop_tokens=False`` (capacity = the
  largest count, so imbalance costs time instead of dropping tokens);
* ``deepspeed_cf1.25``: the same with ``drop_tokens=True``, capacity factor 1.25 (drops);
* ``dropless``: our layer, dropless split-size all-to-all, no replication;
* ``fastermoe``: our layer, dropless, FasterMoE-style shadowing (hot experts to all ranks);
* ``ours``: our layer, dropless, Pro-Prophet replication + scheduler + Lancet chunks (auto), expert
  weight gradients computed while the backward all-to-all is in flight;
* ``ours_no_dw_overlap``: the same, but the backward waits for each all-to-all before going on;
* ``ours_block``: ``ours`` plus block-scope Lancet (``lancet_overlap(blocks, "auto")``): each
  [dense → MoE] block runs as sub-batches, so one sub-batch's all-to-alls overlap the others'
  expert and dense computation, forward and backward (``sub_batches`` column: the count chosen).

Per policy: load max/mean and σ of tokens computed per rank, step time (median over
timed steps of the slowest rank), exposed all-to-all fraction (total and backward only; DeepSpeed's
layer times only its forward all-to-alls, so its total counts them twice), and the calibrated cost
model's predicted MoE time vs the measured step. Heatmaps of per-rank load over steps
are written next to the JSON. A second table extrapolates to 8–64 ranks with the cost
model calibrated in this run: it is *simulated*.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.report import default_out, out_help

REPO_ROOT = Path(__file__).resolve().parents[1]
RANKS_TIMEOUT_S = 900
DRIFT_EVERY = 4
ZIPF_EXPONENT = 1.2
POLICIES = ("deepspeed", "deepspeed_cf1.25", "dropless", "fastermoe", "ours", "ours_no_dw_overlap", "ours_block")


@dataclass(frozen=True)
class Setup:
    world_size: int
    rate_mbit: float
    hidden: int
    ffn: int
    tokens_per_rank: int
    layers: int
    experts: int
    warmup_steps: int
    steps: int


QUICK = Setup(world_size=4, rate_mbit=400, hidden=128, ffn=512, tokens_per_rank=1024, layers=2, experts=8,
              warmup_steps=2, steps=8)
FULL = Setup(world_size=4, rate_mbit=400, hidden=128, ffn=512, tokens_per_rank=2048, layers=2, experts=8,
             warmup_steps=3, steps=30)


def _zipf_targets(rank: int, step: int, setup: Setup) -> Any:
    import torch

    generator = torch.Generator().manual_seed(7919 * rank + step)
    weights = torch.tensor([1.0 / (i + 1) ** ZIPF_EXPONENT for i in range(setup.experts)])
    order = torch.roll(torch.arange(setup.experts), step // DRIFT_EVERY)
    draws = torch.multinomial(weights, setup.tokens_per_rank, replacement=True, generator=generator)
    return order[draws], generator


def _build(policy: str, setup: Setup, world: int) -> Any:
    import torch
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    from torch import nn

    from lightning_merak.plugins.moe import MoE, TransferScheduler
    from lightning_merak.plugins.moe.lancet_block import lancet_overlap

    scheduler = TransferScheduler()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(setup.hidden, setup.hidden)
            expert = nn.Sequential(nn.Linear(setup.hidden, setup.ffn), nn.GELU(), nn.Linear(setup.ffn, setup.hidden))
            common = dict(hidden_size=setup.hidden, expert=expert, num_experts=setup.experts, ep_size=world, k=2,
                          min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)
            if policy == "deepspeed":
                self.moe = DeepSpeedMoE(**common, drop_tokens=False)
            elif policy == "deepspeed_cf1.25":
                self.moe = DeepSpeedMoE(**common, capacity_factor=1.25, drop_tokens=True)
            else:
                placement = {"dropless": "none", "fastermoe": "shadowing"}.get(policy, "pro_prophet")
                ours = policy.startswith("ours")
                self.moe = MoE(**common, drop_tokens=False, dispatch="dropless", placement=placement,
                               lancet_chunks="auto" if ours else 1, lancet_backward=policy != "ours_no_dw_overlap",
                               scheduler=scheduler)

        def forward(self, x: Any) -> Any:
            h = x + 0.1 * torch.tanh(self.dense(x))
            out, _, _ = self.moe(h)
            return h + 0.1 * out

    torch.manual_seed(0)
    blocks = nn.ModuleList([Block() for _ in range(setup.layers)])
    for block in blocks:
        if policy.startswith("deepspeed"):
            block.moe.set_deepspeed_parallelism()
            block.moe.deepspeed_moe.wall_clock_breakdown = True
    if policy == "ours_block":
        lancet_overlap(blocks, "auto")
    return blocks


def _inputs(rank: int, step: int, setup: Setup, gate_weight: Any) -> Any:
    import torch

    targets, generator = _zipf_targets(rank, step, setup)
    directions = gate_weight / gate_weight.norm(dim=1, keepdim=True)
    noise = torch.randn(setup.tokens_per_rank, setup.hidden, generator=generator)
    return 0.5 * noise + 4.0 * directions[targets]


def _gathered_counts(layer: Any, world: int) -> list[list[int]]:
    import torch
    import torch.distributed as dist

    local = layer.exp_counts.to(torch.int64).reshape(1, -1)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=layer.ep_group)
    return torch.cat(parts).tolist()


def _run_policy(policy: str, setup: Setup, rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lightning_merak.plugins.moe import Padding
    from lightning_merak.plugins.moe.layer import PlacementMOELayer

    blocks = _build(policy, setup, world)
    gate_weight = blocks[0].moe.deepspeed_moe.gate.wg.weight.detach()
    steps: list[dict[str, Any]] = []
    for step in range(setup.warmup_steps + setup.steps):
        x = _inputs(rank, step, setup, gate_weight).requires_grad_(True)
        probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(step))
        dist.barrier()
        start = time.perf_counter()
        out = x
        for block in blocks:
            out = block(out)
        (out * probe).sum().backward()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        layers = []
        for block in blocks:
            layer = block.moe.deepspeed_moe
            if isinstance(layer, PlacementMOELayer):
                stats = layer.stats
                layers.append(dict(counts=stats["counts"], plan=[asdict(r) for r in stats["plan"].replications],
                                   padding=asdict(stats["padding"]),
                                   exposed_a2a_s=stats.get("exposed_a2a_forward_s", 0.0)
                                   + stats.get("exposed_a2a_backward_s", 0.0),
                                   exposed_a2a_backward_s=stats.get("exposed_a2a_backward_s", 0.0),
                                   exposed_trans_s=stats.get("exposed_trans_s", 0.0), chunks=stats["chunks"],
                                   sub_batches=stats.get("sub_batches", 1), dropped=stats["dropped_routes"]))
            else:
                counts = _gathered_counts(layer, world)
                padding = Padding("max") if policy == "deepspeed" else Padding(
                    "fixed", max(int(torch.ceil(torch.tensor(setup.tokens_per_rank / setup.experts * 2.5))), 0))
                cumulative_ms = layer.time_falltoall + layer.time_salltoall
                forward_a2a_s = (cumulative_ms - getattr(layer, "_previous_a2a_ms", 0.0)) / 1000.0
                layer._previous_a2a_ms = cumulative_ms
                layers.append(dict(counts=counts, plan=[], padding=asdict(padding), exposed_a2a_s=2 * forward_a2a_s,
                                   exposed_a2a_backward_s=forward_a2a_s, exposed_trans_s=0.0, chunks=1, sub_batches=1,
                                   dropped=None))
        exposed = torch.tensor([sum(entry["exposed_a2a_s"] for entry in layers),
                                sum(entry["exposed_a2a_backward_s"] for entry in layers)])
        dist.all_reduce(exposed, op=dist.ReduceOp.MAX)
        if step >= setup.warmup_steps:
            steps.append(dict(step_s=elapsed.item(), exposed_a2a_s=exposed[0].item(),
                              exposed_a2a_backward_s=exposed[1].item(), layers=layers))
        del out, x
    cost = None
    for block in blocks:
        layer = block.moe.deepspeed_moe
        if isinstance(layer, PlacementMOELayer) and layer.cost_model is not None:
            cost = layer.cost_model
    return {"steps": steps, "cost_model": _cost_model_dict(cost) if cost is not None else None}


def _cost_model_dict(cost: Any) -> dict[str, Any]:
    return dict(
        all_to_all=dict(sizes_bytes=list(cost.all_to_all.sizes_bytes), seconds=list(cost.all_to_all.seconds)),
        point_to_point=dict(sizes_bytes=list(cost.point_to_point.sizes_bytes),
                            seconds=list(cost.point_to_point.seconds)),
        expert_tokens_per_s=cost.expert_tokens_per_s, bytes_per_token=cost.bytes_per_token,
        expert_param_bytes=cost.expert_param_bytes, experts_per_rank=cost.experts_per_rank,
    )


def _cost_model_from(data: dict[str, Any], experts_per_rank: int | None = None) -> Any:
    from lightning_merak.plugins.moe import CommCurve, CostModel

    return CostModel(
        all_to_all=CommCurve(tuple(data["all_to_all"]["sizes_bytes"]), tuple(data["all_to_all"]["seconds"])),
        point_to_point=CommCurve(tuple(data["point_to_point"]["sizes_bytes"]),
                                 tuple(data["point_to_point"]["seconds"])),
        expert_tokens_per_s=data["expert_tokens_per_s"], bytes_per_token=data["bytes_per_token"],
        expert_param_bytes=data["expert_param_bytes"],
        experts_per_rank=experts_per_rank or data["experts_per_rank"],
    )


def worker(setup: Setup, result_path: Path) -> None:
    """One rank: every policy in turn; rank 0 writes the raw per-step records."""
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=RANKS_TIMEOUT_S))
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    records = {policy: _run_policy(policy, setup, rank, world) for policy in POLICIES}
    if rank == 0:
        result_path.write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()


def _summarise(policy: str, record: dict[str, Any], cost: Any, setup: Setup) -> tuple[dict[str, Any], list, list]:
    from lightning_merak.plugins.moe import Padding, PlacementPlan, Replication, rank_loads

    per_rank = setup.experts // setup.world_size
    ratios, sigmas, predicted, before_map, after_map = [], [], [], [], []
    for step in record["steps"]:
        total_pred = 0.0
        for index, layer in enumerate(step["layers"]):
            plan = PlacementPlan(setup.experts, setup.world_size,
                                 tuple(Replication(r["expert"], r["owner"], tuple(r["replicas"]))
                                       for r in layer["plan"]))
            tokens = rank_loads(layer["counts"], plan, Padding("dropless"), per_rank).computed
            mean = sum(tokens) / len(tokens)
            ratios.append(max(tokens) / mean)
            sigmas.append(statistics.pstdev(tokens))
            padding = Padding(**layer["padding"])
            total_pred += cost.terms(layer["counts"], plan, padding).total
            if index == 0:
                before_map.append(rank_loads(layer["counts"], PlacementPlan(setup.experts, setup.world_size),
                                             Padding("dropless"), per_rank).computed)
                after_map.append(tokens)
        predicted.append(total_pred)
    step_s = statistics.median(s["step_s"] for s in record["steps"])
    exposed = statistics.median(s["exposed_a2a_s"] / s["step_s"] for s in record["steps"])
    exposed_backward = statistics.median(s["exposed_a2a_backward_s"] / s["step_s"] for s in record["steps"])
    replicas = statistics.mean(sum(len(r["replicas"]) for l in s["layers"] for r in l["plan"]) for s in record["steps"])
    row = {
        "policy": policy,
        "load_max_over_mean": statistics.mean(ratios),
        "load_std": statistics.mean(sigmas),
        "step_ms": 1000 * step_s,
        "exposed_a2a_frac": exposed,
        "exposed_bwd_a2a_frac": exposed_backward,
        "predicted_moe_ms": 1000 * statistics.median(predicted),
        "pred_over_measured": statistics.median(predicted) / step_s,
        "replicas_per_step": replicas,
        "sub_batches": statistics.median(s["layers"][0]["sub_batches"] for s in record["steps"]),
    }
    return row, before_map, after_map


def _zipf_counts(ranks: int, experts: int, tokens: int, seed: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    weights = torch.tensor([1.0 / (i + 1) ** ZIPF_EXPONENT for i in range(experts)])
    weights = weights[torch.randperm(experts, generator=generator)]
    counts = []
    for _ in range(ranks):
        draws = torch.multinomial(weights, tokens * 2, replacement=True, generator=generator)
        counts.append(torch.bincount(draws, minlength=experts).tolist())
    return counts


def simulate(cost_data: dict[str, Any], tokens_per_rank: int) -> list[dict[str, Any]]:
    """Cost-model predictions at 8–64 ranks (1 expert per rank) with this run's constants."""
    from lightning_merak.plugins.moe import Padding, PlacementPlan, plan_pro_prophet, plan_shadowing, rank_loads

    rows = []
    for ranks in (8, 16, 32, 64):
        cost = _cost_model_from(cost_data, experts_per_rank=1)
        counts = _zipf_counts(ranks, ranks, tokens_per_rank, seed=ranks)
        empty = PlacementPlan(ranks, ranks)
        padded = cost.total(counts, empty, Padding("max"))
        dropless = cost.total(counts, empty, Padding("dropless"))
        prophet = plan_pro_prophet(counts, cost, Padding("dropless"))
        shadow = plan_shadowing(counts, cost)
        ours = cost.total(counts, prophet, Padding("dropless"))
        faster = cost.total(counts, shadow, Padding("dropless"))
        loads = rank_loads(counts, prophet, Padding("dropless"), 1).computed
        rows.append({
            "ranks": ranks,
            "deepspeed_ms": 1000 * padded,
            "dropless_ms": 1000 * dropless,
            "fastermoe_ms": 1000 * faster,
            "ours_ms": 1000 * ours,
            "speedup_vs_deepspeed": padded / ours,
            "speedup_vs_fastermoe": faster / ours,
            "ours_max_over_mean": max(loads) / (sum(loads) / len(loads)),
            "replicas": prophet.num_replicas,
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and tokens (under 3 minutes)")
    parser.add_argument("--out", type=Path, help=out_help("moe"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    if args.worker is not None:
        worker(setup, args.worker)
        return
    args.out = args.out or default_out("moe", args.quick)

    from benchmarks.report import print_table, write_json
    from lightning_merak.plugins.moe.callback import plot_load_heatmap
    from lightning_merak.testing.netem import EmulatedCluster, LinkSpec

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "records.json"
        os.chmod(tmp, 0o777)
        argv_rank = [sys.executable, "-m", "benchmarks.moe", "--worker", str(result_path)]
        if args.quick:
            argv_rank.append("--quick")
        with EmulatedCluster(setup.world_size, LinkSpec(rate_mbit=setup.rate_mbit)) as cluster:
            cluster.run(argv_rank, timeout_s=RANKS_TIMEOUT_S, cwd=REPO_ROOT,
                        extra_env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)})
        records = json.loads(result_path.read_text())
    cost_data = records["ours"]["cost_model"]
    cost = _cost_model_from(cost_data)
    rows, maps = [], {}
    for policy in POLICIES:
        row, before, after = _summarise(policy, records[policy], cost, setup)
        rows.append(row)
        maps[policy] = (before, after)
    baseline = next(r for r in rows if r["policy"] == "deepspeed")["step_ms"]
    for row in rows:
        row["speedup_vs_deepspeed"] = baseline / row["step_ms"]
    print(f"emulated: {setup.world_size} ranks, {setup.rate_mbit:g} Mbit/s links, {setup.experts} experts, top-2, "
          f"{setup.tokens_per_rank} tokens/rank, Zipf {ZIPF_EXPONENT} drifting every {DRIFT_EVERY} steps")
    print_table(rows)
    simulated = simulate(cost_data, setup.tokens_per_rank)
    print("\nSIMULATED with this run's calibrated cost model (1 expert per rank, not measured):")
    print_table(simulated)
    wall = time.perf_counter() - started
    ours = next(r for r in rows if r["policy"] == "ours")
    targets = {
        "max_over_mean_le_1.15": ours["load_max_over_mean"] <= 1.15,
        "speedup_vs_deepspeed_ge_1.3": ours["speedup_vs_deepspeed"] >= 1.3,
    }
    print(f"\ntargets: {targets}; wall {wall:.0f} s")
    heatmaps = {}
    for policy in ("ours", "fastermoe"):
        before, after = maps[policy]
        path = args.out.with_name(f"{args.out.stem}_heatmap_{policy}.png")
        plot_load_heatmap(before, after, path, f"layer 0 tokens computed per rank: {policy}")
        heatmaps[policy] = str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)
    write_json(args.out, rows, "emulated", setup=asdict(setup), zipf_exponent=ZIPF_EXPONENT,
               drift_every=DRIFT_EVERY, targets=targets, wall_s=wall, heatmaps=heatmaps, cost_model=cost_data,
               simulated={"label": "simulated", "rows": simulated})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
