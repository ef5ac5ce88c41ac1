"""Pro-Prophet / FasterMoE replicas for ``merak_ep``, re-planned from the load every few batches.

The planners are the MoE plugin's (:func:`~lightning_merak.plugins.moe.experts.enable.plan_replicas`); their
cost model is profiled once, collectively over the expert group, with one local expert of the model's own
experts module as the per-expert computation (:func:`profile_experts_cost_model`). Plans come from the counts
every rank of the group already holds (the all-gathered routes), so every rank plans alike without another
collective. As in Pro-Prophet, a plan is made from the steps before it and runs until the next re-plan.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from lightning_merak.plugins.moe.cost_measurement import profile_cost_model
from lightning_merak.plugins.moe.experts.enable import add_loads, experts_modules, plan_replicas, set_replica_plans
from lightning_merak.plugins.moe.experts.grouped import EXPERT_TENSORS, expert_mlp
from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE
from lightning_merak.plugins.moe.options import option_key

__all__ = ["ReplicaPlanner", "profile_experts_cost_model"]

Policy = Literal["pro_prophet", "shadowing"]


class _OneLocalExpert(nn.Module):
    """Local expert 0 of a fused experts module as a per-expert MLP: its parameters are that expert's slices (so
    the profile prices one expert's bytes) and its forward is the family's own expert computation."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self._experts = (experts,)  # not a submodule: its parameters are all local experts'
        self.slices = nn.ParameterDict({name: nn.Parameter(getattr(experts, name)[:1].detach().clone(),
                                                           requires_grad=False)
                                        for name in EXPERT_TENSORS if getattr(experts, name, None) is not None})

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return expert_mlp(self._experts[0], rows, [rows.shape[0]], tensors=dict(self.slices))


def profile_experts_cost_model(model: nn.Module) -> Any:
    """The placement cost model of ``model``'s expert-parallel experts, measured over their expert group."""
    import torch.distributed as dist

    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no experts module in transformers' experts registry")
    _, experts = modules[0]
    shard = getattr(experts, SHARD_ATTRIBUTE, None)
    if shard is None:
        raise ValueError("the experts are not expert parallel; call enable_expert_parallel(model) first")
    ranks = dist.get_process_group_ranks(shard.group) if shard.group is not None else list(range(shard.ep_size))
    weight = next(p for p in experts.parameters())
    return profile_cost_model(_OneLocalExpert(experts), int(experts.config.hidden_size), len(shard.experts),
                              shard.group, ranks, dtype=weight.dtype, device=weight.device)


class ReplicaPlanner:
    """Every ``replan_every`` training batches, plan replicas from the routes seen since the last plan and apply
    them from the next batch on."""

    def __init__(self, policy: Policy, replan_every: int = 1) -> None:
        if policy not in ("pro_prophet", "shadowing"):
            raise ValueError(f"{option_key('placement')}={policy!r}: use pro_prophet or shadowing (or none for no "
                             "replicas)")
        if replan_every < 1:
            raise ValueError(f"{option_key('replan_every')}={replan_every} must be >= 1 (steps between plans)")
        self.policy, self.replan_every = policy, replan_every
        self.cost_model: Any = None
        self.since_plan: dict[str, torch.Tensor] = {}
        self.replicas_planned = 0
        self._batches = 0

    def step(self, model: nn.Module, loads: dict[str, torch.Tensor]) -> None:
        """Add one batch's routes; every ``replan_every`` batches plan from them and apply the plans."""
        self.since_plan = add_loads(self.since_plan, loads)
        self._batches += 1
        if self._batches % self.replan_every:
            return
        if self.cost_model is None:  # collective over the expert group: every rank reaches this step
            self.cost_model = profile_experts_cost_model(model)
        plans = plan_replicas(self.since_plan, self.cost_model, self.policy)
        set_replica_plans(model, plans)
        self.replicas_planned = sum(len(rep.replicas) for plan in plans.values() for rep in plan.replications)
        self.since_plan = {}
