"""Our MoE under a real DeepSpeed ZeRO-1/2 engine (CPU, gloo) on 2 and 4 ranks.

Regression tests for DeepSpeed's MoE-under-ZeRO pitfalls: expert gradients scaled by the
world size (deepspeed#5618) and router weights not updated under ZeRO-2 (deepspeed#4482).
Each rank trains ``dense → MoE → head`` with plain SGD (no momentum), so every parameter
update is ``-lr · gradient`` and a wrongly scaled gradient shows up as a wrongly sized step.
The trajectory must equal a single-process reference that holds every expert
(``ep_size=1``) and averages the ranks' losses, and the stock ``deepspeed.moe.layer.MoE``
trained by the same engine. Cases cover capacity and dropless dispatch, replication, Lancet
chunks and deferred weight gradients, expert-data-parallel groups of 2 (ep_size=2 on 4 ranks),
DeepSpeed's gradient-norm clipping, and a layer that attached its groups before the engine
(as the Lightning callback does), which the engine must not attach again.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_merak.distributed.deepspeed_comm import init_deepspeed_comm
from lightning_merak.testing import run_distributed
from tests.test_moe_layer import HIDDEN, cheap_transfer_cost_model, expert_mlp

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks or a subprocess

STEPS = 3
TOKENS = 24
LR = 0.5
AUX_COEF = 0.1
TOLERANCE = 2e-5


class TinyMoENet(nn.Module):
    """``dense → MoE → head``; returns the per-rank loss (MSE + coefficient · aux loss)."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.moe = moe
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.dense(x))
        out, l_aux, _ = self.moe(h)
        prediction = self.head(h + out).squeeze(-1)
        return nn.functional.mse_loss(prediction, target) + AUX_COEF * l_aux


