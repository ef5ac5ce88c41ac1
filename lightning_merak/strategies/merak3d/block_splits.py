"""The tensor-parallel split of a trunk's blocks: one plan per block structure.

A trunk's blocks need not be alike: GLM-4.5, Ernie-4.5-MoE, DeepSeek-V3 and others start with dense blocks and go
on with MoE ones; Qwen3-MoE interleaves them (``decoder_sparse_step``, ``mlp_only_layers``). Each distinct structure
(the classes and parameter shapes of a block's modules) gets its own column/row pairing, found and checked on the
first block of that structure; every block is split by the plan of its structure.

A split block must also stay off torch's fused evaluation kernels (``nn.TransformerEncoderLayer``'s and
``nn.MultiheadAttention``'s fast path, taken in eval mode without gradients), which take the whole weights and
cannot take a split layer's DTensor shards: :func:`keep_off_fused_kernels` turns torch's switch off around the
split blocks' forwards only, so users' other models keep the fast path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_merak.parallel.pipeline.meta_trace import materialized_copy
from lightning_merak.parallel.pipeline.trace import ModelTrace
from lightning_merak.parallel.tensor.blocks import (
    TensorParallelPlan,
    find_tensor_parallel_plan,
    verify_tensor_parallel_plan,
)
from lightning_merak.parallel.tensor.quantized_shards import quantized_split_problem
from lightning_merak.parallel.tensor.sequence import SequenceParallelPlan, find_sequence_parallel_plan

__all__ = ["BlockSplits", "block_structures", "keep_off_fused_kernels", "plan_block_splits", "sequence_parallel_plan",
           "split_block_problem", "tensor_parallel_plan", "unsplittable_structure"]

Broadcast = Callable[[Any, int], Any]


def tensor_parallel_plan(block: nn.Module, trace: ModelTrace) -> TensorParallelPlan:
    """Pair the linear layers of one block, run on the trace's sample hidden state; refuse a block with no pair, or
    with a layer that reads a column group's input but feeds its row partner nothing (:func:`_unread_column_layer`)."""
    args, kwargs = trace.block_arguments(trace.sample_side_tensors)
    hidden = trace.sample_hidden
    plan = find_tensor_parallel_plan(block, lambda: block(hidden, *args, **kwargs), hidden.shape[-1])
    if not plan.column or not plan.row:
        raise ValueError(
            f"found no column/row linear pairs in {type(block).__name__}; tensor_parallel needs "
            "blocks built from nn.Linear (or transformers Conv1D) layers"
        )
    problem = _unread_column_layer(plan)
    if problem is not None:
        raise ValueError(problem)
    return plan


def _unread_column_layer(plan: TensorParallelPlan) -> Optional[str]:
    """Why a column group holds a layer none of whose outputs reach its row partner's input (the first), or None.

    Such a layer reads the group's input for something else: an MoE router (AfMoE's ``router.gate``, beside the
    shared experts' projections) whose scores pick the experts. Its outputs are needed whole on every rank, so no
    rank's share of the row partner's heads or features tells which of its rows that rank holds.
    """
    for members, row in zip(plan.column_groups, plan.row, strict=True):
        unread = next((name for name in members if name in plan.units and not any(plan.units[name])), None)
        if unread is not None:
            return (f"{unread} reads the input of the column layers that feed {row} but none of its outputs reach "
                    f"{row}: it needs them all on every rank (an MoE router choosing experts), so it cannot be split "
                    "by heads or features with them; use tensor_parallel=1 for this model")
    return None


def sequence_parallel_plan(block: nn.Module, trace: ModelTrace, plan: TensorParallelPlan) -> SequenceParallelPlan:
    """Where each block gathers the sequence, found on the unsplit ``block``."""
    args, kwargs = trace.block_arguments(trace.sample_side_tensors)
    return find_sequence_parallel_plan(block, lambda: block(trace.sample_hidden, *args, **kwargs),
                                       plan.column_groups, plan.row)


def split_block_problem(block: nn.Module, trace: ModelTrace, plan: TensorParallelPlan, mesh: DeviceMesh,
                        broadcast: Broadcast) -> Optional[str]:
    """Why ``block`` split by ``plan`` over ``mesh`` would not compute the whole block,
    or None (rank 0's verdict).
    """
    args, kwargs = trace.block_arguments(trace.sample_side_tensors)
    try:
        verify_tensor_parallel_plan(block, plan, mesh, lambda module, hidden: trace.hidden_of(
            module(hidden, *args, **kwargs)), trace.sample_hidden)
        problem = None
    except ValueError as error:
        problem = str(error)
    return broadcast(problem, 0)


def _structure(block: nn.Module) -> tuple[Any, ...]:
    """What a tensor-parallel plan depends on: each module's name and class, each parameter's name and shape."""
    return (tuple((name, type(module).__qualname__) for name, module in block.named_modules()),
            tuple((name, tuple(param.shape)) for name, param in block.named_parameters()))


def block_structures(trunk: nn.ModuleList) -> dict[int, int]:
    """Each block's index → the index of the first block of its structure (the one its plan is found on)."""
    first: dict[tuple[Any, ...], int] = {}
    return {index: first.setdefault(_structure(block), index) for index, block in enumerate(trunk)}


