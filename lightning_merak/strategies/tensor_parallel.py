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
local shards and issue their collectives through :func:`~lightning_merak.runtime.collectives.all_reduce_in_turn`,
which lets sub-batches overlap them (``tp_overlap``) and never repeats one on recomputation.
A column group's layers share one input all-reduce in backward (q, k and v sum their
input gradients first), which runs while the group's weight gradients are computed
(:mod:`~lightning_merak.runtime.weight_gradients`). With sequence parallelism
(:mod:`~lightning_merak.strategies.sequence_parallel`) the row layers reduce-scatter over the
sequence instead and the column groups' inputs arrive all-gathered.

Dropout between a column layer and its row partner (with sequence parallelism: anywhere in
the block) draws each rank's own mask (:mod:`~lightning_merak.runtime.rank_streams`).

GPT-2's ``Conv1D`` layers are swapped for equivalent ``nn.Linear`` layers first; a
fused q/k/v projection has its output features regrouped so each rank's shard holds its
own q, k and v heads, and the attention's ``split_size`` is divided accordingly.
"""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lightning_merak.runtime.collectives import all_reduce_in_turn, start_all_reduce_in_turn, unrecorded_communication
from lightning_merak.runtime.rank_streams import enter_rank_stream, leave_rank_stream
from lightning_merak.runtime.weight_gradients import DeferredWeightGradients, linear_deferring_weight_gradient
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
    "region_partial_parameters",
    "verify_tensor_parallel_plan",
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
    in_region: list[str] = field(default_factory=list)
    """Other modules with parameters that run between a column group and its row partner (a per-head
    q/k norm): they see only this rank's heads, so their gradients are partial sums over the ranks."""


def _is_fused_qkv(block: nn.Module, name: str) -> bool:
    """A lone column layer of an attention module producing three hidden-sized outputs."""
    in_features, out_features = _features(block.get_submodule(name))
    owner = name.rpartition(".")[0]
    attention = block.get_submodule(owner) if owner else block
    return out_features == 3 * in_features and any(hasattr(attention, a) for a in _HEAD_COUNT_ATTRIBUTES)


def find_tensor_parallel_plan(block: nn.Module, run_block: Callable[[], Any], hidden_size: int) -> TensorParallelPlan:
    """Record ``run_block()`` (one forward of ``block``) and pair its linear layers.

    Modules with parameters that start between a column group's first layer and its row
    partner are listed in ``in_region``; one that also runs outside such a span is refused,
    since its gradient would be partly a per-rank share and partly whole.
    """
    # Each call keeps its input alive until pairing ends: a freed input's address can be reused by a
    # later layer's input (OPT's fc2 reads the activation where fc1's input lay), and two layers reading
    # one tensor are told apart from two reading different tensors only by their addresses.
    calls: list[tuple[str, torch.Tensor]] = []
    starts: list[str] = []
    handles = []
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear) or _is_conv1d(module):
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, name=name: calls.append((name, args[0]))
            ))
        if name and next(module.parameters(recurse=False), None) is not None:
            handles.append(module.register_forward_pre_hook(lambda mod, args, name=name: starts.append(name)))
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
    for name, inputs in calls:
        input_ptr = inputs.data_ptr()
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
    return TensorParallelPlan(column=column, row=row, fused_qkv=fused, column_groups=groups,
                              in_region=_modules_in_regions(starts, groups, row))


def _modules_in_regions(starts: list[str], groups: list[list[str]], rows: list[str]) -> list[str]:
    """Modules (not split layers) whose calls in ``starts`` fall inside a column → row span."""
    split = {name for group in groups for name in group} | set(rows)
    inside: list[str] = []
    outside: set[str] = set()
    spans = []
    for group, row in zip(groups, rows):
        first = min(starts.index(name) for name in group)
        spans.append((first, first + starts[first:].index(row)))
    for position, name in enumerate(starts):
        if name in split:
            continue
        if any(first < position < end for first, end in spans):
            if name not in inside:
                inside.append(name)
        else:
            outside.add(name)
    mixed = [name for name in inside if name in outside]
    if mixed:
        raise ValueError(
            f"{', '.join(mixed)} run both inside and outside the span from a column layer to its row partner, so "
            "tensor parallelism cannot tell whether their gradients are per-rank shares; use tensor_parallel=1"
        )
    return inside


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