def _batch(rank: int, step: int, gate_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(2, TOKENS // 2, HIDDEN, generator=generator)
    x = x + 0.8 * gate_weight[rank % gate_weight.size(0)]
    return x, torch.randn(2, TOKENS // 2, generator=generator)


def _moe_kwargs(case: dict[str, Any], ep_size: int) -> dict[str, Any]:
    return dict(hidden_size=HIDDEN, expert=expert_mlp(), num_experts=case["num_experts"], ep_size=ep_size, k=case["k"],
                capacity_factor=case.get("capacity_factor", 1.0), min_capacity=2,
                drop_tokens=case.get("drop_tokens", True), use_rts=False, top2_2nd_expert_sampling=False)


def _reference(world_size: int, case: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Single process, every expert local: SGD on the mean of the ranks' losses, optionally norm-clipped."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    torch.manual_seed(0)
    model = TinyMoENet(DeepSpeedMoE(**_moe_kwargs(case, 1)))
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    gate_weight = model.moe.deepspeed_moe.gate.wg.weight.detach().clone()
    trajectory = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = sum(model(*_batch(rank, step, gate_weight)) for rank in range(world_size)) / world_size
        loss.backward()
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        optimizer.step()
        trajectory.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return initial, trajectory


def _local_state(full: dict[str, torch.Tensor], ep_rank: int, experts_per_rank: int) -> dict[str, torch.Tensor]:
    """An expert-parallel model's view of a full state: EP rank ``ep_rank``'s experts, renumbered from 0."""
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    local = {}
    for name, value in full.items():
        if not name.startswith(prefix):
            local[name] = value
            continue
        index, rest = name[len(prefix):].split(".", 1)
        if ep_rank * experts_per_rank <= int(index) < (ep_rank + 1) * experts_per_rank:
            local[f"{prefix}{int(index) - ep_rank * experts_per_rank}.{rest}"] = value
    return local


def _train_with_engine(moe: nn.Module, stage: int, initial: dict[str, torch.Tensor], case: dict[str, Any],
                       attach_first: bool) -> list[dict[str, torch.Tensor]]:
    import deepspeed
    import torch.distributed as dist

    from lightning_merak.plugins.moe import moe_param_groups

    rank = dist.get_rank()
    model = TinyMoENet(moe)
    model.load_state_dict(initial)
    if attach_first:
        moe.deepspeed_moe._attach()
    optimizer = torch.optim.SGD(moe_param_groups(model), lr=LR)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": case.get("clip", 0.0),
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    init_deepspeed_comm()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    gate_weight = initial["moe.deepspeed_moe.gate.wg.weight"]
    trajectory = []
    for step in range(STEPS):
        loss = engine(*_batch(rank, step, gate_weight))
        engine.backward(loss)
        engine.step()
        trajectory.append({name: p.detach().clone() for name, p in engine.module.named_parameters()})
    engine.destroy()
    return trajectory


def run_zero(rank: int, world_size: int, stage: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from lightning_merak.plugins.moe import MoE

    init_deepspeed_comm("gloo")  # DeepSpeed's comm without compiling its CPU shared-memory kernel (unused here)
    results = {}
    for name, case in cases.items():
        ep_size = case.get("ep_size", world_size)
        experts_per_rank = case["num_experts"] // ep_size
        initial, reference = _reference(world_size, case)
        initial = _local_state(initial, rank % ep_size, experts_per_rank)
        ours = MoE(**_moe_kwargs(case, ep_size), cost_model=cheap_transfer_cost_model(experts_per_rank),
                   **{"online_check": False, **case["options"]})  # the model's plan: each case replicates
        results[name] = {
            "initial": initial,
            "reference": [_local_state(state, rank % ep_size, experts_per_rank) for state in reference],
            "trained": {
                "ours": _train_with_engine(ours, stage, initial, case, attach_first=case.get("attach_first", False)),
                "deepspeed": _train_with_engine(DeepSpeedMoE(**_moe_kwargs(case, ep_size)), stage, initial, case,
                                                attach_first=False),
            },
            "replicas": ours.deepspeed_moe.stats["plan"].num_replicas,
        }
    return results


TWO_RANK_CASES = {
    "capacity_top2_prophet_lancet2": dict(num_experts=4, k=2, options=dict(placement="pro_prophet", alpha=0.0,
                                                                            lancet_chunks=2)),
    "dropless_top2_lancet2_clipped": dict(num_experts=4, k=2, drop_tokens=False, clip=0.05, attach_first=True,
                                          options=dict(dispatch="dropless", lancet_chunks=2)),
    "dropless_top2_auto_previous": dict(num_experts=4, k=2, drop_tokens=False,
                                        options=dict(dispatch="dropless", placement="auto", plan_from="previous",
                                                     alpha=0.0)),
}

FOUR_RANK_CASES = {
    "ep2_capacity_top1_shadowing": dict(num_experts=4, k=1, ep_size=2, capacity_factor=2.0,
                                        options=dict(placement="shadowing")),
    "ep4_dropless_top2_prophet_lancet2_clipped": dict(num_experts=8, k=2, drop_tokens=False, clip=0.05,
                                                      options=dict(dispatch="dropless", placement="pro_prophet",
                                                                   alpha=0.0, lancet_chunks=2)),
}


def _check(results: list[dict[str, Any]], cases: dict[str, dict[str, Any]]) -> None:
    for rank, per_case in enumerate(results):
        for case_name, result in per_case.items():
            initial, reference = result["initial"], result["reference"]
            for engine_name, trajectory in result["trained"].items():
                for step, (got, expected) in enumerate(zip(trajectory, reference)):
                    for name, value in expected.items():
                        error = (got[name] - value).abs().max().item()
                        assert error < TOLERANCE, (
                            f"{case_name} {engine_name} rank {rank} step {step}: {name} differs from the reference "
                            f"by {error:.3g}")
            first = reference[0]
            moved = {name: (first[name] - initial[name]).abs().max().item() for name in first}
            assert moved["moe.deepspeed_moe.gate.wg.weight"] > 1e-5, f"{case_name}: the router was not updated"
            assert all(v > 0 for k, v in moved.items() if ".deepspeed_experts." in k), f"{case_name}: idle expert"
    for case_name, case in cases.items():
        if case["options"].get("placement", "none") != "none":
            assert results[0][case_name]["replicas"] > 0, f"{case_name}: no expert was replicated"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_matches_reference_on_two_ranks(stage: int) -> None:
    results = run_distributed(run_zero, 2, args=(stage, TWO_RANK_CASES), timeout_s=240)
    _check(results, TWO_RANK_CASES)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_matches_reference_on_four_ranks(stage: int) -> None:
    results = run_distributed(run_zero, 4, args=(stage, FOUR_RANK_CASES), timeout_s=360)
    _check(results, FOUR_RANK_CASES)
