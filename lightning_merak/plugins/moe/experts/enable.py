"""Switch a transformers-5 MoE model to expert parallelism: check, slice, register, report.

:func:`enable_expert_parallel` refuses a model before touching it when its family cannot run exactly
(:data:`REFUSED_FAMILIES`, or no experts module going through transformers' registry with the
standard ``(hidden_states, top_k_index, top_k_weights)`` call), then keeps each experts module's
local experts (:func:`~lightning_merak.plugins.moe.experts.exchange.local_expert_range`) and
switches ``config._experts_implementation`` to ``merak_ep``. The family's router, shared experts
and aux loss are not touched. :func:`expert_load` exposes the routes per (rank, expert) each layer
saw, :func:`plan_replicas` turns them into Pro-Prophet or FasterMoE placement plans and
:func:`set_replica_plans` has ``merak_ep`` run them (replica ranks compute their own routes).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from lightning_merak.plugins.moe.core.placement import Padding
from lightning_merak.plugins.moe.core.placement_planner import plan_pro_prophet
from lightning_merak.plugins.moe.core.shadowing import plan_shadowing
from lightning_merak.plugins.moe.experts.adapter_slices import shard_expert_adapters
from lightning_merak.plugins.moe.experts.exchange import local_expert_range
from lightning_merak.plugins.moe.experts.grouped import EXPERT_TENSORS
from lightning_merak.plugins.moe.experts.parallel import (
    EP_IMPLEMENTATION,
    GROUPED_IMPLEMENTATION,
    SHARD_ATTRIBUTE,
    ExpertShard,
    register,
)
from lightning_merak.plugins.moe.options import option_key

__all__ = [
    "EXACT_FAMILIES",
    "REFUSED_FAMILIES",
    "ExpertParallelReport",
    "add_loads",
    "enable_expert_parallel",
    "enable_grouped_experts",
    "expert_load",
    "experts_modules",
    "family_support",
    "plan_replicas",
    "set_replica_plans",
]

EXACT_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")
"""Families whose swapped outputs and gradients are tested equal to the unswapped model (fp32, ≤1e-5)."""

_OWN_LOOP = "its experts run their own loop outside transformers' experts registry (no @use_experts_implementation)"
REFUSED_FAMILIES: dict[str, str] = {
    "dbrx": _OWN_LOOP + "; DbrxExperts splits fused weights per expert inside its forward",
    "jetmoe": _OWN_LOOP + "; JetMoE also routes attention heads through experts (MoA)",
    "llama4": _OWN_LOOP + "; Llama4TextExperts are a bmm over all experts with a sigmoid-scaled input",
    "llama4_text": _OWN_LOOP + "; Llama4TextExperts are a bmm over all experts with a sigmoid-scaled input",
    "nllb_moe": _OWN_LOOP + "; capacity-based top-2 router with token dropping",
    "switch_transformers": _OWN_LOOP + "; capacity-based top-1 router with token dropping",
    "longcat_flash": _OWN_LOOP + "; zero-computation (identity) experts are routed by ids ≥ num_experts",
    "doge": _OWN_LOOP + "; product-key retrieval experts (embedding lookups, not expert MLPs)",
    "step3p7": _OWN_LOOP,
}
"""Families refused with the reason. Any other family is inspected: see :func:`family_support`."""

_CALL = ["self", "hidden_states", "top_k_index", "top_k_weights"]
_CALLS = (_CALL, ["self", "hidden_states", "router_indices", "routing_weights"])
"""The registry's call, and GptOss' names for the same three positional arguments (its block passes them by
position, and transformers' dispatch hands them on as they came)."""


@dataclass(frozen=True)
class ExpertParallelReport:
    """What :func:`enable_expert_parallel` did on this rank."""

    family: str
    ep_rank: int
    ep_size: int
    num_experts: int
    local_experts: range
    modules: tuple[str, ...]
    expert_parameters: tuple[str, ...]
    expert_params_before: int
    expert_params_after: int
    expert_buffers: tuple[str, ...] = ()
    """Buffers cut to the local experts with their tensors (INT4 experts' scales and zero-points, of a module with
    ``holds_local_experts``): a data-parallel wrapper must not broadcast them from rank 0."""


def _is_registry_experts(module: nn.Module) -> bool:
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "has_gate") and hasattr(module, "down_proj")


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``@use_experts_implementation`` experts modules of ``model``, by qualified name."""
    return [(name, m) for name, m in model.named_modules() if _is_registry_experts(m)]


def _hf_root(model: nn.Module) -> nn.Module:
    """``model`` itself, or the first transformers model inside a wrapper (e.g. a LightningModule)."""
    if hasattr(getattr(model, "config", None), "model_type"):
        return model
    return next((m for m in model.modules() if hasattr(getattr(m, "config", None), "model_type")), model)


def _model_type(model: nn.Module) -> str:
    config = getattr(_hf_root(model), "config", None)
    return str(getattr(config, "model_type", type(model).__name__))


def family_support(model: nn.Module) -> tuple[bool, str]:
    """Whether ``merak_ep`` runs this model exactly, and why not when it does not."""
    family = _model_type(model)
    if family in REFUSED_FAMILIES:
        return False, REFUSED_FAMILIES[family]
    modules = experts_modules(model)
    if not modules:
        return False, f"{family}: no experts module goes through transformers' experts registry"
    for name, module in modules:
        call = list(inspect.signature(inspect.unwrap(type(module).forward)).parameters)
        if call not in _CALLS:
            return False, f"{name} ({type(module).__name__}) is called with {call}, not the registry's {_CALL}"
        if not hasattr(module, "gate_up_proj" if module.has_gate else "up_proj"):
            return False, f"{name} ({type(module).__name__}) holds no fused 3D expert projection"
        if getattr(module, "_is_expert_parallel", False) or hasattr(module, SHARD_ATTRIBUTE):
            return False, f"{name} is already expert parallel; build the model again"
    if family in EXACT_FAMILIES:
        return True, "tested exact"
    return True, "goes through the experts registry with the standard call (not in the tested set)"


def expert_split_problem(model: nn.Module, ep_size: int, data_parallel: Optional[int] = None) -> Optional[str]:
    """Why ``model``'s experts cannot be spread over ``ep_size`` expert-parallel ranks, or ``None``: every rank
    holds an equal contiguous share of each layer's experts (:func:`~.exchange.local_expert_range`). Checked on the
    model alone, so an entry point refuses before launch. ``data_parallel``: the ranks an expert group is carved
    from, where the entry point knows them; the sizes offered then divide them too, as an expert group must."""
    counts = sorted({int(module.num_experts) for _, module in experts_modules(model)})
    uneven = [count for count in counts if count % ep_size]
    if not uneven:
        return None
    shared = counts if data_parallel is None else [*counts, data_parallel]
    choices = [size for size in range(1, min(shared) + 1) if all(count % size == 0 for count in shared)]
    within = f" (dividing both the experts and the {data_parallel} data-parallel ranks)" if data_parallel else ""
    return (f"{option_key('ep_size')}={ep_size} does not divide the {uneven[0]} experts of a MoE layer: each "
            f"expert-parallel rank holds an equal share of every layer's experts; choose {option_key('ep_size')} from "
            f"{choices}{within}")


def _resolve_group(group: Any) -> tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _set_implementation(model: nn.Module, modules: list[tuple[str, nn.Module]], name: str) -> None:
    register()
    root = _hf_root(model)
    if hasattr(root, "set_experts_implementation"):
        root.set_experts_implementation(name)
    for _, module in modules:
        if module.config._experts_implementation != name:
            module.config._experts_implementation = name


def enable_expert_parallel(model: nn.Module, group: Any = None) -> ExpertParallelReport:
    """Keep this rank's experts and run every experts module with ``merak_ep`` over ``group``.

    ``group`` is the expert-parallel process group (default: the world; without an initialised
    process group, one rank holding every expert). Adapter factors on the experts (PEFT ``target_parameters``:
    LoRA, Q-BaRA, QA-HiRA) are cut to the local experts too and listed with them; a parametrized (e.g. INT4)
    expert tensor keeps its local experts' stored form (:func:`_keep_local`). Expert parameters are marked
    ``allreduce=False``: a data-parallel wrapper must leave them out (their gradient already sums every rank's tokens;
    divide it by the data-parallel size for the gradient of the mean loss, as
    :class:`~lightning_merak.callbacks.moe.experts.ExpertParallelCallback` does), and the report's
    ``expert_buffers`` too (INT4 scales and zero-points: broadcast from rank 0 they dequantize the wrong experts).
    A parametrized tensor is reported by its stored parameter's name (``parametrizations.<tensor>.original``).
    """
    supported, reason = family_support(model)
    if not supported:
        raise ValueError(f"expert parallelism refused for {_model_type(model)}: {reason}")
    ep_rank, ep_size = _resolve_group(group)
    modules = experts_modules(model)
    num_experts = {int(m.num_experts) for _, m in modules}
    if len(num_experts) != 1:
        raise ValueError(f"experts modules disagree on the expert count {sorted(num_experts)}")
    (total,) = num_experts
    problem = expert_split_problem(model, ep_size)
    if problem is not None:
        raise ValueError(problem)
    mine = local_expert_range(total, ep_rank, ep_size)
    for name, module in modules:
        for tensor in EXPERT_TENSORS:
            param = getattr(module, tensor, None)
            if param is not None and param.shape[0] != total:
                raise ValueError(f"{name}.{tensor} has {param.shape[0]} experts, expected {total}")

    before = after = 0
    names, buffers = [], []
    for name, module in modules:
        prefix = f"{name}." if name else ""
        for tensor in EXPERT_TENSORS:
            if getattr(module, tensor, None) is None:
                continue
            kept = _keep_local(module, tensor, mine)
            before, after = before + kept[0], after + kept[1]
            stored = f"parametrizations.{tensor}.original" if parametrize.is_parametrized(module, tensor) else tensor
            names.append(prefix + stored)
        buffers += [".".join(filter(None, (name, owner_name, buffer)))
                    for owner_name, owner in module.named_modules() if getattr(owner, "holds_local_experts", False)
                    for buffer, _ in owner.named_buffers(recurse=False)]
        setattr(module, SHARD_ATTRIBUTE, ExpertShard(group, ep_rank, ep_size, total, mine))
    if any(hasattr(m, "parameter_name") for m in model.modules()):  # adapters on experts (LoRA, Q-BaRA, QA-HiRA)
        names += shard_expert_adapters(model, (module for _, module in modules))
    _set_implementation(model, modules, EP_IMPLEMENTATION)
    return ExpertParallelReport(_model_type(model), ep_rank, ep_size, total, mine,
                                tuple(n for n, _ in modules), tuple(names), before, after, tuple(buffers))


def _keep_local(module: nn.Module, tensor: str, mine: range) -> tuple[int, int]:
    """Keep ``mine`` of ``module.<tensor>``'s experts, marked ``allreduce=False``; ``(numel before, after)``.

    A parametrized tensor (INT4 experts: packed codes under a dequantizing parametrization) keeps its stored
    original's rows and asks each parametrization with a ``keep_experts(range)`` method to cut its own state.
    """
    if parametrize.is_parametrized(module, tensor):
        chain = module.parametrizations[tensor]
        stored = chain.original
        chain.original = nn.Parameter(stored.data[mine.start:mine.stop].clone(), requires_grad=stored.requires_grad)
        chain.original.allreduce = False  # type: ignore[attr-defined]
        for step in chain:
            if hasattr(step, "keep_experts"):
                step.keep_experts(mine)
        return stored.numel(), chain.original.numel()
    param = getattr(module, tensor)
    local = nn.Parameter(param.data[mine.start:mine.stop].clone(), requires_grad=param.requires_grad)
    local.allreduce = False  # type: ignore[attr-defined]
    setattr(module, tensor, local)
    return param.numel(), local.numel()


def enable_grouped_experts(model: nn.Module) -> None:
    """Run every experts module with the single-process dropless grouped core (``merak_grouped``)."""
    supported, reason = family_support(model)
    if not supported:
        raise ValueError(f"grouped experts refused for {_model_type(model)}: {reason}")
    _set_implementation(model, experts_modules(model), GROUPED_IMPLEMENTATION)


def expert_load(model: nn.Module, reset: bool = True) -> dict[str, torch.Tensor]:
    """Per experts module, routes ``[ep, E]`` each rank sent to each expert since the last reset.

    Identical on every rank of the expert group (it is the all-gathered count matrix), so a plan
    computed from it is the same everywhere without another collective.
    """
    loads = {}
    for name, module in experts_modules(model):
        shard: ExpertShard | None = getattr(module, SHARD_ATTRIBUTE, None)
        if shard is None:
            raise ValueError(f"{name} is not expert parallel; call enable_expert_parallel(model) first")
        loads[name] = shard.take_load() if reset else shard.load.clone()
    return loads


def add_loads(total: dict[str, torch.Tensor], loads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``total`` with :func:`expert_load`'s counts ``loads`` added per experts module (new tensors; the inputs are
    left as they are)."""
    return {**total, **{name: counts + total[name] if name in total else counts.clone()
                        for name, counts in loads.items()}}