class _ColumnGroupEntry(torch.autograd.Function):
    """Identity forward on a column group's input; its parameters are the group's local weights.

    Backward launches the all-reduce of the input gradient (partial on each rank), computes the
    group's deferred weight gradients meanwhile, then waits.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup, deferred: DeferredWeightGradients,
                *weights: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.deferred = group, deferred
        ctx.set_materialize_grads(False)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        pending = (start_all_reduce_in_turn(grad.contiguous().clone(), ctx.group)
                   if grad is not None and ctx.needs_input_grad[0] else None)
        weight_grads = ctx.deferred.weight_gradients()
        return (pending.wait() if pending is not None else None, None, None, *weight_grads)


class ColumnGroupInput:
    """The input of a column group, entered into the tensor-parallel region once for all its layers.

    Held from the group's first column layer until its row layer runs (per thread, so
    sub-batches keep their own). With ``overlap_weight_gradients`` the entry also takes the
    group's weights, and computes their gradients while the input gradient is all-reduced.
    """

    def __init__(self, group: dist.ProcessGroup, overlap_weight_gradients: bool = True) -> None:
        self.group = group
        self.overlap_weight_gradients = overlap_weight_gradients
        self._layers: list[ColumnParallelLinear] = []
        self._last = threading.local()

    def add_layer(self, layer: "ColumnParallelLinear") -> int:
        """Register a column layer of the group; returns its index among the group's weights."""
        self._layers.append(layer)
        return len(self._layers) - 1

    def enter(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Optional[DeferredWeightGradients]]:
        """``tensor`` in the tensor-parallel region, and where the group's layers leave their weight gradients."""
        source: Optional[weakref.ref] = getattr(self._last, "source", None)
        if source is not None and source() is tensor:
            return self._last.entered, self._last.deferred
        if self.overlap_weight_gradients:
            weights = [layer.weight.to_local() for layer in self._layers]
            deferred = DeferredWeightGradients(weights, tensor.requires_grad)
            entered = _ColumnGroupEntry.apply(tensor, self.group, deferred, *weights)
        else:
            deferred, entered = None, _CopyToTensorParallel.apply(tensor, self.group)
        self._last.source, self._last.entered, self._last.deferred = weakref.ref(tensor), entered, deferred
        return entered, deferred

    def release(self) -> None:
        self._last.source = self._last.entered = self._last.deferred = None


def _sharded_parameter(parameter: nn.Parameter, mesh: DeviceMesh, placement: Any) -> nn.Parameter:
    """``parameter`` as a DTensor over ``mesh``; a frozen one stays frozen."""
    return nn.Parameter(distribute_tensor(parameter.detach(), mesh, [placement]),
                        requires_grad=parameter.requires_grad)


class ColumnParallelLinear(nn.Module):
    """A linear layer holding its output features' shard; output stays split over the group.

    ``group_input`` enters the input into the tensor-parallel region; without one (sequence
    parallelism) the input arrives gathered, its gradient reduce-scattered by the gather, and
    only this rank's slice of it is kept for the weight gradient (gathered again in backward).
    """

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, group_input: Optional[ColumnGroupInput]) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _sharded_parameter(linear.weight, mesh, Shard(0))
        self.bias = (_sharded_parameter(linear.bias, mesh, Shard(0))
                     if linear.bias is not None else None)
        self.group_input = group_input
        self._index = group_input.add_layer(self) if group_input is not None else -1

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to_local() if self.bias is not None else None
        if self.group_input is None:
            return linear_on_gathered(tensor, self.weight.to_local(), bias, layer=self)
        entered, deferred = self.group_input.enter(tensor)
        if deferred is None:
            return F.linear(entered, self.weight.to_local(), bias)
        return linear_deferring_weight_gradient(entered, self.weight.to_local(), bias, deferred, self._index)


