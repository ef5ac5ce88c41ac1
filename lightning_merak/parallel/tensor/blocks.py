"""Automatic Megatron-style tensor parallelism for unmodified transformer blocks.

One recorded forward pass of a block finds its column/row pairs by data flow:
linear layers that read the same input tensor form a *column group* (attention
q/k/v, MLP gate/up, fused projections such as GPT-2's ``c_attn`` or Phi-3's ``qkv_proj``);
the next linear that reads something else and maps back to the hidden size is the group's
*row partner* (attention output, MLP down). Row layers are split by input features; a second
pass (:mod:`~lightning_merak.parallel.tensor.rows`) finds which output rows of each
column layer a rank's slice of those features reads, so fused and interleaved projections split
per part and key/value heads fewer than the degree are held by every rank that needs them. Each
block needs one all-reduce in attention and one in the MLP, in forward (after the row layer) and
in backward (of the column group's input gradient); the layers are in
:mod:`~lightning_merak.parallel.tensor.layers`. With sequence parallelism
(:mod:`~lightning_merak.parallel.tensor.sequence`) the row layers reduce-scatter over the
sequence instead and the column groups' inputs arrive all-gathered.

Per-head block arguments (BLOOM's and MPT's ALiBi biases, built outside the blocks) are sliced
to the rank's heads on entry. A norm over a whole projection (OLMo 2's q/k norms) makes every
rank read every row of it, so those rows stay whole on each rank (``docs/design/tensor-parallel.md``).

Dropout between a column layer and its row partner (with sequence parallelism: anywhere in
the block) draws each rank's own mask (:mod:`~lightning_merak.distributed.rank_streams`).

GPT-2's ``Conv1D`` layers are swapped for equivalent ``nn.Linear`` layers first, and the
attention modules' head counts and widths are set to the rank's share.

A PEFT LoRA layer is paired as one layer and split with its base, its ``A`` and ``B`` following the
split (:mod:`~lightning_merak.parallel.tensor.adapters`).
"""

from __future__ import annotations

import copy
import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_merak.distributed.collectives import all_reduce_in_turn, unrecorded_communication
from lightning_merak.distributed.dtensors import local_tensor
from lightning_merak.distributed.rank_streams import enter_rank_stream, leave_rank_stream
from lightning_merak.parallel.tensor.adapters import (
    adapter_partial_parameters,
    is_tuner_layer,
    linear_features,
    row_following_parameters,
    split_base,
    split_linear,
)
from lightning_merak.parallel.tensor.families import UNSPLIT_FAMILIES, check_tensor_parallel_degree
from lightning_merak.parallel.tensor.head_counts import head_count, scale_attention_attributes
from lightning_merak.parallel.tensor.layers import (
    ColumnGroupInput,
    ColumnParallelLinear,
    RowParallelLinear,
    WholeWidthRMSNorm,
    is_rms_norm,
)
from lightning_merak.parallel.tensor.rows import LayoutChange, probe_row_units, rank_rows, unit_count
from lightning_merak.parallel.tensor.sequence import SequenceParallelPlan, common_owner, install_sequence_gathers
from lightning_merak.util import random_state

__all__ = [
    "ColumnGroupInput",
    "ColumnParallelLinear",
    "LayoutChange",
    "RowParallelLinear",
    "TensorParallelPlan",
    "UNSPLIT_FAMILIES",
    "apply_tensor_parallel",
    "check_tensor_parallel_degree",
    "find_tensor_parallel_plan",
    "region_partial_parameters",
    "verify_tensor_parallel_plan",
]



def _is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' GPT-2 ``Conv1D`` (a linear layer whose weight is stored ``(in, out)``)."""
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")  # probed: a model holding one imported it
    return pytorch_utils is not None and isinstance(module, pytorch_utils.Conv1D)


