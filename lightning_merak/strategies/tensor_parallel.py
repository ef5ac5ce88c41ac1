"""Automatic Megatron-style tensor parallelism for unmodified transformer blocks.

One recorded forward pass of a block finds its column/row pairs by data flow:
linear layers that read the same input tensor form a *column group* (attention
q/k/v, MLP gate/up, GPT-2's fused ``c_attn`` or ``c_fc``); the next linear that reads
something else and maps back to the hidden size is the group's *row partner*
(attention output, MLP down). Column layers are split by output features, row layers
by input features, so each block needs one all-reduce in attention and one in the MLP,
in forward (after the row layer) and in backward (of the column group's input gradient).

Parameters are DTensors (column weights and biases ``Shard(0)``, row weights ``Shard(1)``,
row biases ``Replicate``) so checkpoints reshard between layouts; the layers compute on the
local shards and issue their collectives through :func:`~lightning_merak.strategies.overlap.all_reduce_in_turn`,
which lets sub-batches overlap them (``tp_overlap``) and never repeats one on recomputation.
A column group's layers share one input all-reduce in backward (q, k and v sum their
input gradients first). With sequence parallelism
(:mod:`~lightning_merak.strategies.sequence_parallel`) the row layers reduce-scatter over the
sequence instead and the column groups' inputs arrive all-gathered.

Dropout between a column layer and its row partner (with sequence parallelism: anywhere in
the block) draws each rank's own mask (:mod:`~lightning_merak.strategies.rank_random`).

GPT-2's ``Conv1D`` layers are swapped for equivalent ``nn.Linear`` layers first; a
fused q/k/v projection has its output features regrouped so each rank's shard holds its
own q, k and v heads, and the attention's ``split_size`` is divided accordingly.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lightning_merak.strategies.overlap import all_reduce_in_turn
from lightning_merak.strategies.rank_random import install_rank_streams
from lightning_merak.strategies.sequence_parallel import (
    SequenceParallelPlan,
    install_sequence_gathers,
    linear_on_gathered,
    reduce_scatter_sequence,
)

__all__ = [
    "ColumnParallelLinear",
    "LayoutChange",
    "RowParallelLinear",
    "TensorParallelPlan",
    "apply_tensor_parallel",
    "check_tensor_parallel_degree",
    "find_tensor_parallel_plan",
]

_HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head")
_SPLIT_SIZE_ATTRIBUTES = ("split_size",)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _features(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]


@dataclass
class TensorParallelPlan:
    """Which layers of a block are split by output (column) or input (row) features.

    ``column_groups[i]`` are the column layers reading one input whose row partner is ``row[i]``.
    """

    column: list[str]
    row: list[str]
    fused_qkv: list[str]
    column_groups: list[list[str]]


def _is_fused_qkv(block: nn.Module, name: str) -> bool:
    """A lone column layer of an attention module producing three hidden-sized outputs."""
    in_features, out_features = _features(block.get_submodule(name))
    owner = name.rpartition(".")[0]
    attention = block.get_submodule(owner) if owner else block
    return out_features == 3 * in_features and any(hasattr(attention, a) for a in _HEAD_COUNT_ATTRIBUTES)


def find_tensor_parallel_plan(block: nn.Module, run_block: Callable[[], Any], hidden_size: int) -> TensorParallelPlan:
    """Record ``run_block()`` (one forward of ``block``) and pair its linear layers."""
    calls: list[tuple[str, int, torch.Tensor]] = []
    handles = []
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear) or _is_conv1d(module):
            handles.append(module.register_forward_hook(
                lambda mod, args, out, name=name: calls.append((name, args[0].data_ptr(), out))
            ))
    try:
        with torch.no_grad():
            run_block()
    finally:
        for handle in handles:
            handle.remove()
    column: list[str] = []
    row: list[str] = []
    fused: list[str] = []
    groups: list[list[str]] = []
    group: list[str] = []
    group_input: int | None = None
    for name, input_ptr, _ in calls:
        layer = block.get_submodule(name)
        in_features, out_features = _features(layer)
        if group and input_ptr == group_input:
            group.append(name)
        elif group and out_features == hidden_size:
            column.extend(group)
            groups.append(group)
            row.append(name)
            if len(group) == 1 and _is_fused_qkv(block, group[0]):
                fused.append(group[0])
            group, group_input = [], None
        elif in_features == hidden_size:
            group, group_input = [name], input_ptr
    return TensorParallelPlan(column=column, row=row, fused_qkv=fused, column_groups=groups)


def check_tensor_parallel_degree(config: Any, tensor_parallel: int) -> None:
    """Refuse a degree that does not divide the model's head counts or widths, naming the fix."""
    if tensor_parallel == 1 or config is None:
        return
    for attribute in ("num_attention_heads", "num_key_value_heads", "n_head", "intermediate_size", "hidden_size"):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and value % tensor_parallel:
            raise ValueError(
                f"tensor_parallel={tensor_parallel} does not divide {attribute}={value}; choose a "
                f"tensor_parallel that divides it"
            )


def _conv1d_to_linear(conv: nn.Module) -> nn.Linear:
    in_features, out_features = conv.weight.shape
    linear = nn.Linear(in_features, out_features, bias=conv.bias is not None,
                       device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        if conv.bias is not None:
            linear.bias.copy_(conv.bias)
    return linear


def fused_qkv_order(out_features: int, tensor_parallel: int) -> torch.Tensor:
    """Row order that puts rank r's slices of q, k and v next to each other."""
    third = out_features // 3
    shard = third // tensor_parallel
    return torch.cat([
        torch.arange(part * third + rank * shard, part * third + (rank + 1) * shard)
        for rank in range(tensor_parallel) for part in range(3)
    ])


def _regroup_fused(linear: nn.Linear, tensor_parallel: int) -> None:
    order = fused_qkv_order(linear.out_features, tensor_parallel)
    with torch.no_grad():
        linear.weight.copy_(linear.weight[order])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[order])