class RowParallelLinear(nn.Module):
    """A linear layer holding its input features' shard; partial outputs are summed over the group.

    With ``sequence_parallel`` the sum is reduce-scattered: each rank keeps its slice of the sequence.
    """

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, partner_input: Optional[ColumnGroupInput] = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _sharded_parameter(linear.weight, mesh, Shard(1))
        self.bias = (_sharded_parameter(linear.bias, mesh, Replicate())
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


def _install_rank_streams(block: nn.Module, column_groups: list[list[str]], rows: list[str], rank: int,
                         whole_block: bool) -> None:
    """Fork ``rank``'s stream from each column group's first layer to its row partner, or over ``block``.

    ``whole_block`` is for sequence parallelism, where everything inside the block is this
    rank's own. Only training forwards fork (evaluation draws nothing).
    """
    if whole_block:
        key = object()
        block.register_forward_pre_hook(lambda module, args: enter_rank_stream(key, rank) if module.training else None)
        block.register_forward_hook(lambda module, args, output: leave_rank_stream(key), prepend=True)
        return
    for members, row in zip(column_groups, rows, strict=True):
        key = object()

        def enter(module: nn.Module, args: Any, key: object = key) -> None:
            if module.training:
                enter_rank_stream(key, rank)

        for name in members:
            block.get_submodule(name).register_forward_pre_hook(enter)
        block.get_submodule(row).register_forward_pre_hook(lambda module, args, key=key: leave_rank_stream(key))


def apply_tensor_parallel(block: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh,
                          sequence_parallel: Optional[SequenceParallelPlan] = None,
                          overlap_weight_gradients: bool = True) -> dict[str, LayoutChange]:
    """Shard ``block`` in place over the 1-D ``mesh`` following ``plan``.

    With a ``sequence_parallel`` plan the block runs on sequence slices between its split
    layers (:mod:`~lightning_merak.strategies.sequence_parallel`); the caller splits the
    sequence before the first such block and gathers it after the last. With
    ``overlap_weight_gradients`` each column group computes its weight gradients while its
    input gradient's collective is in flight (:mod:`~lightning_merak.runtime.weight_gradients`).

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
        group_input = (ColumnGroupInput(group, overlap_weight_gradients) if sequence_parallel is None else None)
        for name in members:
            block.set_submodule(name, ColumnParallelLinear(block.get_submodule(name), mesh, group_input))
        if group_input is not None:
            partners[row] = group_input
    for name in plan.row:
        block.set_submodule(name, RowParallelLinear(block.get_submodule(name), mesh, partners.get(name),
                                                    sequence_parallel=sequence_parallel is not None))
    _scale_attention_attributes(block, plan.column, tensor_parallel)
    if sequence_parallel is not None:
        column_layers = ([[block.get_submodule(name) for name in members] for members in plan.column_groups]
                         if overlap_weight_gradients else None)
        install_sequence_gathers(block, sequence_parallel, group, column_layers)
    _install_rank_streams(block, plan.column_groups, plan.row, mesh.get_local_rank(),
                         whole_block=sequence_parallel is not None)
    return changes


def region_partial_parameters(block: nn.Module, plan: TensorParallelPlan) -> list[nn.Parameter]:
    """Trainable parameters of ``plan.in_region`` modules: the strategy sums their gradients over the group."""
    return [param for name in plan.in_region for param in block.get_submodule(name).parameters(recurse=False)
            if param.requires_grad]


_FIT_HINT = ("use tensor_parallel=1 for this model. Blocks split automatically need heads that stay independent "
             "between a column layer and its row partner (no norm over the whole projection, no per-head "
             "parameter outside the split layers) and fused q/k/v projections laid out as [q | k | v]")


def verify_tensor_parallel_plan(block: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh,
                                run_block: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                                hidden: torch.Tensor) -> None:
    """Split a copy of ``block`` over ``mesh`` and check it computes what the whole block does.

    One forward and backward (dropout off) of both copies on ``hidden``: the output, the
    input gradient and every parameter gradient (shards gathered, in-region parameters
    summed over the group) must agree, or a ValueError names what differs and the fix.
    Every rank of ``mesh`` must call this together, with the same ``hidden``. Its collectives
    are left out of :func:`~lightning_merak.runtime.collectives.record_communication`.
    """
    with unrecorded_communication():
        _verify_split(block, plan, mesh, run_block, hidden)


def _verify_split(block: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh,
                  run_block: Callable[[nn.Module, torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> None:
    whole, split = copy.deepcopy(block).eval(), copy.deepcopy(block).eval()
    changes = apply_tensor_parallel(split, plan, mesh)
    direction = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0)).to(hidden)
    results = []
    for module in (whole, split):
        inputs = hidden.detach().clone().requires_grad_(True)
        try:
            output = run_block(module, inputs)
            output.backward(direction)
        except RuntimeError as error:
            raise ValueError(f"{type(block).__name__} does not run split over {mesh.size()} ranks "
                             f"({str(error).splitlines()[0]}); {_FIT_HINT}") from error
        results.append((output.detach(), inputs.grad))
    group = mesh.get_group()
    for param in region_partial_parameters(split, plan):
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
    expected = {"output": results[0][0], "input gradient": results[0][1]}
    actual = {"output": results[1][0], "input gradient": results[1][1]}
    for name, param in whole.named_parameters():
        if param.grad is not None:
            expected[f"{name} gradient"] = param.grad
    for name, param in split.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        actual[f"{name} gradient"] = changes[name].to_original(grad) if name in changes else grad
    tolerance = 1e-3 if hidden.dtype == torch.float32 else 5e-2
    largest = max(float(t.float().norm()) for t in expected.values())
    wrong = []
    for name, reference in expected.items():
        value = actual.get(name)
        if value is None or value.shape != reference.shape:
            wrong.append(f"{name} (missing)")
            continue
        error, size = float((value.float() - reference.float()).norm()), float(reference.float().norm())
        if error > tolerance * max(size, 1e-3 * largest):
            wrong.append(f"{name} (relative error {error / max(size, 1e-30):.1e})")
    if wrong:
        raise ValueError(f"{type(block).__name__} split over {mesh.size()} ranks does not compute what the whole "
                         f"block does: {', '.join(wrong[:6])}{' …' if len(wrong) > 6 else ''}; {_FIT_HINT}")