def _features(module: nn.Module) -> tuple[int, int]:
    adapted = linear_features(module)
    if adapted is not None:
        return adapted
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
    column_groups: list[list[str]]
    in_region: list[str] = field(default_factory=list)
    """Other modules with parameters that run between a column group and its row partner (a per-head
    q/k norm): they see only this rank's heads, so their gradients are partial sums over the ranks."""
    units: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)
    """Per column layer, the output rows each equal slice of its row partner's input reads
    (:func:`~lightning_merak.parallel.tensor.rows.probe_row_units`); a degree takes consecutive slices."""
    whole_width_norms: dict[str, str] = field(default_factory=dict)
    """RMS norms over a whole column layer's output (OLMo 2's q/k norms), by name, with that layer: split
    with it, their statistic summed over the group (:class:`WholeWidthRMSNorm`)."""
    head_arguments: list[Union[int, str]] = field(default_factory=list)
    """Block arguments (positions or keyword names) laid out by attention head: ALiBi biases."""
    heads: Optional[int] = None
    draws_random: bool = True
    """Whether a training forward of the block draws random numbers (dropout): only then does each rank fork a
    stream of its own inside the split regions (a fork reads the generators, which torch.compile cannot trace)."""
    refusal: Optional[str] = None
    """Why the block does not split, found before probing its rows (a convolution between a column layer and its
    row partner): verifying or applying the plan raises it; the planner still times the unsplit block by it."""


def _per_head_arguments(args: tuple, kwargs: dict, heads: Optional[int]) -> list[Union[int, str]]:
    """Arguments laid out by head, sliced per rank: ALiBi biases ``(heads or batch·heads, 1, keys)``
    and relative position biases ``(batch, heads, queries, keys)``."""
    if not heads or heads == 1 or not args or not isinstance(args[0], torch.Tensor):
        return []
    batch = args[0].shape[0]
    found: list[Union[int, str]] = []
    for key, value in [*enumerate(args), *kwargs.items()]:
        if key == 0 or not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        if ((value.ndim == 3 and value.shape[1] == 1 and value.shape[0] in (heads, batch * heads))
                or (value.ndim == 4 and value.shape[1] == heads)):
            found.append(key)
    return found


def find_tensor_parallel_plan(block: nn.Module, run_block: Callable[[], Any], hidden_size: int) -> TensorParallelPlan:
    """Record ``run_block()`` (one forward of ``block``) and pair its linear layers.

    Modules with parameters that start between a column group's first layer and its row
    partner are listed in ``in_region``; one that also runs outside such a span is refused,
    since its gradient would be partly a per-rank share and partly whole. A second forward
    finds which rows of each column layer every slice of its row partner's input reads.
    """
    # Each call keeps its input alive until pairing ends: a freed input's address can be reused by a
    # later layer's input (OPT's fc2 reads the activation where fc1's input lay), and two layers reading
    # one tensor are told apart from two reading different tensors only by their addresses.
    calls: list[tuple[str, torch.Tensor]] = []
    starts: list[str] = []
    block_calls: list[tuple[tuple, dict]] = []
    handles = [block.register_forward_pre_hook(lambda mod, args, kwargs: block_calls.append((args, kwargs)),
                                               with_kwargs=True)]
    units = _linear_units(block)
    for name, module in block.named_modules():
        if any(name.startswith(unit + ".") for unit in units):
            continue  # inside a LoRA layer: the layer is the unit
        if name in units:
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, name=name: calls.append((name, args[0]))
            ))
        if name in units or (name and next(module.parameters(recurse=False), None) is not None):
            handles.append(module.register_forward_pre_hook(lambda mod, args, name=name: starts.append(name)))
    generators_before = random_state.capture()
    try:
        with torch.no_grad():
            run_block()
    finally:
        for handle in handles:
            handle.remove()
    draws_random = not random_state.same(generators_before, random_state.capture())
    column: list[str] = []
    row: list[str] = []
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
            group, group_input = [], None
        elif in_features == hidden_size:
            group, group_input = [name], input_ptr
    plan = TensorParallelPlan(column=column, row=row, column_groups=groups,
                              in_region=_modules_in_regions(starts, groups, row), draws_random=draws_random)
    if groups:
        plan.heads = head_count(block, [name.rpartition(".")[0] for name in column])
        plan.refusal = _convolution_problem(block, groups, row)
        if plan.refusal is None:
            _probe_rows(block, run_block, plan)
        if block_calls:
            plan.head_arguments = _per_head_arguments(*block_calls[0], plan.heads)
    return plan


