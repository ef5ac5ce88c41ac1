"""Sequence parallelism for the tensor-parallel blocks of the trunk (Megatron-style).

With tensor parallelism alone, everything between a block's split layers (norms, dropout,
residual adds) is computed and stored whole on every rank. Sequence parallelism splits that
part along the sequence: each rank keeps ``1/tp`` of the residual stream's tokens. The
all-reduce after each row layer becomes a reduce-scatter over the sequence (all-gather in
backward), and the input of each column group is all-gathered (reduce-scattered in backward).
The column layers keep only the slice of that input for their weight gradients and gather it
again in backward (:func:`linear_on_gathered`; recomputed blocks need no gather for that), so
activation memory between and at the split layers shrinks by ``tp``, as does the norm work; the
wire carries the all-reduce's bytes plus that one extra all-gather per column group. The
reduce-scatter of a column group's input gradient runs while the group's weight gradients are
computed (:mod:`~lightning_merak.distributed.weight_gradients`).

The gather is placed at the entry of the submodule that holds a column group and its row
layer (the attention or MLP module), not in the column layer: such modules read the sequence
length from their input (``hidden_states.shape[:-1]``) and must see the whole sequence. This
needs blocks whose attention and MLP submodules return the row layer's output unchanged
(pre-norm blocks such as GPT-2's and Llama's); :func:`find_sequence_parallel_plan` checks that
on one recorded forward and names what does not fit.

A rank's run of consecutive blocks enters the split at its first block (each rank keeps its
slice; the gradient is all-gathered in backward) and leaves it after its last (all-gather;
the gradient of the replicated rest of the model is sliced). Parameters outside the split
layers then see only their rank's tokens: :func:`sequence_partial_parameters` lists them so
the strategy sums their gradients over the tensor-parallel group.

Dropout anywhere in a sequence-split block draws this rank's own masks
(:mod:`~lightning_merak.distributed.rank_streams`), so the ranks' slices do not repeat one pattern.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as functional
from torch.distributed.tensor import DTensor, Shard

from lightning_merak.distributed.collectives import (
    PendingCollective,
    all_gather_in_turn,
    in_checkpointed_region,
    reduce_scatter_in_turn,
    start_all_gather_in_turn,
    start_reduce_scatter_in_turn,
)
from lightning_merak.distributed.weight_gradients import DeferredWeightGradients, linear_deferring_weight_gradient
from lightning_merak.util.module_mode import hooks_removed_after, modules_in_mode

__all__ = [
    "SEQUENCE_DIM",
    "SequenceParallelPlan",
    "check_sequence_length",
    "common_owner",
    "deferrable_weight",
    "find_sequence_parallel_plan",
    "gather_sequence",
    "install_sequence_gathers",
    "linear_on_gathered",
    "reduce_scatter_sequence",
    "sequence_partial_parameters",
    "split_sequence_between",
]

SEQUENCE_DIM = 1
"""Hidden states are ``[batch, sequence, hidden]``."""


def check_sequence_length(sequence_length: int, tensor_parallel: int) -> None:
    """Refuse a sequence that does not split evenly over the tensor-parallel ranks, naming the fix."""
    if sequence_length % tensor_parallel:
        raise ValueError(
            f"sequence_parallel splits the sequence over tensor_parallel={tensor_parallel} ranks, but the sequence "
            f"length {sequence_length} is not divisible by it; pad or cut sequences to a multiple of {tensor_parallel}"
        )


def _slice_of_rank(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    ranks = dist.get_world_size(group)
    check_sequence_length(tensor.shape[SEQUENCE_DIM], ranks)
    return tensor.chunk(ranks, dim=SEQUENCE_DIM)[dist.get_rank(group)]


class _GatherSequence(torch.autograd.Function):
    """All-gather over the sequence; the gradient, partial on each rank, is reduce-scattered.

    With ``deferred`` its inputs also include the column group's weights: backward launches the
    reduce-scatter, computes the weight gradients the group's layers left, then waits.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup,
                deferred: Optional[DeferredWeightGradients], *weights: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.deferred = group, deferred
        ctx.set_materialize_grads(deferred is None)
        return all_gather_in_turn(tensor, group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx: Any, grad: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        if ctx.deferred is None:
            return reduce_scatter_in_turn(grad.contiguous(), ctx.group, SEQUENCE_DIM), None, None
        pending = (start_reduce_scatter_in_turn(grad.contiguous(), ctx.group, SEQUENCE_DIM)
                   if grad is not None and ctx.needs_input_grad[0] else None)
        weight_grads = ctx.deferred.weight_gradients()
        return (pending.wait() if pending is not None else None, None, None, *weight_grads)


class _ReduceScatterSequence(torch.autograd.Function):
    """Sum of the ranks' partial outputs, each keeping its slice of the sequence; all-gather in backward.

    With the column group's ``regather``, backward also launches the gather of the group's
    input, which the column layers need a little later for their weight gradients.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup,
                regather: Optional["_Regather"]) -> torch.Tensor:
        ctx.group, ctx.regather = group, regather
        return reduce_scatter_in_turn(tensor.contiguous(), group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        gathered = all_gather_in_turn(grad.contiguous(), ctx.group, SEQUENCE_DIM)
        if ctx.regather is not None:
            ctx.regather.prefetch()
        return gathered, None, None


class _EnterSequenceSplit(torch.autograd.Function):
    """Keep this rank's slice of a replicated tensor; the slices' gradients are all-gathered.

    The slice is a copy, never a view of the input, which the first block may update in place as its own input.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _slice_of_rank(tensor, group).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_in_turn(grad.contiguous(), ctx.group, SEQUENCE_DIM), None


class _LeaveSequenceSplit(torch.autograd.Function):
    """All-gather the slices into the replicated tensor; its gradient (equal on every rank) is sliced."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather_in_turn(tensor.contiguous(), group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _slice_of_rank(grad, ctx.group).contiguous(), None


class _Regather:
    """Saved-tensor hooks that keep a gathered input as its slice and gather it again in backward.

    Every column layer reading the gathered tensor would keep it whole for its weight
    gradient; packing it as (shape, stride, offset) of the gathered storage keeps only this
    rank's slice, and it is gathered once for all of them in backward: launched by the partner
    row layer's backward (:meth:`prefetch`), so it travels while the attention or activation
    backward computes, and waited for by the first layer that needs it.
    """

    def __init__(self, shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.shard, self.group = shard.detach(), group
        self.storage = full.untyped_storage().data_ptr()
        self.pending = 0
        self.full: Optional[torch.Tensor] = None
        self._prefetched: Optional[PendingCollective] = None

    def prefetch(self) -> None:
        """Launch the gather ahead of the first unpack (from the row layer's backward), if anything was packed."""
        if self.pending > 0 and self.full is None and self._prefetched is None:
            self._prefetched = start_all_gather_in_turn(self.shard, self.group, SEQUENCE_DIM)

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.untyped_storage().data_ptr() != self.storage:
            return tensor
        self.pending += 1
        return tensor.shape, tensor.stride(), tensor.storage_offset()

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if self.full is None:
            prefetched, self._prefetched = self._prefetched, None
            self.full = (prefetched.wait() if prefetched is not None
                         else all_gather_in_turn(self.shard, self.group, SEQUENCE_DIM))
        view = self.full.as_strided(*packed)
        self.pending -= 1
        if self.pending == 0:
            self.full = None
        return view


def deferrable_weight(layer: nn.Module) -> torch.Tensor:
    """``layer``'s local weight for a deferred weight gradient: its shard (shared rows summed in backward), or an
    empty frozen tensor once the shard is quantised (no gradient to defer)."""
    if getattr(layer, "weight", None) is None:
        return torch.empty(0)
    return layer.local(layer.weight) if hasattr(layer, "local") else layer.weight.to_local()


_last_gather = threading.local()


def gather_sequence(tensor: torch.Tensor, group: dist.ProcessGroup, column_layers: Sequence[nn.Module] = ()
                    ) -> torch.Tensor:
    """The whole sequence from every rank's slice, for layers whose input gradient is partial.

    Layers applied through :func:`linear_on_gathered` keep only the slice for backward. Those of
    ``column_layers`` (modules with a DTensor ``weight``) leave their weight gradients to the
    gather's backward, which computes them while the input gradient is reduce-scattered.
    """
    if torch.compiler.is_compiling():  # one graph: the compiler saves, frees and schedules for itself
        return functional.all_gather_tensor_autograd(tensor, SEQUENCE_DIM, group)
    layers = list(column_layers)
    weights = [deferrable_weight(layer) for layer in layers]
    deferred = DeferredWeightGradients(weights, tensor.requires_grad) if layers else None
    full = _GatherSequence.apply(tensor, group, deferred, *weights)
    _last_gather.full, _last_gather.regather = weakref.ref(full), _Regather(tensor, full, group)
    _last_gather.deferred, _last_gather.layers = deferred, layers
    return full


def linear_on_gathered(tensor: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       layer: Optional[nn.Module] = None) -> torch.Tensor:
    """``F.linear`` that saves ``tensor``, when it is this thread's last gathered sequence, as its slice.

    When ``layer`` is one of that gather's ``column_layers`` its weight gradient is left to the
    gather's backward. Inside a checkpointed block nothing is saved to begin with:
    recomputation rebuilds the input from the gather's recorded result, with no collective.
    """
    if torch.compiler.is_compiling():
        return F.linear(tensor, weight, bias)
    last = getattr(_last_gather, "full", None)
    full = last() if last is not None else None
    gathered = full is not None and full.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    deferred = _last_gather.deferred if gathered else None
    index = (next((i for i, known in enumerate(_last_gather.layers) if known is layer), None)
             if deferred is not None else None)

    def linear() -> torch.Tensor:
        if index is None:
            return F.linear(tensor, weight, bias)
        return linear_deferring_weight_gradient(tensor, weight, bias, deferred, index)

    if not gathered or in_checkpointed_region():
        return linear()
    regather = _last_gather.regather
    with torch.autograd.graph.saved_tensors_hooks(regather.pack, regather.unpack):
        return linear()


def reduce_scatter_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's slice of the sum of the ranks' partial ``tensor`` (a row layer's output).

    Its backward starts gathering the input of this thread's last gathered column group, the
    row layer's partner, for that group's weight gradients.
    """
    if torch.compiler.is_compiling():
        return functional.reduce_scatter_tensor_autograd(tensor.contiguous(), "sum", SEQUENCE_DIM, group)
    return _ReduceScatterSequence.apply(tensor, group, getattr(_last_gather, "regather", None))


@dataclass
class SequenceParallelPlan:
    """Where a block's sequence is gathered: ``owners[i]`` holds column group i and its row layer.

    ``owner_inputs[i]`` are the owner's arguments holding the tensor the column group reads (positions in its
    call, or keywords): every one is replaced by the one gathered sequence, as an attention taking its input
    several times (CTRL's ``multi_head_attention(normed, normed, normed)`` as value, key and query) reads the
    sequence length from any of them.
    """

    owners: list[str]
    owner_inputs: list[tuple[Union[int, str], ...]]


def common_owner(names: list[str]) -> str:
    """The deepest module path holding every layer of ``names`` ("" for the block itself)."""
    parts = [name.split(".")[:-1] for name in names]
    owner: list[str] = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        owner.append(level[0])
    return ".".join(owner)


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _same(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape)


def find_sequence_parallel_plan(block: nn.Module, run_block: Callable[[], Any], column_groups: list[list[str]],
                                rows: list[str]) -> SequenceParallelPlan:
    """Record ``run_block()`` (one forward of the unsplit ``block``) and find where to gather the sequence.

    Raises ``ValueError`` naming the layer or module that does not fit sequence parallelism.
    """
    block_name = type(block).__name__
    owners = []
    for members, row in zip(column_groups, rows, strict=True):
        owner = common_owner(members + [row])
        if not owner:
            raise ValueError(
                f"sequence_parallel gathers the sequence at the entry of the submodule holding a column group and its "
                f"row layer, but {block_name} holds {members[0]} and {row} directly; use sequence_parallel=False"
            )
        owners.append(owner)
    if len(set(owners)) != len(owners):
        raise ValueError(f"sequence_parallel needs each column/row pair of {block_name} in its own submodule "
                         f"(attention, MLP); {owners} share one; use sequence_parallel=False")
    owner_calls: dict[str, list[tuple[tuple, dict, Any]]] = {owner: [] for owner in owners}
    layer_io: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for owner in owners:
        handles.append(block.get_submodule(owner).register_forward_hook(
            lambda module, args, kwargs, output, owner=owner: owner_calls[owner].append((args, kwargs, output)),
            with_kwargs=True))

    def record_layer(module: nn.Module, args: tuple, output: Any, name: str) -> None:
        layer_io.setdefault(name, (args[0], output))

    for name in [members[0] for members in column_groups] + rows:
        handles.append(block.get_submodule(name).register_forward_hook(
            functools.partial(record_layer, name=name)))
    with hooks_removed_after(handles), modules_in_mode(block, training=False), torch.no_grad():
        run_block()
    owner_inputs: list[tuple[Union[int, str], ...]] = []
    for owner, members, row in zip(owners, column_groups, rows):
        calls = owner_calls[owner]
        if len(calls) != 1:
            raise ValueError(f"{block_name}.{owner} ran {len(calls)} times in one forward; sequence_parallel needs "
                             "it to run once; use sequence_parallel=False")
        args, kwargs, output = calls[0]
        column_input = layer_io[members[0]][0]
        candidates: list[Union[int, str]] = [i for i, a in enumerate(args) if _same(a, column_input)]
        candidates += [key for key, value in kwargs.items() if _same(value, column_input)]
        if not candidates or column_input.ndim != 3:
            raise ValueError(
                f"sequence_parallel gathers the input of {block_name}.{owner}, but {members[0]} does not read a "
                f"[batch, sequence, hidden] argument of it unchanged; use sequence_parallel=False"
            )
        if not _same(_first_tensor(output), layer_io[row][1]):
            raise ValueError(
                f"sequence_parallel needs {block_name}.{owner} to return the output of its row layer {row} unchanged "
                f"(pre-norm blocks such as GPT-2's and Llama's); {type(block.get_submodule(owner)).__name__} changes "
                "it; use sequence_parallel=False"
            )
        owner_inputs.append(tuple(candidates))
    return SequenceParallelPlan(owners=owners, owner_inputs=owner_inputs)


def install_sequence_gathers(block: nn.Module, plan: SequenceParallelPlan, group: dist.ProcessGroup,
                             column_layers: Optional[list[list[nn.Module]]] = None) -> None:
    """Gather the sequence at the entry of each owner of a column group (hooks on ``block``'s submodules), once
    for all the owner's arguments holding the group's input.

    With ``column_layers`` (group i's layers at position i) each gather computes its group's
    weight gradients while it reduce-scatters the input gradient (:func:`gather_sequence`).
    """
    layers_of = column_layers if column_layers is not None else [[] for _ in plan.owners]
    for owner, positions, layers in zip(plan.owners, plan.owner_inputs, layers_of, strict=True):
        def gather(module: nn.Module, args: tuple, kwargs: dict, positions: tuple[Union[int, str], ...] = positions,
                   layers: list[nn.Module] = layers) -> tuple:
            first = positions[0]
            full = gather_sequence(args[first] if isinstance(first, int) else kwargs[first], group, layers)
            args = tuple(full if index in positions else value for index, value in enumerate(args))
            kwargs = {key: full if key in positions else value for key, value in kwargs.items()}
            return args, kwargs

        block.get_submodule(owner).register_forward_pre_hook(gather, with_kwargs=True)


def split_sequence_between(first: nn.Module, last: nn.Module, group: dist.ProcessGroup,
                           hidden_index: Optional[int]) -> None:
    """Run the blocks from ``first`` to ``last`` (consecutive, called in order) on sequence slices.

    ``first`` receives the hidden state as its first argument; ``last`` returns it (as
    ``output[hidden_index]`` when the output is a tuple). The gather is placed ahead of every
    other forward hook of ``last``, so they see the whole sequence.
    """

    def enter(module: nn.Module, args: tuple) -> tuple:
        return (_EnterSequenceSplit.apply(args[0], group), *args[1:])

    def leave(module: nn.Module, args: tuple, output: Any) -> Any:
        if hidden_index is None:
            return _LeaveSequenceSplit.apply(output, group)
        values = list(output)
        values[hidden_index] = _LeaveSequenceSplit.apply(values[hidden_index], group)
        return values if isinstance(output, list) else tuple(values)

    first.register_forward_pre_hook(enter)
    last.register_forward_hook(leave, prepend=True)


def sequence_partial_parameters(blocks: list[nn.Module]) -> list[nn.Parameter]:
    """Trainable parameters of sequence-split blocks not split by tensor parallelism.

    They see only their rank's tokens, so their gradients are partial: the strategy sums
    them over the tensor-parallel group.
    """
    partial = []
    for block in blocks:
        for param in block.parameters():
            sharded = isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements)
            if param.requires_grad and not sharded:
                partial.append(param)
    return partial
