"""The first batch's build: trace → plan the split → cut stages → split tensors → sequence → recompute → overlap.

:func:`build_model` reads top to bottom, one step per line of the docstring above: it records one
forward pass of the model on the batch's first micro-batch, pairs the blocks' linear layers and
checks the split against the whole block, agrees with every rank on rank 0's partition of the
measured costs, prunes this rank's copy to its stages, splits its blocks over the
tensor-parallel group (and along the sequence), wraps the blocks chosen for recomputation and
splits micro-batches into overlapped sub-batches. What it changed comes back as a
:class:`BuiltModel`; the strategy hands it to Lightning.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_merak.runtime import random_state
from lightning_merak.runtime.sub_batches import SubBatchForward
from lightning_merak.strategies.merak3d.arguments import Merak3DArguments
from lightning_merak.strategies.merak3d.gradients import TiedParameter
from lightning_merak.strategies.merak3d.layout import Layout, LayoutGroups
from lightning_merak.strategies.pipeline.stage import RankStages, build_stage_module, tied_parameter_names
from lightning_merak.strategies.pipeline.trace import ModelTrace, trace_model
from lightning_merak.strategies.sequence_parallel import (
    SequenceParallelPlan,
    check_sequence_length,
    find_sequence_parallel_plan,
    sequence_partial_parameters,
    split_sequence_between,
)
from lightning_merak.strategies.tensor_parallel import (
    LayoutChange,
    TensorParallelPlan,
    apply_tensor_parallel,
    find_tensor_parallel_plan,
    region_partial_parameters,
    verify_tensor_parallel_plan,
)

__all__ = ["BuiltModel", "build_model", "call_model", "in_training_mode", "random_state_kept",
           "sequence_parallel_plan", "split_block_problem", "tensor_parallel_plan"]

Broadcast = Callable[[Any, int], Any]
"""``(obj, src) -> obj``: rank ``src``'s object on every rank (the strategy's ``broadcast``)."""


def call_model(model: nn.Module, inputs: torch.Tensor) -> Any:
    return model(inputs)


def no_cache(model: nn.Module) -> None:
    """Turn off a transformers model's key/value cache: training and tracing return no cache."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False


