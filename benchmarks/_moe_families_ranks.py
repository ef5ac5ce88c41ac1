"""One gloo rank of ``benchmarks.moe_families``' ep=2 leg: swap equality and step times per family.

Every variant runs a training step (forward, backward, the data-parallel gradient average in one flat
all-reduce) on this rank's own batch: ``default`` is the unswapped model as a user gets it (every expert on every
rank, transformers' default experts implementation: the model is built without ``experts_implementation``, and the
implementation transformers picked is recorded), ``eager`` the same with transformers' expert loop (the exactness
reference), ``ours`` is ``merak_ep`` over the two ranks at its defaults (expert gradients stay local and are divided
by the rank count; the rest is averaged), ``ours_grouped_no_ep`` our grouped core with every expert on every rank
(what the exchange costs), and ``ours_replicated`` ``merak_ep`` with each layer's hottest expert (from the first
step) shadowed on every rank (what replication's transfers cost; its difference from ``ours`` is checked too).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_merak.distributed.collectives import average_gradients
from lightning_merak.plugins.moe.core.placement import PlacementPlan, Replication
from lightning_merak.plugins.moe.experts import (
    enable_expert_parallel,
    enable_grouped_experts,
    expert_load,
    set_replica_plans,
    tiny_moe_model,
)


def _batch(rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(100 + rank))


def _step(model: torch.nn.Module, ids: torch.Tensor, world: int, local: set[str]) -> tuple[torch.Tensor, dict]:
    """Forward, backward and the gradient average, shared gradients in one flat all-reduce as DDP's buckets do
    (a collective per tensor would time ~20 rendezvous a step instead of the gradients' bytes)."""
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    named = [(name, param.grad) for name, param in model.named_parameters() if param.grad is not None]
    shared = [grad for name, grad in named if name not in local]
    if shared:
        average_gradients(shared, dist.group.WORLD, 1)  # the sum; every gradient is divided by world below
    return out.logits.detach(), {name: grad / world for name, grad in named}


def _times(variants: dict[str, tuple[torch.nn.Module, set[str]]], ids: torch.Tensor, world: int, warmup: int,
           steps: int, min_seconds: float = 0.0) -> dict[str, list[float]]:
    """Every timed step (ms) of each variant, interleaved step by step so all see the same load.

    Runs ``steps`` rounds, or more (up to 4×) until about ``min_seconds`` have passed, so a cheap model's
    figure rests on more steps; every rank runs the same count (its slowest warm-up round decides).
    """
    start = time.perf_counter()
    for model, local in variants.values():
        for _ in range(warmup):
            _step(model, ids, world, local)
    round_seconds = torch.tensor([(time.perf_counter() - start) / max(warmup, 1)], dtype=torch.float64)
    dist.all_reduce(round_seconds, op=dist.ReduceOp.MAX)
    rounds = max(steps, min(4 * steps, math.ceil(min_seconds / float(round_seconds))))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (model, local) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            _step(model, ids, world, local)
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def _hottest_shadowed(loads: dict[str, torch.Tensor], world: int) -> dict[str, PlacementPlan]:
    """Per layer, its most loaded expert replicated to every other rank (FasterMoE's shadowing of one expert)."""
    plans = {}
    for name, counts in loads.items():
        expert = int(counts.sum(0).argmax())
        owner = expert // (counts.shape[1] // world)
        plans[name] = PlacementPlan(counts.shape[1], world,
                                    (Replication(expert, owner, tuple(r for r in range(world) if r != owner)),))
    return plans


def default_model(family: str, size: dict[str, Any]) -> torch.nn.Module:
    """``family``'s tiny model as a user builds it: ``experts_implementation`` left to transformers."""
    return tiny_moe_model(family, hidden=size["hidden"], layers=size["layers"], vocab=size["vocab"],
                          intermediate=size.get("intermediate"), routing=size.get("routing", "few_experts"),
                          experts_implementation=None)


def expert_bytes(model: torch.nn.Module, names: set[str]) -> int:
    """Bytes of ``model``'s parameters named in ``names`` (its expert tensors) held by this process."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name in names)


def run_family(rank: int, world: int, family: str, size: dict[str, Any], warmup: int, steps: int) -> dict[str, Any]:
    """Diffs against the unswapped eager model, expert bytes held and the step times of each variant on this rank."""
    default = default_model(family, size)
    reference = copy.deepcopy(default)
    reference.set_experts_implementation("eager")
    ids = _batch(rank, size["batch"], size["seq"], size["vocab"])
    grouped_dp = copy.deepcopy(reference)
    enable_grouped_experts(grouped_dp)
    ours = copy.deepcopy(reference)
    report = enable_expert_parallel(ours)
    experts = set(report.expert_parameters)

    ref_logits, ref_grads = _step(reference, ids, world, set())
    logits, grads = _step(ours, ids, world, experts)
    default_logits, _ = _step(default, ids, world, set())
    grad_diff = 0.0
    for name, grad in grads.items():
        ref = ref_grads[name]
        if name in experts:
            ref = ref[report.local_experts.start:report.local_experts.stop]
        grad_diff = max(grad_diff, (grad - ref).abs().max().item())
    missing = sorted(set(ref_grads) - set(grads))
    replicated = copy.deepcopy(reference)
    enable_expert_parallel(replicated)
    _step(replicated, ids, world, experts)
    set_replica_plans(replicated, _hottest_shadowed(expert_load(replicated), world))
    rep_logits, rep_grads = _step(replicated, ids, world, experts)
    rep_diff = max([(rep_logits - ref_logits).abs().max().item()]
                   + [(rep_grads[n] - grads[n]).abs().max().item() for n in grads])
    times = _times({"default": (default, set()), "eager": (reference, set()), "ours": (ours, experts),
                    "ours_grouped_no_ep": (grouped_dp, set()), "ours_replicated": (replicated, experts)},
                   ids, world, warmup, steps, size.get("min_seconds", 0.0))
    return {"family": family, "output_diff": (logits - ref_logits).abs().max().item(), "grad_diff": grad_diff,
            "default_diff": (default_logits - ref_logits).abs().max().item(),
            "default_implementation": default.config._experts_implementation,
            "expert_bytes": expert_bytes(ours, experts), "expert_bytes_full": expert_bytes(reference, experts),
            "grads_missing": missing, "steps_ms": times,
            "step_ms": {name: statistics.median(values) for name, values in times.items()},
            "step_min_ms": {name: min(values) for name, values in times.items()},
            "local_experts": len(report.local_experts), "replicated_diff": rep_diff,
            "num_experts": report.num_experts, "top_k": int(reference.config.num_experts_per_tok),
            "widths": {key: value for key, value in reference.config.to_dict().items()
                       if key.endswith("intermediate_size")}}


def each_family(families: list[str], run: Callable[[str], dict[str, Any]]) -> list[dict[str, Any]]:
    """``run(family)`` for every family in order on this rank (one thread); a family that fails becomes a row
    with its error."""
    torch.set_num_threads(1)
    rows = []
    for family in families:
        try:
            rows.append(run(family))
        except Exception as error:  # a failed row, not a failed run
            rows.append({"family": family, "error": f"{type(error).__name__}: {error}"})
    return rows


def run_all(rank: int, world: int, families: list[str], size: dict[str, int], warmup: int,
            steps: int) -> list[dict[str, Any]]:
    """Every family in order on this rank at ep=2."""
    return each_family(families, lambda family: run_family(rank, world, family, size, warmup, steps))
