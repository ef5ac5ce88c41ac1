"""One rank of the MoE benchmark: every configuration of one link rate, every policy per step.

Policies take turns step by step (step s of every policy, then step s + 1), so a noisy
machine slows them alike instead of whichever policy ran during the noise.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks._moe_routing import Routing, routing_inputs

__all__ = ["BASELINES", "BASELINE_LABELS", "Config", "DIAGNOSTIC_KINDS", "EXTRA_POLICIES", "OURS_OPTIONS",
           "SPEED_ONLY", "deepspeed_kwargs", "policy_options", "worker"]

RANKS_TIMEOUT_S = 3600
BASELINES = ("deepspeed", "dropless", "shadowing")
BASELINE_LABELS = {
    "deepspeed": "DeepSpeed-MoE (deepspeed.moe.layer.MoE, drop_tokens=False: capacity = the largest count)",
    "dropless": "our layer, dropless split-size all-to-all, no replication",
    "shadowing": "our layer with FasterMoE-style shadowing, lancet_chunks=1 (not FasterMoE's own code or its "
                 "chunked schedule)",
}
OURS_OPTIONS: dict[str, object] = {"dispatch": "dropless", "placement": "auto"}
"""Ours: the placement feature switched on (dropless dispatch, ``placement="auto"``), every other MoEOptions
field at its default (rule 2); the non-default variants below are separate, labelled rows."""
EXTRA_POLICIES = ("ours_lancet_auto", "deepspeed_cf1.25", "ours_previous", "ours_no_dw_overlap", "ours_block",
                  "ours_model_only")
# Diagnostics (``--policies``): ours' code path restricted to one replicating kind, to tell the planner's
# choice apart from the overhead ours pays around a plan (shadowing: beside the shadowing baseline; sets:
# Pro-Prophet's balanced replica sets on every call where they replicate).
DIAGNOSTIC_KINDS = {"ours_shadowing": ("none", "dropless", "shadowing"),
                    "ours_sets": ("none", "dropless", "pro_prophet")}
# Also a diagnostic: ours choosing on measured speed alone (no near-tie to the more balanced plan).
SPEED_ONLY = "ours_speed_only"


@dataclass(frozen=True)
class Config:
    """One benchmark configuration; the link rate is the cluster's (one launch per rate)."""

    name: str
    routing: Routing
    rate_mbit: float
    hidden: int
    ffn: int
    tokens_per_rank: int
    layers: int
    experts: int
    warmup_steps: int
    steps: int
    world_size: int = 4
    policies: tuple[str, ...] = BASELINES + ("ours",)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return cls(**{**data, "routing": Routing(**data["routing"]), "policies": tuple(data["policies"])})


def deepspeed_kwargs(policy: str) -> dict[str, object]:
    """DeepSpeed-MoE's own layer: dropless (``deepspeed``, so it computes every token ours does) or with
    capacity factor 1.25 dropping the rest (``deepspeed_cf1.25``)."""
    return {"deepspeed": {"drop_tokens": False},
            "deepspeed_cf1.25": {"capacity_factor": 1.25, "drop_tokens": True}}[policy]


def policy_options(policy: str) -> dict[str, object]:
    """The MoEOptions our layer runs ``policy`` with; a field not named keeps its default."""
    lancet_auto = {**OURS_OPTIONS, "lancet_chunks": "auto"}
    options: dict[str, dict[str, object]] = {
        "dropless": {"dispatch": "dropless", "placement": "none"},
        "shadowing": {"dispatch": "dropless", "placement": "shadowing", "lancet_chunks": 1},
        "ours": OURS_OPTIONS,
        "ours_block": OURS_OPTIONS,
        "ours_shadowing": OURS_OPTIONS,
        "ours_lancet_auto": lancet_auto,
        "ours_no_dw_overlap": {**lancet_auto, "lancet_backward": False},
        "ours_previous": {"dispatch": "dropless", "placement": "pro_prophet", "plan_from": "previous"},
        "ours_model_only": {**OURS_OPTIONS, "online_check": False},
        "ours_sets": {**OURS_OPTIONS, "online_check": False},
        SPEED_ONLY: {**OURS_OPTIONS, "balance_tolerance": 0.0},
    }
    return options[policy]


def _moe(policy: str, config: Config, world: int, expert: Any, scheduler: Any) -> Any:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from lightning_merak.plugins.moe import MoE

    common = dict(hidden_size=config.hidden, expert=expert, num_experts=config.experts, ep_size=world, k=2,
                  min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)
    if policy.startswith("deepspeed"):
        return DeepSpeedMoE(**common, **deepspeed_kwargs(policy))
    moe = MoE(**common, drop_tokens=False, scheduler=scheduler, **policy_options(policy))
    if policy in DIAGNOSTIC_KINDS:
        _restrict_kinds(moe.deepspeed_moe, DIAGNOSTIC_KINDS[policy])
    return moe


def _restrict_kinds(layer: Any, kinds: tuple[str, ...]) -> None:
    """Offer the layer's planner only ``kinds`` (a diagnostic; the options expose whole policies only)."""
    from dataclasses import replace as replace_settings

    settings = layer._settings
    layer._settings = lambda: replace_settings(settings(), kinds=kinds)