def _scale_attention_attributes(block: nn.Module, column_names: list[str], tensor_parallel: int) -> None:
    owners = {name.rpartition(".")[0] for name in column_names}
    for owner in owners:
        module = block.get_submodule(owner) if owner else block
        for attribute in _HEAD_COUNT_ATTRIBUTES + _SPLIT_SIZE_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, attribute, value // tensor_parallel)


@dataclass(frozen=True)
class LayoutChange:
    """How a parameter's full tensor differs from the original model's after sharding."""

    transposed: bool
    fused_qkv_parts: int

    def to_original(self, full: torch.Tensor) -> torch.Tensor:
        if self.fused_qkv_parts:
            full = full[torch.argsort(fused_qkv_order(full.shape[0], self.fused_qkv_parts))]
        return full.t() if self.transposed and full.ndim == 2 else full

    def from_original(self, full: torch.Tensor) -> torch.Tensor:
        full = full.t() if self.transposed and full.ndim == 2 else full
        return full[fused_qkv_order(full.shape[0], self.fused_qkv_parts)] if self.fused_qkv_parts else full


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the input gradient, partial on each rank, is all-reduced in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_in_turn(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce of the row layer's partial output in forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return all_reduce_in_turn(tensor.contiguous(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ColumnGroupInput:
    """The input of a column group, entered into the tensor-parallel region once for all its layers.

    Held from the group's first column layer until its row layer runs (per thread, so
    sub-batches keep their own).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._last = threading.local()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        source: Optional[weakref.ref] = getattr(self._last, "source", None)
        if source is not None and source() is tensor:
            return self._last.copied
        copied = _CopyToTensorParallel.apply(tensor, self.group)
        self._last.source, self._last.copied = weakref.ref(tensor), copied
        return copied

    def release(self) -> None:
        self._last.source = self._last.copied = None


class ColumnParallelLinear(nn.Module):
    """A linear layer holding its output features' shard; output stays split over the group.

    ``group_input`` enters the input into the tensor-parallel region; without one (sequence
    parallelism) the input arrives gathered, its gradient reduce-scattered by the gather, and
    only this rank's slice of it is kept for the weight gradient (gathered again in backward).
    """

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, group_input: Optional[ColumnGroupInput]) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)]))
        self.bias = (nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [Shard(0)]))
                     if linear.bias is not None else None)
        self.group_input = group_input

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to_local() if self.bias is not None else None
        if self.group_input is None:
            return linear_on_gathered(tensor, self.weight.to_local(), bias)
        return F.linear(self.group_input(tensor), self.weight.to_local(), bias)


class RowParallelLinear(nn.Module):
    """A linear layer holding its input features' shard; partial outputs are summed over the group.

    With ``sequence_parallel`` the sum is reduce-scattered: each rank keeps its slice of the sequence.
    """

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, partner_input: Optional[ColumnGroupInput] = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(1)]))
        self.bias = (nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [Replicate()]))
                     if linear.bias is not None else None)
        self.group = mesh.get_group()
        self.partner_input = partner_input
        self.sequence_parallel = sequence_parallel

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.partner_input is not None:
            self.partner_input.release()
        partial = F.linear(tensor, self.weight.to_local())
        output = (reduce_scatter_sequence(partial, self.group) if self.sequence_parallel
                  else _ReduceFromTensorParallel.apply(partial, self.group))
        return output + self.bias.to_local() if self.bias is not None else output


def apply_tensor_parallel(block: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh,
                          sequence_parallel: Optional[SequenceParallelPlan] = None) -> dict[str, LayoutChange]:
    """Shard ``block`` in place over the 1-D ``mesh`` following ``plan``.

    With a ``sequence_parallel`` plan the block runs on sequence slices between its split
    layers (:mod:`~lightning_merak.strategies.sequence_parallel`); the caller splits the
    sequence before the first such block and gathers it after the last.

    Returns, by parameter name within the block, the layout changes a checkpoint must
    undo to stay loadable into the unsharded model.
    """
    tensor_parallel = mesh.size()
    changes: dict[str, LayoutChange] = {}
    for name in plan.column + plan.row:
        layer = block.get_submodule(name)
        if _is_conv1d(layer) or name in plan.fused_qkv:
            change = LayoutChange(_is_conv1d(layer), tensor_parallel if name in plan.fused_qkv else 0)
            changes.update({f"{name}.{p}": change for p, _ in layer.named_parameters()})
        if _is_conv1d(layer):
            block.set_submodule(name, _conv1d_to_linear(layer))
    for name in plan.fused_qkv:
        _regroup_fused(block.get_submodule(name), tensor_parallel)
    group = mesh.get_group()
    partners: dict[str, ColumnGroupInput] = {}
    for members, row in zip(plan.column_groups, plan.row, strict=True):
        group_input = ColumnGroupInput(group) if sequence_parallel is None else None
        for name in members:
            block.set_submodule(name, ColumnParallelLinear(block.get_submodule(name), mesh, group_input))
        if group_input is not None:
            partners[row] = group_input
    for name in plan.row:
        block.set_submodule(name, RowParallelLinear(block.get_submodule(name), mesh, partners.get(name),
                                                    sequence_parallel=sequence_parallel is not None))
    _scale_attention_attributes(block, plan.column, tensor_parallel)
    if sequence_parallel is not None:
        install_sequence_gathers(block, sequence_parallel, group)
    install_rank_streams(block, plan.column_groups, plan.row, mesh.get_local_rank(),
                         whole_block=sequence_parallel is not None)
    return changes