def set_replica_plans(model: nn.Module, plans: dict[str, Any] | None) -> None:
    """Run the given placement plans (from :func:`plan_replicas`, per experts module) from the next forward.

    ``None`` (or a module left out) runs no replicas. Every rank of the expert group must pass the same
    plans, as :func:`plan_replicas` gives from :func:`expert_load`'s identical counts.
    """
    modules = dict(experts_modules(model))
    for name in (plans or {}):
        if name not in modules:
            raise ValueError(f"no experts module named {name!r}; use the names expert_load(model) returns")
    for name, module in modules.items():
        shard: ExpertShard | None = getattr(module, SHARD_ATTRIBUTE, None)
        plan = (plans or {}).get(name)
        if shard is None:
            raise ValueError(f"{name} is not expert parallel; call enable_expert_parallel(model) first")
        if plan is not None:
            if (plan.num_experts, plan.ep_size) != (shard.num_experts, shard.ep_size):
                raise ValueError(f"plan for {name} is for {plan.num_experts} experts on {plan.ep_size} ranks, "
                                 f"the layer has {shard.num_experts} on {shard.ep_size}")
            per_rank = len(shard.experts)
            for rep in plan.replications:
                if rep.owner != rep.expert // per_rank:
                    raise ValueError(f"plan for {name}: expert {rep.expert} is owned by rank "
                                     f"{rep.expert // per_rank}, not {rep.owner} (ownership is contiguous)")
        shard.plan = plan


def plan_replicas(
    loads: dict[str, torch.Tensor],
    cost_model: Any,
    policy: Literal["pro_prophet", "shadowing"] = "pro_prophet",
) -> dict[str, Any]:
    """A placement plan per experts module from :func:`expert_load`'s counts (dropless padding).

    Uses the MoE plugin's planners unchanged: ownership is contiguous in both, so the plans'
    replica sets name the same ranks ``merak_ep`` sends to.
    """
    if policy not in ("pro_prophet", "shadowing"):
        raise ValueError(f"policy={policy!r}: use pro_prophet or shadowing")
    plans = {}
    for name, counts in loads.items():
        rows = counts.tolist()
        plans[name] = plan_pro_prophet(rows, cost_model, Padding("dropless")) if policy == "pro_prophet" \
            else plan_shadowing(rows, cost_model)
    return plans