def _probe_rows(block: nn.Module, run_block: Callable[[], Any], plan: TensorParallelPlan) -> None:
    """Fill in which rows of its column layers each slice of a row layer's input reads, and the whole-width norms."""
    units = [unit_count(_features(block.get_submodule(name))[0], plan.heads) for name in plan.row]
    column_widths = {_features(block.get_submodule(name))[1] for name in plan.column}
    row_widths = {_features(block.get_submodule(name))[0] for name in plan.row}
    whole = [name for name in plan.in_region if is_rms_norm(block.get_submodule(name))
             and block.get_submodule(name).weight.shape[0] in column_widths | row_widths]
    plan.units, fed_by = probe_row_units(block, run_block, plan.column_groups, plan.row, units, whole)
    # a whole-width norm no column layer feeds directly normalises a row layer's input (BitNet's sub-norms)
    plan.whole_width_norms = {name: fed_by.get(name, "") for name in whole
                              if name in fed_by or block.get_submodule(name).weight.shape[0] in row_widths}
    plan.in_region = [name for name in plan.in_region if name not in plan.whole_width_norms]


def _convolution_problem(block: nn.Module, groups: list[list[str]], rows: list[str]) -> Optional[str]:
    """Why a column group does not split when its module (the one holding it and its row partner) holds a
    convolution, or None: a state-space or short-convolution mixer, which convolves the projected channels (often
    through its weight, not by calling it) and would need them split with it. Its rows are not probed: one head
    slice at a time, that takes minutes where the mixer runs without its fused kernels."""
    for members, row in zip(groups, rows, strict=True):
        owner = common_owner([*members, row])
        mixer = block.get_submodule(owner) if owner else block
        convolutions = [".".join(filter(None, (owner, name))) for name, module in mixer.named_modules()
                        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))]
        if convolutions:
            return (f"{owner or type(block).__name__} holds a convolution ({', '.join(convolutions)}) over the "
                    f"channels projected by {', '.join(members)} for {row} (a state-space or short-convolution "
                    "mixer), which tensor parallelism does not split; use tensor_parallel=1 for this model")
    return None


def _linear_units(block: nn.Module) -> list[str]:
    """The layers a split pairs: ``nn.Linear`` and Conv1D layers, a LoRA layer with its base as one."""
    units: list[str] = []
    for name, module in block.named_modules():
        if any(name.startswith(unit + ".") for unit in units):
            continue
        if is_tuner_layer(module) or isinstance(module, nn.Linear) or _is_conv1d(module):
            units.append(name)
    return units


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


def _conv1d_to_linear(conv: nn.Module) -> nn.Linear:
    in_features, out_features = conv.weight.shape
    linear = nn.Linear(in_features, out_features, bias=conv.bias is not None,
                       device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        if conv.bias is not None:
            linear.bias.copy_(conv.bias)
    return linear


def _shard_per_head_parameters(block: nn.Module, column_names: list[str], heads: int, mesh: DeviceMesh) -> None:
    """Split parameters of the attention modules laid out by query head (attention sinks) by head.

    The parameter stays a DTensor for checkpoints; each forward the module reads its local shard
    (an instance attribute, found before the parameter, refreshed by a pre-hook so gradients reach it).
    """
    for owner in {name.rpartition(".")[0] for name in column_names}:
        module = block.get_submodule(owner) if owner else block
        names = [name for name, param in module.named_parameters(recurse=False)
                 if param.ndim >= 1 and param.shape[0] == heads and not isinstance(param.data, DTensor)]
        for name in names:
            param = getattr(module, name)
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]),
                                                         requires_grad=param.requires_grad))
        if names:
            module.register_forward_pre_hook(functools.partial(_read_local_shards, names=names))