@contextlib.contextmanager
def in_training_mode(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` in training mode meanwhile, then back in its own mode.

    The build records and times the model as a training batch runs it, whichever loop brought
    the batch (evaluation loops put the module in eval mode).
    """
    modes = {module: module.training for module in model.modules()}
    model.train()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """The random generators as they were before, whatever was drawn inside.

    Lightning restores them after its sanity check but not after a training batch, so a draw
    while building (dropout in the traced forwards, a layer's initialisation) moved the masks of
    a run whose layout was built on a training batch and not those of one built in the check.
    """
    states = random_state.capture()
    try:
        yield
    finally:
        random_state.restore(states)


def first_micro_batch(layout: Layout, inputs: torch.Tensor) -> torch.Tensor:
    """The first micro-batch of ``inputs``, once the batch is known to split into micro- and sub-batches."""
    layout.check_batch(inputs.shape[0])
    return inputs[: inputs.shape[0] // layout.micro_batches]


# The tensor-parallel split of one block ---------------------------------------------------------

def tensor_parallel_plan(block: nn.Module, trace: ModelTrace) -> TensorParallelPlan:
    """Pair the linear layers of one block (all blocks of the trunk share a class)."""
    args, kwargs = trace.block_arguments(trace.sample_side_tensors)
    hidden = trace.sample_hidden
    plan = find_tensor_parallel_plan(block, lambda: block(hidden, *args, **kwargs), hidden.shape[-1])
    if not plan.column or not plan.row:
        raise ValueError(
            f"found no column/row linear pairs in {type(block).__name__}; tensor_parallel needs "
            "blocks built from nn.Linear (or transformers Conv1D) layers"
        )
    return plan


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


# The build ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BuiltModel:
    """What :func:`build_model` made of this rank's copy of the model.

    Attributes:
        stages: this rank's pipeline stages (None without pipeline parallelism: the model itself runs).
        local_blocks: this rank's transformer blocks by trunk index.
        tensor_partial: unsplit parameters of split blocks that see only this rank's heads or
            tokens; their gradients are summed over the tensor-parallel group.
        tied: tied parameters held by the first and last stage, summed between them.
        layout_changes: parameters whose layout the split changed, by unsplit name.
        partition: the agreed partition (None without pipeline parallelism).
    """

    stages: Optional[RankStages]
    local_blocks: dict[int, nn.Module]
    tensor_partial: list[nn.Parameter]
    tied: list[TiedParameter]
    layout_changes: dict[str, LayoutChange]
    partition: Optional[Any]


def build_model(model: nn.Module, inputs: torch.Tensor, *, arguments: Merak3DArguments, groups: LayoutGroups,
                global_rank: int, broadcast: Broadcast, verified_tp_degrees: frozenset[int],
                checkpointed: Callable[..., Any]) -> BuiltModel:
    """Cut, split and wrap ``model`` for this rank on the shapes of ``inputs``; grad enabled, not in inference mode.

    ``verified_tp_degrees`` are the degrees planning already checked the split at;
    ``checkpointed(forward, *args, **kwargs)`` runs a recomputed block.
    """
    layout = groups.layout
    no_cache(model)
    # a copy: an evaluation loop's batch may be an inference tensor, which autograd refuses
    micro = first_micro_batch(layout, inputs).clone()
    pp, tp = layout.pipeline_parallel, layout.tensor_parallel
    sequence_parallel = arguments.sequence_parallel and tp > 1
    if arguments.sequence_parallel and tp == 1:
        rank_zero_info("merak3d: tensor_parallel=1, so sequence_parallel has nothing to split")
    if sequence_parallel:
        check_sequence_length(micro.shape[1], tp)
    with in_training_mode(model):
        # Every rank profiles: blocks may hold collectives (MoE all-to-alls) that need all their peers.
        trace = trace_model(model, micro, call_model, profile=pp > 1)
        trunk: nn.ModuleList = model.get_submodule(trace.trunk_path)
        plan = tensor_parallel_plan(trunk[0], trace) if tp > 1 else None
        if plan is not None and tp not in verified_tp_degrees:
            problem = split_block_problem(trunk[0], trace, plan, groups.tensor_mesh, broadcast)
            if problem is not None:
                raise ValueError(f"tensor_parallel={tp}: {problem}")
        sequence_plan = sequence_parallel_plan(trunk[0], trace, plan) if sequence_parallel else None
    stages, partition, tied = None, None, []
    if pp > 1:
        tied_names = tied_parameter_names(model)
        partition = _agree_on_partition(trace, layout, arguments.partition, global_rank, broadcast)
        stage_ids = [groups.pipeline_rank + k * pp for k in range(layout.virtual_stages)]
        copies = [copy.deepcopy(model) for _ in stage_ids[1:]] + [model]
        stages = RankStages([
            build_stage_module(copy_, trace, partition.boundaries, stage_id, call_model)
            for copy_, stage_id in zip(copies, stage_ids)
        ])
        local_blocks = {
            index: part.net.get_submodule(trace.trunk_path)[index] for part in stages for index in part.block_indices
        }
        tied = _tied_gradient_groups(stages, tied_names, groups.mesh, global_rank)
    else:
        local_blocks = dict(enumerate(trunk))
    layout_changes: dict[str, LayoutChange] = {}
    tensor_partial: list[nn.Parameter] = []
    if plan is not None and local_blocks:
        layout_changes, tensor_partial = _shard_blocks(local_blocks, trace, plan, sequence_plan, groups.tensor_mesh,
                                                       arguments.weight_grad_overlap)
    if sequence_plan is not None:
        segments = [part.block_indices for part in stages] if stages is not None else [list(local_blocks)]
        _split_sequence(local_blocks, segments, trace, groups.tensor_group)
    _wrap_recompute(list(local_blocks.values()), groups, checkpointed)
    if layout.tp_overlap > 1:
        for part in stages if stages is not None else [model]:
            part.forward = SubBatchForward(part, layout.tp_overlap)
    return BuiltModel(stages, local_blocks, tensor_partial, tied, layout_changes, partition)


def _agree_on_partition(trace: ModelTrace, layout: Layout, method: str, global_rank: int,
                        broadcast: Broadcast) -> Any:
    """Rank 0 partitions its measured costs; every rank uses that partition."""
    from lightning_merak.strategies import pipeline

    num_stages = layout.num_stages
    partition = None
    if global_rank == 0:
        partitioners = {
            "autopipe": lambda: pipeline.partition_autopipe(trace.costs, num_stages, layout.micro_batches),
            "min_max": lambda: pipeline.partition_min_max(trace.costs, num_stages),
            "parameters": lambda: pipeline.partition_by_parameters(trace.costs, num_stages),
            "uniform": lambda: pipeline.partition_uniform(trace.costs, num_stages),
        }
        partition = partitioners[method]()
    partition = broadcast(partition, 0)
    rank_zero_info(
        f"merak3d: {method} partition, stage boundaries {partition.boundaries} over "
        f"{[cost.name for cost in trace.costs]}"
    )
    return partition


def _tied_gradient_groups(stages: RankStages, tied_names: list[tuple[str, ...]], mesh: DeviceMesh,
                          global_rank: int) -> list[TiedParameter]:
    """Groups joining the first and last stage of each replica for every tied parameter."""
    if not tied_names:
        return []
    ranks_mesh = mesh.mesh
    pp, dp, tp = ranks_mesh.shape
    my_group = None
    for d in range(dp):
        for t in range(tp):
            ranks = sorted({int(ranks_mesh[0, d, t]), int(ranks_mesh[pp - 1, d, t])})
            group = dist.new_group(ranks)
            if global_rank in ranks:
                my_group = group
    params = {stages.original_name(name): param for name, param in stages.named_parameters()}
    tied = []
    for names in tied_names:
        for name in names:
            param = params.get(name)
            if param is not None:
                tied.append(TiedParameter(my_group, param, stages.is_first))
                break
    return tied


def _shard_blocks(blocks: dict[int, nn.Module], trace: ModelTrace, plan: TensorParallelPlan,
                  sequence_plan: Optional[SequenceParallelPlan], mesh: DeviceMesh,
                  weight_grad_overlap: bool) -> tuple[dict[str, LayoutChange], list[nn.Parameter]]:
    """Split every local block (by trunk index) over the tensor-parallel group.

    Returns the parameters whose layout changed and those left whole that see only part of the work.
    """
    layout_changes = {}
    for index, block in blocks.items():
        changes = apply_tensor_parallel(block, plan, mesh, sequence_plan, weight_grad_overlap)
        layout_changes.update({f"{trace.trunk_path}.{index}.{name}": c for name, c in changes.items()})
    # sequence-split blocks see only their tokens everywhere; plain TP blocks only their heads inside a region
    if sequence_plan is not None:
        return layout_changes, sequence_partial_parameters(list(blocks.values()))
    return layout_changes, [param for block in blocks.values() for param in region_partial_parameters(block, plan)]


def _split_sequence(blocks: dict[int, nn.Module], segments: list[list[int]], trace: ModelTrace,
                    group: dist.ProcessGroup) -> None:
    """Each run of consecutive local blocks (one per stage) works on sequence slices."""
    for indices in segments:
        if indices:
            split_sequence_between(blocks[indices[0]], blocks[indices[-1]], group, trace.block_output_index)


def _wrap_recompute(blocks: list[nn.Module], groups: LayoutGroups, checkpointed: Callable[..., Any]) -> None:
    layout = groups.layout
    if layout.recompute == "none" or not blocks:
        return
    if layout.recompute == "full":
        ratio = 1.0
    else:
        from lightning_merak.strategies.pipeline import stage_aware_recompute_ratios

        ratio = stage_aware_recompute_ratios(layout.recompute_ratio, layout.pipeline_parallel)[groups.pipeline_rank]
    count = math.floor(len(blocks) * ratio + 1e-9)
    for block in blocks[:count]:
        block.forward = functools.partial(checkpointed, block.forward)
