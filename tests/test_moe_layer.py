"""Our MoE equals DeepSpeed's on 2 and 4 gloo ranks: outputs, input/gate/expert gradients.

Same weights, same inputs and the same RNG state before each forward, so the gate
decisions are identical; every combination of dispatch path, placement (including a
replica that receives zero tokens), plan kind and timing (this step's counts with transfers in
flight during the dispatch, or the previous step's prefetched), Lancet chunking, replanning every
few calls or on drift, transfers posted unoverlapped, and the online plan check (exploring a different
arm on every call, or preferring balance within its noise) must reproduce DeepSpeed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_merak.distributed.deepspeed_comm import init_deepspeed_comm
from lightning_merak.testing import run_distributed

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks or a subprocess

HIDDEN = 16
TOLERANCE = 2e-5


def expert_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 24), nn.GELU(), nn.Linear(24, HIDDEN))


def cheap_transfer_cost_model(experts_per_rank: int) -> Any:
    """Cheap transfers and a slow all-to-all: the planner replicates whatever is hot."""
    from lightning_merak.plugins.moe import CommCurve, CostModel

    return CostModel(
        all_to_all=CommCurve.from_bandwidth(1e5),
        point_to_point=CommCurve.from_bandwidth(1e12),
        expert_tokens_per_s=1e6,
        bytes_per_token=HIDDEN * 4,
        expert_param_bytes=sum(p.numel() for p in expert_mlp().parameters()) * 4,
        experts_per_rank=experts_per_rank,
    )


def _tokens(rank: int, step: int, count: int, gate_weight: torch.Tensor, case: dict[str, Any]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(count, HIDDEN, generator=generator)
    hot = gate_weight[0] / gate_weight[0].norm()
    x = x + 0.6 * HIDDEN ** 0.5 * hot
    if case.get("starve_rank") == rank:
        x = 4.0 * (gate_weight[1] + gate_weight[2]) - 12.0 * gate_weight[0] + 0.01 * x
    return x


def _run_case(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from lightning_merak.plugins.moe import MoE, PlacementPlan, Replication, StepChoice

    num_experts = case["num_experts"]
    kwargs = dict(
        hidden_size=HIDDEN, num_experts=num_experts, ep_size=world_size, k=case["k"],
        capacity_factor=case.get("capacity_factor", 1.0), min_capacity=2, drop_tokens=case.get("drop_tokens", True),
        use_rts=case.get("use_rts", False), top2_2nd_expert_sampling=case.get("sampling", False),
    )
    torch.manual_seed(0)
    reference = DeepSpeedMoE(expert=expert_mlp(), **kwargs)
    reference.set_deepspeed_parallelism()
    options = {"online_check": False, **case["options"]}  # the model's choice: each case runs the kinds it names
    ours = MoE(expert=expert_mlp(), **kwargs, cost_model=cheap_transfer_cost_model(num_experts // world_size),
               **options)
    ours.load_state_dict(reference.state_dict())
    layer = ours.deepspeed_moe
    gate_weight = reference.deepspeed_moe.gate.wg.weight.detach()
    out: dict[str, Any] = {"diffs": [], "plans": [], "counts": [], "chunks": [], "kinds": [], "explored": []}
    if "force_plan" in case:
        forced = PlacementPlan(num_experts, world_size, tuple(Replication(*r) for r in case["force_plan"]))
        timing = case.get("force_timing", "current")
        layer._choose = lambda counts, padding, prefetched: StepChoice("pro_prophet", timing, forced, padding, 0.0)
    for step in range(3):
        if case.get("force_timing") == "predicted":
            layer.prefetch_plan = forced
        x = _tokens(rank, step, 24, gate_weight, case)
        results = []
        for model in (reference, ours):
            model.zero_grad(set_to_none=True)
            inputs = x.clone().view(2, -1, HIDDEN).requires_grad_(True)
            torch.manual_seed(77 + step)
            output, l_aux, _ = model(inputs)
            probe = torch.randn(output.shape, generator=torch.Generator().manual_seed(step))
            ((output * probe).sum() + l_aux).backward()
            grads = {name: p.grad for name, p in model.named_parameters()}
            results.append((output.detach(), inputs.grad, grads))
        (ref_out, ref_dx, ref_grads), (our_out, our_dx, our_grads) = results
        diffs = {"output": (ref_out - our_out).abs().max().item(), "input_grad": (ref_dx - our_dx).abs().max().item()}
        for name, grad in ref_grads.items():
            other = our_grads.get(name)
            diffs[name] = float("inf") if other is None or grad is None else (grad - other).abs().max().item()
        out["diffs"].append(diffs)
        out["plans"].append([(r.expert, r.owner, r.replicas) for r in layer.stats["plan"].replications])
        out["counts"].append(layer.stats["counts"])
        out["chunks"].append(layer.stats["chunks"])
        out["kinds"].append((layer.stats["plan_kind"], layer.stats["plan_timing"]))
        out["explored"].append(layer.stats.get("explored", False))
    return out


def run_cases(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    init_deepspeed_comm("gloo")
    return {name: _run_case(rank, world_size, case) for name, case in cases.items()}


TWO_RANK_CASES = {
    "capacity_top1_rts": dict(num_experts=4, k=1, use_rts=True, options=dict()),
    "capacity_top2_prophet_lancet3": dict(num_experts=4, k=2, options=dict(placement="pro_prophet", alpha=0.0,
                                                                             lancet_chunks=3)),
    "dropless_top2_prophet_auto": dict(num_experts=4, k=2, drop_tokens=False, sampling=True,
                                       options=dict(dispatch="dropless", placement="pro_prophet", alpha=0.0,
                                                    lancet_chunks="auto", lancet_backward=False)),
    "padded_max_shadowing_lancet2": dict(num_experts=4, k=2, drop_tokens=False,
                                         options=dict(placement="shadowing", lancet_chunks=2)),
    "dropless_zero_token_replica": dict(num_experts=4, k=2, drop_tokens=False, starve_rank=1,
                                        force_plan=[(0, 0, (1,))], options=dict(dispatch="dropless")),
    "capacity_zero_token_replica": dict(num_experts=4, k=2, starve_rank=1, force_plan=[(0, 0, (1,))],
                                        force_timing="predicted", options=dict(lancet_chunks=2)),
    "padded_max_auto_current": dict(num_experts=4, k=2, drop_tokens=False,
                                    options=dict(placement="auto", plan_from="current", alpha=0.0)),
    "dropless_auto_previous_lancet2": dict(num_experts=4, k=2, drop_tokens=False,
                                           options=dict(dispatch="dropless", placement="auto", plan_from="previous",
                                                        alpha=0.0, lancet_chunks=2)),
    "dropless_auto_replan_on_drift_checked": dict(
        num_experts=4, k=2, drop_tokens=False,
        options=dict(dispatch="dropless", placement="auto", plan_from="previous", alpha=0.0, replan_every=3,
                     replan_threshold=0.0, online_check=True, explore_every=0, balance_tolerance=0.5)),
}

FOUR_RANK_CASES = {
    "dropless_top2_prophet_lancet2": dict(num_experts=8, k=2, drop_tokens=False,
                                          options=dict(dispatch="dropless", placement="pro_prophet", alpha=0.0,
                                                       lancet_chunks=2)),
    "capacity_top1_shadowing": dict(num_experts=8, k=1, capacity_factor=2.0, options=dict(placement="shadowing")),
    "dropless_zero_token_replicas": dict(num_experts=8, k=2, drop_tokens=False, starve_rank=3,
                                         force_plan=[(0, 0, (1, 2, 3)), (5, 2, (0, 3))],
                                         options=dict(dispatch="dropless", lancet_chunks=3)),
    "dropless_auto_lancet_auto": dict(num_experts=8, k=2, drop_tokens=False,
                                      options=dict(dispatch="dropless", placement="auto", alpha=0.0,
                                                   lancet_chunks="auto")),
    "capacity_prophet_previous_replan2_unoverlapped": dict(
        num_experts=8, k=2, options=dict(placement="pro_prophet", plan_from="previous", alpha=0.0, replan_every=2,
                                         overlap_transfer=False, exclude_fewest=1, slots_per_rank=3)),
    "padded_auto_exploring_every_call": dict(num_experts=8, k=2, drop_tokens=False,
                                             options=dict(placement="auto", alpha=0.0, lancet_chunks="auto",
                                                          online_check=True, explore_every=1, explore_regret=1e9)),
}


def _check(results: list[dict[str, Any]], cases: dict[str, dict[str, Any]]) -> None:
    for rank, per_case in enumerate(results):
        for name, result in per_case.items():
            for step, diffs in enumerate(result["diffs"]):
                worst = max(diffs, key=diffs.get)
                assert diffs[worst] < TOLERANCE, (
                    f"{name} rank {rank} step {step}: {worst} differs by {diffs[worst]:.3g}"
                )
            case = cases[name]
            if case["options"].get("placement") in ("pro_prophet", "shadowing", "auto") or "force_plan" in case:
                assert any(result["plans"][1:]), f"{name}: no expert was ever replicated"
            timings = {timing for kind, timing in result["kinds"] if kind in ("shadowing", "pro_prophet")}
            if case["options"].get("plan_from") == "previous" or case.get("force_timing") == "predicted":
                assert "predicted" in timings, f"{name}: never ran a prefetched plan ({result['kinds']})"
            elif case["options"].get("placement") == "auto":
                assert "current" in timings, f"{name}: never ran a plan from this step's counts"
            if "starve_rank" in case:
                assert result["counts"][-1][case["starve_rank"]][0] == 0, f"{name}: starved rank still routes to 0"
            if case["options"].get("explore_every") == 1:
                assert all(result["explored"]), f"{name}: the online check did not explore ({result['kinds']})"
            chunks = case["options"].get("lancet_chunks", 1)
            if isinstance(chunks, int):
                assert result["chunks"] == [chunks] * 3
    for name in cases:
        plans = [per_case[name]["plans"] for per_case in results]
        assert all(p == plans[0] for p in plans), f"{name}: ranks disagree on the plan"
        assert all(per_case[name]["kinds"] == results[0][name]["kinds"] for per_case in results)


@pytest.mark.timeout(240)
def test_equal_to_deepspeed_on_two_ranks() -> None:
    results = run_distributed(run_cases, 2, args=(TWO_RANK_CASES,), timeout_s=200)
    _check(results, TWO_RANK_CASES)


@pytest.mark.timeout(240)
def test_equal_to_deepspeed_on_four_ranks() -> None:
    results = run_distributed(run_cases, 4, args=(FOUR_RANK_CASES,), timeout_s=200)
    _check(results, FOUR_RANK_CASES)