def _build(policy: str, config: Config, world: int) -> Any:
    import torch
    from torch import nn

    from lightning_merak.plugins.moe import TransferScheduler
    from lightning_merak.plugins.moe.lancet_block import lancet_overlap

    scheduler = TransferScheduler()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(config.hidden, config.hidden)
            expert = nn.Sequential(nn.Linear(config.hidden, config.ffn), nn.GELU(),
                                   nn.Linear(config.ffn, config.hidden))
            self.moe = _moe(policy, config, world, expert, scheduler)

        def forward(self, x: Any) -> Any:
            h = x + 0.1 * torch.tanh(self.dense(x))
            out, _, _ = self.moe(h)
            return h + 0.1 * out

    torch.manual_seed(0)
    blocks = nn.ModuleList([Block() for _ in range(config.layers)])
    for block in blocks:
        if policy.startswith("deepspeed"):
            block.moe.set_deepspeed_parallelism()
    if policy == "ours_block":
        lancet_overlap(blocks, "auto")
    return blocks


def _gathered_counts(layer: Any, world: int) -> list[list[int]]:
    import torch
    import torch.distributed as dist

    local = layer.exp_counts.to(torch.int64).reshape(1, -1)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=layer.ep_group)
    return torch.cat(parts).tolist()


def _layer_record(layer: Any, world: int) -> dict[str, Any]:
    from lightning_merak.plugins.moe.layer import PlacementMOELayer

    if not isinstance(layer, PlacementMOELayer):
        return dict(counts=_gathered_counts(layer, world), plan=[], kind="none", timing="current",
                    sub_batches=1, chunks=1)
    stats = layer.stats
    return dict(counts=stats["counts"], plan=[asdict(r) for r in stats["plan"].replications],
                kind=stats["plan_kind"], timing=stats["plan_timing"], sub_batches=stats.get("sub_batches", 1),
                chunks=stats["chunks"], exposed_trans_s=stats.get("exposed_trans_s", 0.0),
                exposed_a2a_s=stats.get("exposed_a2a_forward_s", 0.0) + stats.get("exposed_a2a_backward_s", 0.0),
                predicted_s=stats["predicted_s"], corrected_s=stats.get("corrected_s"),
                explored=bool(stats.get("explored")), planning_s=stats.get("planning_s", 0.0),
                next_plan_s=stats.get("next_plan_s", 0.0),
                discarded_trans_s=stats.get("discarded_trans_s", 0.0),
                measured_s=stats.get("exchange_forward_s", 0.0) + stats.get("exchange_backward_s", 0.0))


def _step(blocks: Any, config: Config, rank: int, world: int, step: int, gate_weight: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    x = routing_inputs(config.routing, rank, step, config.tokens_per_rank, gate_weight).requires_grad_(True)
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(step))
    dist.barrier()
    start = time.perf_counter()
    out = x
    for block in blocks:
        out = block(out)
    (out * probe).sum().backward()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return dict(step_s=elapsed.item(), layers=[_layer_record(block.moe.deepspeed_moe, world) for block in blocks])


def _cost_model_dict(cost: Any) -> dict[str, Any]:
    return dict(
        all_to_all=dict(sizes_bytes=list(cost.all_to_all.sizes_bytes), seconds=list(cost.all_to_all.seconds)),
        point_to_point=dict(sizes_bytes=list(cost.point_to_point.sizes_bytes),
                            seconds=list(cost.point_to_point.seconds)),
        expert_tokens_per_s=cost.expert_tokens_per_s, expert_tokens_per_s_alone=cost.expert_tokens_per_s_alone,
        bytes_per_token=cost.bytes_per_token,
        expert_param_bytes=cost.expert_param_bytes, experts_per_rank=cost.experts_per_rank,
        overlap_efficiency=cost.overlap_efficiency,
        all_to_all_overlap_efficiency=cost.all_to_all_overlap_efficiency, measured=cost.measured,
    )


def _run_config(config: Config, rank: int, world: int) -> dict[str, Any]:
    built = {policy: _build(policy, config, world) for policy in config.policies}
    gate_weight = built[config.policies[0]][0].moe.deepspeed_moe.gate.wg.weight.detach()
    records: dict[str, list[dict[str, Any]]] = {policy: [] for policy in config.policies}
    warmup: dict[str, list[dict[str, Any]]] = {policy: [] for policy in config.policies}
    for step in range(config.warmup_steps + config.steps):
        for policy, blocks in built.items():
            record = _step(blocks, config, rank, world, step, gate_weight)
            (records if step >= config.warmup_steps else warmup)[policy].append(record)
    cost = built["ours"][0].moe.deepspeed_moe.cost_model
    # Warm-up steps are kept too: the online check explores and first measures its arms there.
    return {"config": asdict(config), "steps": records, "warmup": warmup, "cost_model": _cost_model_dict(cost)}


def worker(configs_path: Path, result_path: Path) -> None:
    """One rank: every configuration in turn; rank 0 writes the raw per-step records.

    Ranks are not pinned to cores: the product does not pin a user's ranks, so no policy gets it (rule 5).
    """
    configs = [Config.from_dict(c) for c in json.loads(configs_path.read_text())]
    import torch
    import torch.distributed as dist

    from lightning_merak.distributed.deepspeed_comm import init_deepspeed_comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=RANKS_TIMEOUT_S))
    init_deepspeed_comm("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = [_run_config(config, rank, world) for config in configs]
    if rank == 0:
        result_path.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
