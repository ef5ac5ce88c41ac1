"""Gradients after backward: summed where a shard saw part of the work, averaged over replicas, clipped.

The one owner of merak3d's gradient arithmetic. :func:`average_gradients`, :func:`squared_norm`
and :func:`scale_gradients` are the primitives the layout profiler times (they live in
:mod:`lightning_merak.distributed.collectives` and :mod:`lightning_merak.distributed.gradient_norm`);
:func:`synchronize_gradients` and :func:`clip_by_total_norm` apply them to a built layout. Callbacks that shard a
parameter over a group (EmbRace's tables) do not clip themselves: they register the shards with the strategy
(``register_sharded_gradients``), and the norm here sums their squares over that group.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Protocol, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_merak.distributed.collectives import average_gradients
from lightning_merak.distributed.dtensors import local_tensor
from lightning_merak.distributed.gradient_norm import ShardedGradients, clip_coefficient, scale_gradients, squared_norm
from lightning_merak.parallel.layout import LayoutGroups
from lightning_merak.util.buffers import replicated_buffers

__all__ = ["ReplicaReduction", "TiedParameter", "average_gradients", "averaged_parameters", "clip_by_total_norm",
           "clip_by_value", "replicated_buffers", "replicated_parameters", "scale_gradients", "squared_norm",
           "synchronize_gradients", "total_norm"]


class ReplicaReduction(Protocol):
    """The replicas' gradient reduction :func:`synchronize_gradients` finishes: a
    :class:`~.buckets.DataParallelGradients` (which builds on this module's parameter lists)."""

    def finish(self) -> None:
        """Average the gradients over the replicas, waiting for the reductions started during the backward."""


class TiedParameter(NamedTuple):
    """A tied parameter's copy on the first or last stage, and the group joining the two stages' ranks."""

    group: Any
    param: nn.Parameter
    is_first: bool


def _expert_parallel_group(group_name: Optional[str]) -> dist.ProcessGroup:
    """DeepSpeed's expert-parallel group of the expert weights named ``group_name``."""
    from deepspeed.utils import groups

    if group_name is None or group_name not in groups._get_expert_parallel_group_dict():
        raise RuntimeError(
            f"expert weights (allreduce=False) of group {group_name!r} have no DeepSpeed expert-parallel group; "
            "create the MoE layers' groups (lightning_merak.plugins.moe) before clipping gradients"
        )
    return groups._get_expert_parallel_group(group_name)


def replicated_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters every data-parallel replica holds a copy of.

    Parameters a plugin reduces itself are left out, by the conventions DDP and
    DeepSpeed use: names in ``_ddp_params_and_buffers_to_ignore`` on the module, or
    ``param.allreduce = False`` (expert-parallel weights). Their buffer counterpart is :func:`replicated_buffers`.
    """
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    return [
        param for name, param in module.named_parameters()
        if name not in ignored and getattr(param, "allreduce", True) is not False
    ]


def synchronize_gradients(tensor_partial: list[nn.Parameter], tied: list[TiedParameter], groups: LayoutGroups,
                          data_parallel: Optional[ReplicaReduction]) -> None:
    """Sum the gradients of parameters that saw part of the heads or tokens over the tensor-parallel
    group, sum tied parameters between first and last stage, then average over the replicas with
    ``data_parallel`` (its buckets, some already reduced during the backward)."""
    partial = [local_tensor(p.grad) for p in tensor_partial if p.grad is not None]
    if partial:
        average_gradients(partial, groups.tensor_group, divisor=1)
    for group, param, _ in tied:
        if param.grad is not None:
            dist.all_reduce(local_tensor(param.grad), group=group)
    if groups.layout.data_parallel == 1 or groups.layout.data_parallel_sharding == "full":  # FSDP2 reduced them
        return
    if data_parallel is None:
        raise RuntimeError("data_parallel>1 averages gradients through the strategy's buckets, which setup creates "
                           "for a fit; this backward ran without them")
    data_parallel.finish()


def averaged_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The trainable replicated parameters of ``module``, whose gradients the data-parallel ranks average."""
    return [param for param in replicated_parameters(module) if param.requires_grad]


def _row_weights(share: torch.Tensor, owner: nn.Parameter, param: nn.Parameter) -> torch.Tensor:
    """``share`` (one weight per local row of ``owner``) broadcast over ``param``: ``owner`` itself, or a
    data-parallel shard holding its flattened elements from ``param.shard_start`` on."""
    local = local_tensor(owner)
    if param is owner:
        return share.to(local.device, local.dtype).view(-1, *[1] * (local.ndim - 1))
    row_numel = local[0].numel()
    rows = torch.arange(param.shard_start, param.shard_start + param.numel(), device=share.device) // row_numel
    return share[rows].to(param.device, param.dtype)


_DATA_PARALLEL_DIMENSIONS = ("dp", "dp_replicate", "dp_shard")
"""Mesh dimensions over data-parallel ranks (:mod:`.fully_sharded` shards over ``dp`` or, hybrid, ``dp_shard``)."""


def _spread(param: torch.Tensor) -> tuple[bool, Optional[dist.ProcessGroup]]:
    """Whether ``param`` is split over a model-parallel dimension (its squares count on every such rank; a copy
    counts once), and the data-parallel group FSDP2 splits it over (its squares are summed over it), if any."""
    if not isinstance(param, DTensor):
        return False, None
    model_split, fsdp_group = False, None
    for index, (name, placement) in enumerate(zip(param.device_mesh.mesh_dim_names or (), param.placements)):
        if placement.is_replicate():
            continue
        if name not in _DATA_PARALLEL_DIMENSIONS:
            model_split = True
        elif name != "dp_replicate":
            fsdp_group = param.device_mesh.get_group(index)
    return model_split, fsdp_group


def clip_by_value(optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
    """Clamp each of ``optimizer``'s gradients to ``[-clip_val, clip_val]``, element by element: a tensor-parallel
    shard's local elements (no collective: the clamp is elementwise), which torch's ``clip_grad_value_`` cannot
    clamp in one call with plain tensors."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                local_tensor(param.grad).clamp_(-clip_val, clip_val)


def clip_by_total_norm(optimizer: torch.optim.Optimizer, clip_val: Union[int, float], tied: list[TiedParameter],
                       groups: LayoutGroups, device: torch.device,
                       sharded: Optional[ShardedGradients] = None,
                       row_shares: Optional[dict[int, torch.Tensor]] = None) -> float:
    """Clip by the norm over every stage and shard (:func:`total_norm`); return that norm."""
    norm = total_norm(optimizer, tied, groups, device, sharded, row_shares)
    coefficient = clip_coefficient(clip_val, norm)
    if coefficient < 1.0:
        scale_gradients([local_tensor(param.grad) for group in optimizer.param_groups for param in group["params"]
                         if param.grad is not None], coefficient)
    return norm


def total_norm(optimizer: torch.optim.Optimizer, tied: list[TiedParameter], groups: LayoutGroups,
               device: torch.device, sharded: Optional[ShardedGradients] = None,
               row_shares: Optional[dict[int, torch.Tensor]] = None) -> float:
    """The 2-norm of ``optimizer``'s gradients over every stage and shard, counting replicated tensors once
    (a collective: every rank of the layout calls it).

    The squares are summed in float64 over the pipeline and tensor-parallel groups.
    Expert-parallel weights (``allreduce=False``, DeepSpeed's convention) differ between the
    ranks of their expert-parallel group, so their squares are summed over that group first, and
    so are those of the parameters ``sharded`` splits over a group of data-parallel ranks; every
    other tensor is the same on all data-parallel replicas, except parameters FSDP2 shards over the
    data-parallel ranks (``"full"``), whose squares are summed over that group. ``row_shares`` maps a split
    parameter whose rows several tensor-parallel ranks hold (key/value heads shared by more
    query heads than there are ranks) to 1 / copies per local row, so each row counts once.
    """
    sharded = sharded if sharded is not None else ShardedGradients()
    row_shares = row_shares or {}
    duplicated = {id(param) for _, param, is_first in tied if not is_first}
    tensor_rank = groups.tensor_rank
    counted: list[torch.Tensor] = []
    expert_grads: dict[str, list[torch.Tensor]] = {}
    sharded_grads: dict[int, list[torch.Tensor]] = {}
    fsdp_grads: dict[str, tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            grad = local_tensor(param.grad)
            owner = getattr(param, "sharded_from", param)  # a data-parallel shard counts as the parameter it slices
            model_split, fsdp_group = _spread(owner)
            if id(owner) in duplicated or (not model_split and tensor_rank != 0):
                continue
            if id(owner) in row_shares:
                grad = grad * _row_weights(row_shares[id(owner)], owner, param).sqrt()
            shard_group = sharded.group_index(param)
            if shard_group is not None:
                sharded_grads.setdefault(shard_group, []).append(grad)
            elif getattr(param, "allreduce", True) is False:
                expert_grads.setdefault(getattr(param, "group_name", None), []).append(grad)
            elif fsdp_group is not None:
                fsdp_grads.setdefault(fsdp_group.group_name, (fsdp_group, []))[1].append(grad)
            else:
                counted.append(grad)
    squares = squared_norm(counted, device) + sharded.squares(sharded_grads, device)
    for name in sorted(fsdp_grads):
        fsdp_group, shard_grads = fsdp_grads[name]
        shard_squares = squared_norm(shard_grads, device)
        dist.all_reduce(shard_squares, group=fsdp_group)
        squares += shard_squares
    for name in sorted(expert_grads, key=str):
        expert_squares = squared_norm(expert_grads[name], device)
        dist.all_reduce(expert_squares, group=_expert_parallel_group(name))
        squares += expert_squares
    layout = groups.layout
    if layout.pipeline_parallel > 1:
        dist.all_reduce(squares, group=groups.pipeline_group)
    if layout.tensor_parallel > 1:
        dist.all_reduce(squares, group=groups.tensor_group)
    return math.sqrt(squares.item())
