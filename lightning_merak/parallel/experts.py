"""``merak_ep`` under merak3d: each stage's experts spread over that stage's data-parallel ranks.

Expert groups are carved from each pipeline stage's data-parallel ranks: ``ep`` consecutive ranks of one
data-parallel group share out the stage's experts (contiguous ownership, as
:func:`~lightning_merak.plugins.moe.experts.exchange.local_expert_range` fixes it) and exchange tokens by
all-to-all; the ranks holding the same experts across those groups form an expert-data-parallel group. Every
rank runs ``enable_expert_parallel`` on its whole model before the build, so the trace (which runs every block
on every rank) pairs each all-to-all within the rank's own data-parallel group, a meta model materialises only
the local experts, and the pretrained seam reads only those. Expert weights are marked ``allreduce=False`` and
so stay out of merak3d's data-parallel average; their gradient, already the sum over every data-parallel
rank's tokens (the all-to-all's backward brings them home), is summed over the expert-data-parallel group and
divided by the data-parallel size: the gradient of the mean loss the dense average gives the rest. Clipping
counts each expert once: the expert weights are registered as split over the expert group. Tensor parallelism
does not cut the experts: merak3d's data-parallel groups are per tensor-parallel index, so each tp rank of a
data-parallel position holds the same experts and exchanges with its own index's peers, and since every tp
rank sees the same tokens at the MoE block (with sequence parallelism too), their expert outputs and gradients
are identical and clipping counts them on tp rank 0 as any replicated weight. Checkpoints keep
each fused expert tensor whole, each expert group writing its slice (:mod:`.checkpoint`), so any layout, any
``ep`` and ``strategy=ddp`` resume them. LoRA factors of adapters on the experts are cut, reduced, clipped and
checkpointed with them.

:func:`expert_layout_problem` and :func:`expert_group_ranks` are pure; :class:`Merak3DExperts` is the thin
integration the experts callback drives.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.distributed.collectives import average_gradients
from lightning_merak.distributed.process_groups import new_group
from lightning_merak.plugins.moe.experts import (
    EXPERT_TENSORS,
    ExpertParallelReport,
    enable_expert_parallel,
    experts_modules,
)
from lightning_merak.protocols.layout_aware import data_parallel_groups_from_mesh

__all__ = ["ExpertGroups", "Merak3DExperts", "check_merak3d_experts",
           "expert_group_ranks", "expert_layout_problem", "planned_expert_parallel", "swapped_experts_problem"]


def expert_layout_problem(*, data_parallel: int, sharding: str, schedule: str,
                          micro_batching: str, ep_size: Optional[int]) -> Optional[str]:
    """Why ``merak_ep`` cannot run in this merak3d layout, with the fix; ``None`` when it can."""
    if sharding != "none":
        return (f"data_parallel_sharding={sharding!r}: the sharded modes split the replicated parameters' state "
                "over the data-parallel ranks, where merak_ep's experts already differ per rank; use "
                "data_parallel_sharding='none'")
    if schedule == "interleaved_zero_bubble":
        return ("schedule='interleaved_zero_bubble' computes weight gradients in a pass of their own, which the "
                "experts' all-to-all backward is not split for; use 1f1b, gpipe, shifted_critical_path or "
                "interleaved_1f1b")
    if micro_batching != "none":
        return (f"micro_batching={micro_batching!r}: data-parallel ranks may then run different micro-batch counts, "
                "and every expert all-to-all needs all of its ranks; use micro_batching='none'")
    ep = data_parallel if ep_size is None else ep_size
    if ep < 1 or data_parallel % ep:
        return (f"moe.ep_size={ep} does not divide data_parallel={data_parallel}: under merak3d experts are "
                f"spread over each stage's data-parallel ranks; choose a divisor of {data_parallel}")
    return None


def expert_group_ranks(data_parallel_groups: list[list[int]], ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The expert groups (``ep_size`` consecutive ranks of each data-parallel group) and the
    expert-data-parallel groups (the ranks at one position of each expert group of a data-parallel group),
    in the same order on every rank."""
    ep_groups, edp_groups = [], []
    for ranks in data_parallel_groups:
        if len(ranks) % ep_size:
            raise ValueError(f"ep_size={ep_size} does not divide a data-parallel group of {len(ranks)} ranks")
        ep_groups += [ranks[i:i + ep_size] for i in range(0, len(ranks), ep_size)]
        edp_groups += [ranks[j::ep_size] for j in range(ep_size)]
    return ep_groups, edp_groups


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert group, its expert-data-parallel group, and the data-parallel size gradients divide by."""

    ep_group: Any
    edp_group: Any
    edp_size: int
    data_parallel: int


def _layout_values(strategy: Any, world_size: int) -> dict[str, Any]:
    """The layout :func:`expert_layout_problem` checks. Left to the planner: the largest data-parallel degree it may
    choose (an expert group must fit one) and ``"none"`` for ``data_parallel_sharding="auto"`` (all it searches)."""
    if strategy.layout_built or getattr(strategy, "_groups", None) is not None:
        layout = strategy.layout
        dp, sharding = layout.data_parallel, layout.data_parallel_sharding
    elif strategy.needs_planning:
        degrees = strategy._arguments.degrees
        pp, tp = strategy._arguments.launch_degrees(world_size)
        dp = degrees["dp"] if isinstance(degrees["dp"], int) else world_size // ((pp or 1) * (tp or 1))
        sharding = strategy._arguments.data_parallel_sharding.replace("auto", "none")
    else:
        dp, _, _ = strategy.resolve_layout(world_size)
        sharding = strategy._arguments.data_parallel_sharding
    return {"data_parallel": dp, "sharding": sharding, "schedule": strategy.schedule,
            "micro_batching": strategy.micro_batching.mode}


def swapped_experts_problem(strategy: Any, world_size: int, ep_size: int) -> Optional[str]:
    """Why our DeepSpeed-MoE layer's experts cannot spread over ``ep_size`` ranks in this run, with the fix; None
    when they can. They spread over the data-parallel ranks: all of them under DDP, each stage's under merak3d,
    whose layout they need when the callbacks are set up, before a planner could choose it."""
    if getattr(strategy, "strategy_name", None) == "merak3d":
        if strategy.needs_planning:
            return ("the DeepSpeed-MoE layer's expert groups are carved from merak3d's layout when the callbacks are "
                    "set up, before the planner chooses one; set every 'auto' of strategy.pipeline_parallel, "
                    "tensor_parallel, tp_overlap, recompute, data_parallel_sharding and context_parallel to a value "
                    "(data_parallel may stay auto), or use moe.experts=merak_ep, which the planner prices")
        data_parallel = _layout_values(strategy, world_size)["data_parallel"]
    else:
        data_parallel = world_size
    if ep_size < 1 or data_parallel % ep_size:
        return (f"moe.ep_size={ep_size} does not divide the {data_parallel} data-parallel ranks the experts are "
                f"spread over; choose a divisor of {data_parallel} (moe.ep_size=1 keeps every expert on each rank)")
    return None


def check_merak3d_experts(strategy: Any, world_size: int, ep_size: Optional[int] = None) -> None:
    """Refuse, before any process starts, a merak3d layout ``merak_ep`` does not run in (see
    :func:`expert_layout_problem`).

    With processes running (the expert groups are created next, from the layout), a layout left to ``"auto"`` is
    planned first, the experts' exchange over ``ep_size`` ranks priced (unset: each ep dividing dp and the experts,
    :func:`planned_expert_parallel` then reads the chosen one), and checked as chosen."""
    problem = expert_layout_problem(**_layout_values(strategy, world_size), ep_size=ep_size)
    module = getattr(strategy, "_lightning_module", None)
    if problem is None and strategy.needs_planning and dist.is_initialized() and module is not None:
        if getattr(module, "model", None) is None:
            raise ValueError("moe.experts=merak_ep under merak3d refused: an 'auto' layout is planned when the "
                             "expert groups are created (the callbacks' setup), before configure_model builds the "
                             "model; build it in the LightningModule's __init__, or fix pipeline_parallel, "
                             "tensor_parallel and data_parallel_sharding")
        strategy.adopt_planned_layout(module.trainer, merak_ep=True, ep_size=ep_size)
        problem = expert_layout_problem(**_layout_values(strategy, world_size), ep_size=ep_size)
    if problem is not None:
        raise ValueError(f"moe.experts=merak_ep under merak3d refused: {problem}")


def planned_expert_parallel(strategy: Any, ep_size: Optional[int], data_parallel: int) -> int:
    """The expert-parallel size the groups are carved for: ``ep_size`` when set, else the one an ``auto`` layout's
    plan chose (it searched every size dividing dp and the experts), else the whole data-parallel group."""
    if ep_size is not None:
        return ep_size
    choice = getattr(strategy, "layout_choice", None)
    planned = getattr(getattr(choice, "layout", None), "ep", None)
    return planned if isinstance(planned, int) else data_parallel


class Merak3DExperts:
    """``merak_ep`` on one merak3d rank: its groups, the experts switch, and the expert gradients' reduction."""

    def __init__(self, strategy: Any, ep_size: Optional[int] = None) -> None:
        """Check the layout and create every expert and expert-data-parallel group (collective: all ranks)."""
        check_merak3d_experts(strategy, dist.get_world_size(), ep_size)
        self._strategy = strategy
        strategy._checkpointer.before_load = self.enable  # a model configure_model built: cut before it is read
        mesh = strategy.device_mesh
        dp_groups = data_parallel_groups_from_mesh(mesh.mesh.tolist(), list(mesh.mesh_dim_names))
        data_parallel = len(dp_groups[0])
        ep = planned_expert_parallel(strategy, ep_size, data_parallel)
        ep_ranks, edp_ranks = expert_group_ranks(dp_groups, ep)
        rank = dist.get_rank()
        mine: dict[str, Any] = {}
        for kind, all_ranks in (("ep", ep_ranks), ("edp", edp_ranks)):
            for ranks in all_ranks:
                group = new_group(ranks)
                if rank in ranks:
                    mine[kind] = group
        self.groups = ExpertGroups(mine["ep"], mine["edp"], data_parallel // ep, data_parallel)
        self._registered: set[int] = set()
        self.report: Optional[ExpertParallelReport] = None
        """What :meth:`enable` did on this rank (None until then)."""

    def enable(self, model: nn.Module) -> ExpertParallelReport:
        """Keep this rank's experts of ``model`` (the whole model, meta or real, before the build); once."""
        if self.report is None:
            self.report = enable_expert_parallel(model, self.groups.ep_group)
            for _, experts in experts_modules(model):
                experts.materialize_init = _LocalExpertsInit(self.report.ep_rank)
        return self.report

    def reduce_gradients(self, module: nn.Module) -> None:
        """Expert gradients: summed over the ranks holding the same experts, divided by the data-parallel size.

        Also registers the (built, materialised) expert weights as split over the expert group, so clipping
        sums their squares there and counts every expert once."""
        params = expert_parameters(module)
        fresh = [p for p in params if id(p) not in self._registered]
        if fresh:
            self._strategy.register_sharded_gradients(fresh, self.groups.ep_group)
            self._registered |= {id(p) for p in fresh}
        grads = [p.grad for p in params if p.grad is not None]
        if not grads or self.groups.data_parallel == 1:
            return
        average_gradients(grads, self.groups.edp_group if self.groups.edp_size > 1 else None,
                          self.groups.data_parallel)


class _LocalExpertsInit:
    """Random init of a meta-built experts module's local slice, drawn per expert rank.

    merak3d seeds a module's init by its name alone, which every rank of the expert group shares: their
    slices would start equal (expert ``e`` a copy of ``e + E/ep``). Offsetting the seed by the expert rank
    keeps the experts distinct without drawing the whole tensor. Pretrained weights replace it anyway."""

    def __init__(self, ep_rank: int) -> None:
        self.ep_rank = ep_rank

    def __call__(self, module: nn.Module) -> None:
        torch.manual_seed((torch.initial_seed() + 7919 * self.ep_rank) % (2**63))
        with torch.no_grad():
            for tensor in EXPERT_TENSORS:
                param = getattr(module, tensor, None)
                if isinstance(param, nn.Parameter) and tensor.endswith("_bias"):
                    nn.init.zeros_(param)
                elif isinstance(param, nn.Parameter):  # the registry families' own init of expert weights
                    nn.init.normal_(param, std=_initializer_range(module))


def _initializer_range(module: nn.Module) -> float:
    return float(getattr(getattr(module, "config", None), "initializer_range", 0.02))


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The expert weights this rank holds now (after the build: its stages' experts, materialised), and the LoRA
    factors of adapters on them (cut with their experts, so reduced like them)."""
    experts = [param for _, experts in experts_modules(module) for tensor in EXPERT_TENSORS
               if isinstance(param := getattr(experts, tensor, None), nn.Parameter)]
    if "peft" not in sys.modules:  # no adapter exists; importing the adapters would pull PEFT in
        return experts
    from lightning_merak.adapters.moe import expert_adapter_parameters  # lazy: PEFT

    return experts + expert_adapter_parameters(module)