def _read_local_shards(module: nn.Module, args: Any, names: list[str]) -> None:
    for name in names:
        module.__dict__[name] = module._parameters[name].to_local()


def _column_rows(plan: TensorParallelPlan, name: str, out_features: int,
                 tensor_parallel: int) -> Optional[list[list[int]]]:
    """The original rows each rank holds of column layer ``name``, or None for the contiguous split."""
    units = plan.units.get(name)
    if units is None:
        return None
    if len(units) % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} does not divide the {len(units)} heads or slices of "
                         f"{name}; choose a tensor_parallel that divides them")
    rows = [rank_rows(units, rank, tensor_parallel) for rank in range(tensor_parallel)]
    if len({len(part) for part in rows}) > 1 or not rows[0]:
        raise ValueError(f"{name} does not split into equal parts over {tensor_parallel} ranks; use tensor_parallel=1")
    flat = [row for part in rows for row in part]
    if len(set(flat)) < out_features:
        raise ValueError(f"{name} has outputs no rank's heads read; use tensor_parallel=1")
    return None if flat == list(range(out_features)) else rows


class _OwnHeads(torch.autograd.Function):
    """This rank's heads of a per-head tensor; in backward the ranks' head gradients are put together.

    A learned bias computed before the blocks (CPM-Ant's relative positions) then gets its whole gradient.
    """

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, heads: int, rank: int, tensor_parallel: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.shape, ctx.heads, ctx.rank, ctx.group = value.shape, heads, rank, group
        share = heads // tensor_parallel
        ctx.share = share
        if value.ndim == 4:
            return value[:, rank * share:(rank + 1) * share]
        return value.unflatten(0, (-1, heads))[:, rank * share:(rank + 1) * share].flatten(0, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        share, rank = ctx.share, ctx.rank
        if len(ctx.shape) == 4:
            full = grad.new_zeros(ctx.shape)
            full[:, rank * share:(rank + 1) * share] = grad
        else:
            full = grad.new_zeros(ctx.shape).unflatten(0, (-1, ctx.heads))
            full[:, rank * share:(rank + 1) * share] = grad.unflatten(0, (-1, share))
            full = full.flatten(0, 1)
        return all_reduce_in_turn(full, ctx.group), None, None, None, None


def _slice_head_arguments(block: nn.Module, arguments: list[Union[int, str]], heads: int, rank: int,
                          tensor_parallel: int, group: dist.ProcessGroup) -> None:
    """Hand ``block`` only this rank's heads of its per-head arguments (ALiBi and relative position biases)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        for key in arguments:
            holder = args if isinstance(key, int) else kwargs
            if (key in kwargs if isinstance(key, str) else key < len(args)) and holder[key] is not None:
                holder[key] = _OwnHeads.apply(holder[key], heads, rank, tensor_parallel, group)
        return tuple(args), kwargs

    block.register_forward_pre_hook(hook, with_kwargs=True)


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
    layers (:mod:`~lightning_merak.parallel.tensor.sequence`); the caller splits the
    sequence before the first such block and gathers it after the last. With
    ``overlap_weight_gradients`` each column group computes its weight gradients while its
    input gradient's collective is in flight (:mod:`~lightning_merak.distributed.weight_gradients`).

    Returns, by parameter name within the block, the layout changes a checkpoint must
    undo to stay loadable into the unsharded model.
    """
    if plan.refusal is not None:
        raise ValueError(plan.refusal)
    tensor_parallel = mesh.size()
    changes: dict[str, LayoutChange] = {}
    rows: dict[str, Optional[list[list[int]]]] = {}
    for name in plan.column + plan.row:
        layer = block.get_submodule(name)
        if name in plan.column:
            rows[name] = _column_rows(plan, name, _features(layer)[1], tensor_parallel)
        if _is_conv1d(layer) or rows.get(name) is not None:
            order = rows.get(name)
            change = LayoutChange(_is_conv1d(layer), tuple(row for part in order for row in part) if order else None)
            changes.update({f"{name}.{p}": change for p in row_following_parameters(layer)})
        if _is_conv1d(layer):
            block.set_submodule(name, _conv1d_to_linear(layer))
    group = mesh.get_group()
    partners: dict[str, ColumnGroupInput] = {}
    for members, row in zip(plan.column_groups, plan.row, strict=True):
        group_input = (ColumnGroupInput(group, overlap_weight_gradients) if sequence_parallel is None else None)
        for name in members:
            block.set_submodule(name, split_linear(block.get_submodule(name), mesh, column=True,
                                                   group_input=group_input, rows=rows[name]))
        if group_input is not None:
            partners[row] = group_input
    for name in plan.row:
        block.set_submodule(name, split_linear(block.get_submodule(name), mesh, column=False,
                                               group_input=partners.get(name),
                                               sequence_parallel=sequence_parallel is not None))
    for name, column in plan.whole_width_norms.items():
        order = rows[column] if column else None
        block.set_submodule(name, WholeWidthRMSNorm(block.get_submodule(name), mesh, order))
        if order is not None:
            changes[f"{name}.weight"] = LayoutChange(rows=tuple(row for part in order for row in part))
    if plan.heads:
        _shard_per_head_parameters(block, plan.column, plan.heads, mesh)
    scale_attention_attributes(block, plan.column, tensor_parallel)
    if plan.head_arguments and plan.heads:
        _slice_head_arguments(block, plan.head_arguments, plan.heads, mesh.get_local_rank(), tensor_parallel,
                              mesh.get_group())
    if sequence_parallel is not None:
        column_layers = ([[split_base(block.get_submodule(name)) for name in members]
                          for members in plan.column_groups] if overlap_weight_gradients else None)
        install_sequence_gathers(block, sequence_parallel, group, column_layers)
    if plan.draws_random:
        _install_rank_streams(block, plan.column_groups, plan.row, mesh.get_local_rank(),
                              whole_block=sequence_parallel is not None)
    return changes


def region_partial_parameters(block: nn.Module, plan: TensorParallelPlan) -> list[nn.Parameter]:
    """Trainable parameters of ``plan.in_region`` modules and the whole weights of split LoRA layers
    (:mod:`~lightning_merak.parallel.tensor.adapters`): the strategy sums their gradients over the group."""
    region = [param for name in plan.in_region for param in block.get_submodule(name).parameters(recurse=False)
              if param.requires_grad]
    return region + adapter_partial_parameters(block)


_FIT_HINT = ("use tensor_parallel=1 for this model. Blocks split automatically need each head's work to stay "
             "on the rank holding that head between a column layer and its row partner: a norm over a whole "
             "projection only as an RMS norm module, no parameter shared by all heads inside that span")


def verify_tensor_parallel_plan(block: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh,
                                run_block: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                                hidden: torch.Tensor) -> None:
    """Split a copy of ``block`` over ``mesh`` and check it computes what the whole block does.

    One forward and backward (dropout off) of both copies on ``hidden``: the output, the
    input gradient and every parameter gradient (shards gathered, in-region parameters
    summed over the group) must agree, or a ValueError names what differs and the fix.
    Every rank of ``mesh`` must call this together, with the same ``hidden``. Its collectives
    are left out of :func:`~lightning_merak.distributed.collectives.record_communication`.
    """
    if plan.refusal is not None:
        raise ValueError(f"{type(block).__name__} does not split: {plan.refusal}")
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
            dist.all_reduce(local_tensor(param.grad), group=group)
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