def _probe(trunk: nn.ModuleList, trunk_path: str, index: int,
           materialize_with: Optional[Callable[[nn.Module], Any]]) -> nn.Module:
    """Block ``index`` to plan on: itself, or a materialised copy of it when the model is on meta."""
    if materialize_with is None:
        return trunk[index]
    return materialized_copy(trunk[index], f"{trunk_path}.{index}", materialize_with)


def _named(index: int, kinds: int, problem: str) -> str:
    """``problem``, naming the block it was found on where the trunk has blocks of several structures."""
    return problem if kinds == 1 else f"block {index} (the first of its structure): {problem}"


def unsplittable_structure(trunk: nn.ModuleList, trunk_path: str, trace: ModelTrace, mesh: DeviceMesh,
                           broadcast: Broadcast, materialize_with: Optional[Callable[[nn.Module], Any]] = None,
                           ) -> Optional[str]:
    """Why some block structure of ``trunk`` does not split over ``mesh`` as the whole block computes, or None."""
    kinds = sorted(set(block_structures(trunk).values()))
    for index in kinds:
        probe = _probe(trunk, trunk_path, index, materialize_with)
        try:
            problem = split_block_problem(probe, trace, tensor_parallel_plan(probe, trace), mesh, broadcast)
        except ValueError as error:
            problem = str(error)
        if problem is not None:
            return _named(index, len(kinds), problem)
    return None


@dataclass(frozen=True)
class BlockSplits:
    """The tensor-parallel plan (and sequence-parallel plan) of each block structure of a trunk."""

    structure_of: dict[int, int]
    plans: dict[int, TensorParallelPlan]
    sequence_plans: Optional[dict[int, SequenceParallelPlan]]

    def plan(self, index: int) -> TensorParallelPlan:
        """The plan block ``index`` is split by."""
        return self.plans[self.structure_of[index]]

    def sequence_plan(self, index: int) -> Optional[SequenceParallelPlan]:
        """Where block ``index`` gathers the sequence (None without sequence parallelism)."""
        return None if self.sequence_plans is None else self.sequence_plans[self.structure_of[index]]


_FUSED_MODULES = (nn.MultiheadAttention, nn.TransformerEncoderLayer)
"""torch modules with a fused fast path in eval mode (``torch.backends.mha``)."""

_fast_path_lock = threading.Lock()
_fast_path_state = {"running": 0, "before": True}
"""How many split blocks run an evaluation forward now (sub-batches run them in threads), and the switch before."""


def _fast_path_off(module: nn.Module, args: Any) -> None:
    if module.training:  # torch takes the fast path in eval mode only
        return
    with _fast_path_lock:
        if _fast_path_state["running"] == 0:
            _fast_path_state["before"] = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        _fast_path_state["running"] += 1


def _fast_path_back(module: nn.Module, args: Any, output: Any) -> None:
    if module.training:
        return
    with _fast_path_lock:
        _fast_path_state["running"] -= 1
        if _fast_path_state["running"] == 0:
            torch.backends.mha.set_fastpath_enabled(bool(_fast_path_state["before"]))


def keep_off_fused_kernels(trunk: nn.ModuleList) -> None:
    """Run every block of ``trunk`` holding a torch module with a fused fast path without it (torch's switch off
    during the block's forward, put back after it, also when it raises): the fused kernels read the whole weights
    where the split layers hold DTensor shards."""
    for block in trunk:
        if any(isinstance(module, _FUSED_MODULES) for module in block.modules()):
            block.register_forward_pre_hook(_fast_path_off)
            block.register_forward_hook(_fast_path_back, always_call=True)


def plan_block_splits(model: nn.Module, trunk: nn.ModuleList, trace: ModelTrace, tp: int, sequence_parallel: bool,
                      mesh: DeviceMesh, broadcast: Broadcast, verified: bool,
                      materialize_with: Optional[Callable[[nn.Module], Any]] = None) -> BlockSplits:
    """Plan the split of every block structure of ``trunk`` over ``tp`` ranks, refusing before any weight is read
    a structure that does not split (a quantised base per shard, or a split that would not compute the whole
    block). ``verified``: the planner already checked the split at this degree (its check covers every structure).
    The blocks to split are kept off torch's fused kernels once planned (:func:`keep_off_fused_kernels`)."""
    structure_of = block_structures(trunk)
    kinds = sorted(set(structure_of.values()))
    plans: dict[int, TensorParallelPlan] = {}
    sequence_plans: Optional[dict[int, SequenceParallelPlan]] = {} if sequence_parallel else None
    for index in kinds:
        probe = _probe(trunk, trace.trunk_path, index, materialize_with)
        try:
            plans[index] = plan = tensor_parallel_plan(probe, trace)
        except ValueError as error:
            raise ValueError(f"tensor_parallel={tp}: {_named(index, len(kinds), str(error))}") from error
        problem = quantized_split_problem(model, probe, plan, tp)
        if problem is not None:  # an adapter's quantised base, quantised per shard: before any weight is read
            raise ValueError(_named(index, len(kinds), problem))
        if not verified:
            problem = split_block_problem(probe, trace, plan, mesh, broadcast)
            if problem is not None:
                raise ValueError(f"tensor_parallel={tp}: {_named(index, len(kinds), problem)}")
        if sequence_plans is not None:
            sequence_plans[index] = sequence_parallel_plan(probe, trace, plan)
        del probe
    keep_off_fused_kernels(trunk)
    return BlockSplits(structure_of, plans, sequence_plans)
