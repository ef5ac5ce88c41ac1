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
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_merak.distributed.dtensors import local_tensor
from lightning_merak.distributed.process_groups import new_group
from lightning_merak.distributed.sub_batches import SubBatchForward
from lightning_merak.modules.muon import newton_schulz_seconds
from lightning_merak.parallel.context.model import trace_as_context_parallel
from lightning_merak.parallel.context.sharding import check_sequence_divisible
from lightning_merak.parallel.data.fully_sharded import FullySharded, apply_fully_shard, data_parallel_mesh
from lightning_merak.parallel.data.gradients import TiedParameter
from lightning_merak.parallel.float8 import MIN_FEATURES, float8_layout_problem, float8_problem
from lightning_merak.parallel.layout import Layout, LayoutGroups
from lightning_merak.parallel.materialize import (
    Materializer,
    RestoreAfterRewrite,
    WeightLoader,
    copy_full_tensors,
    has_meta,
    init_owners,
    local_tensors,
)
from lightning_merak.parallel.pipeline.embedding_stages import split_vocabulary_parameters
from lightning_merak.parallel.pipeline.recompute import stage_aware_recompute_ratios
from lightning_merak.parallel.pipeline.router_aux import (
    RouterAux,
    adds_no_router_aux_loss,
    router_aux_loss_problem,
    router_aux_of,
)
from lightning_merak.parallel.pipeline.stage import RankStages, build_stage_module, tied_parameter_names
from lightning_merak.parallel.pipeline.trace import ModelTrace, TraceError, find_trunk, trace_model
from lightning_merak.parallel.tensor.blocks import LayoutChange, apply_tensor_parallel, region_partial_parameters
from lightning_merak.parallel.tensor.quantized_shards import quantized_shards
from lightning_merak.parallel.tensor.sequence import (
    check_sequence_length,
    sequence_partial_parameters,
    split_sequence_between,
)
from lightning_merak.parallel.tensor.vocab import keep_tied_vocabulary_whole, split_vocabulary
from lightning_merak.protocols.layout_aware import RecomputedForward
from lightning_merak.strategies.merak3d.arguments import Merak3DArguments
from lightning_merak.strategies.merak3d.block_splits import BlockSplits, plan_block_splits
from lightning_merak.strategies.merak3d.partitioning import agree_on_partition
from lightning_merak.strategies.merak3d.vocab_stages_build import (
    check_rows_loaded,
    reads_rows_first,
    split_vocabulary_over_stages,
    splittable_embedding,
    splittable_head,
)
from lightning_merak.strategies.merak3d.vocabulary_build import VocabularyRows
from lightning_merak.util import random_state
from lightning_merak.util.buffers import buffers_kept
from lightning_merak.util.model_outputs import no_cache
from lightning_merak.util.module_mode import modules_in_mode

__all__ = ["BuiltModel", "build_model", "call_model", "check_skips_split", "in_training_mode", "random_state_kept",
           "shard_built_model"]

Broadcast = Callable[[Any, int], Any]
"""``(obj, src) -> obj``: rank ``src``'s object on every rank (the strategy's ``broadcast``)."""


def call_model(model: nn.Module, inputs: torch.Tensor) -> Any:
    return model(inputs)


def in_training_mode(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Every module of ``model`` in training mode meanwhile, then back in its own mode.

    The build records and times the model as a training batch runs it, whichever loop brought
    the batch (evaluation loops put the module in eval mode).
    """
    return modules_in_mode(model, training=True)


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


def first_micro_batch(layout: Layout, inputs: torch.Tensor, micro_batching: str = "none") -> torch.Tensor:
    """The first micro-batch of ``inputs``, once the batch is known to split into micro- and sub-batches. With
    ``micro_batching`` on, ``inputs`` are a global batch's probe block, which the plan of each step splits into
    micro-batches of any sample count: a share of its rows (one at least), whatever the count."""
    if micro_batching != "none":
        return inputs[: max(1, inputs.shape[0] // layout.micro_batches)]
    layout.check_batch(inputs.shape[0])
    return inputs[: inputs.shape[0] // layout.micro_batches]


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


def weight_loader(module: nn.Module, restored_state: Optional[dict[str, Any]], network: nn.Module,
                  prefix: str) -> Optional[WeightLoader]:
    """What fills a rank's materialised part: a checkpoint Lightning restored before the build (the
    LightningModule's state, its ``network`` under ``prefix``), else the module's pretrained seam
    (``load_pretrained_weights(tensors, layout_changes)``, if it has one)."""
    if restored_state is not None:
        state = {name[len(prefix):]: tensor for name, tensor in restored_state.items() if name.startswith(prefix)}
        hook = getattr(network, "after_materialize", None)
        if hook is not None and not getattr(hook, "restores_from_checkpoint", True):  # a quantised adapter base
            return RestoreAfterRewrite(getattr(module, "load_pretrained_weights", None), state)
        return functools.partial(copy_full_tensors, state_dict=state)
    return getattr(module, "load_pretrained_weights", None)


def meta_materializers(model: nn.Module, device: torch.device, broadcast: Broadcast) -> Callable[[nn.Module], Any]:
    """``materialize_with(copy)`` for the meta ``model``: a fresh Materializer's ``materialize`` per copy, on
    ``device``, seeded alike on every rank (rank 0's seed), so replicated modules start equal."""
    seed, owners = int(broadcast(torch.initial_seed(), 0)), init_owners(model)
    return lambda copy_: Materializer(device, seed, owners).materialize


def build_model(model: nn.Module, inputs: Optional[torch.Tensor], *, device: torch.device,
                arguments: Merak3DArguments, groups: LayoutGroups,
                global_rank: int, broadcast: Broadcast, verified_tp_degrees: frozenset[int],
                load_weights: Optional[WeightLoader] = None, optimizers: Sequence[Any] = ()) -> BuiltModel:
    """Cut, split and wrap ``model`` for this rank on the shapes of ``inputs``; grad enabled, not in inference mode.

    ``verified_tp_degrees`` are the degrees planning already checked the split at; recomputed
    blocks run a :class:`~lightning_merak.protocols.layout_aware.RecomputedForward`. A model on
    the meta device is traced and cut there; this rank then materialises only what it holds,
    block by block (each split right after), and ``load_weights`` (the pretrained seam) fills it; with
    ``tensor_parallel>1`` and a loader, the embedding and head are split over the vocabulary before they are
    materialised (:class:`~lightning_merak.strategies.merak3d.vocabulary_build.VocabularyRows`).
    With ``pipeline_parallel=1`` and ``tensor_parallel=1`` nothing is traced (``inputs`` may be None): plain data
    parallelism, on ``device``. For AutoPipe's cut rank 0 times the Newton–Schulz work of ``optimizers`` (the
    module's, made before the cut; Muon's).
    """
    layout = groups.layout
    if arguments.float8 is not None:
        problem = (float8_layout_problem(arguments.float8, layout.tensor_parallel)
                   or float8_problem(arguments.float8, device))
        if problem is not None:
            raise ValueError(problem)
    no_cache(model)
    router_aux = _router_aux(model, arguments, layout)
    pp, tp = layout.pipeline_parallel, layout.tensor_parallel
    if arguments.sequence_parallel and tp == 1:
        rank_zero_info("merak3d: tensor_parallel=1, so sequence_parallel has nothing to split")
    if arguments.vocab_stages == "on" and pp == 1:
        rank_zero_info("merak3d: pipeline_parallel=1, so vocab_stages has no stages to split the LM head over")
    if pp == 1 and (arguments.schedule != "1f1b" or arguments.virtual_stages != 2):
        rank_zero_info(f"merak3d: pipeline_parallel=1, so schedule={arguments.schedule} and virtual_stages="
                       f"{arguments.virtual_stages} run no pipeline")
    elif arguments.virtual_stages != 2 and arguments.stages_per_rank == 1:
        rank_zero_info(f"merak3d: schedule={arguments.schedule} runs one stage per rank; virtual_stages="
                       f"{arguments.virtual_stages} applies to the interleaved schedules")
    fixed_rows = arguments.micro_batching == "none" and arguments.context_parallel_degree == "fixed"
    if layout.context_parallel > 1 and fixed_rows and inputs is not None:  # before the trace or any forward
        check_sequence_divisible(inputs.shape[1], layout.context_parallel)
    materialize_with = meta_materializers(model, device, broadcast) if has_meta(model) else None
    if pp == 1 and tp == 1:
        if inputs is not None:
            layout.check_batch(inputs.shape[0])
        return _data_parallel_only(model, layout, groups, materialize_with, load_weights, arguments)
    assert inputs is not None, "a traced build needs the batch's inputs"
    # a copy: an evaluation loop's batch may be an inference tensor, which autograd refuses
    micro = first_micro_batch(layout, inputs, arguments.micro_batching).clone()
    sequence_parallel = arguments.sequence_parallel and tp > 1
    if sequence_parallel:  # the tokens each context rank holds are split over tp
        check_sequence_length(micro.shape[1] // layout.context_parallel, tp)
    if layout.context_parallel > 1:
        trace_as_context_parallel(model)
        # each rank runs its shard of the sequence: a head that reshapes to the sequence length must record that
        micro = micro[:, :-(-micro.shape[1] // layout.context_parallel)]
    with in_training_mode(model), buffers_kept(model):  # a running statistic counts no traced or timed forward
        # Every rank profiles: blocks may hold collectives (MoE all-to-alls) that need all their peers.
        trace = trace_model(model, micro, call_model, profile=pp > 1, materialize_with=materialize_with,
                            fast_blocks=arguments.fast_blocks)
        check_skips_split(trace, tp, sequence_parallel)
        trunk: nn.ModuleList = model.get_submodule(trace.trunk_path)
        splits = (plan_block_splits(model, trunk, trace, tp, sequence_parallel, groups.tensor_mesh, broadcast,
                                    tp in verified_tp_degrees, materialize_with) if tp > 1 else None)
    stages, partition, tied = None, None, []
    if pp > 1:
        tied_names = tied_parameter_names(model)
        keep_tied_vocabulary_whole(model)  # on the whole model: every stage keeps a tied pair whole, or none
        head_shape = splittable_head(model, trace, arguments, layout)
        vocab_stages = arguments.vocab_stages if head_shape is not None else "off"
        embedding_path = (splittable_embedding(model, trace, head_shape, layout.schedule) if head_shape is not None
                          else None)
        partition = agree_on_partition(trace, layout, arguments.partition, global_rank, broadcast, vocab_stages,
                                        embedding_path is not None, model,
                                        lambda: newton_schulz_seconds(optimizers, device))
        stage_ids = [groups.pipeline_rank + k * pp for k in range(layout.virtual_stages)]
        copies = [copy.deepcopy(model) for _ in stage_ids[1:]] + [model]
        stages = RankStages([
            build_stage_module(copy_, trace, partition.boundaries, stage_id, call_model, router_aux)
            for copy_, stage_id in zip(copies, stage_ids)
        ], router_aux)
        local_blocks = {
            index: part.net.get_submodule(trace.trunk_path)[index] for part in stages for index in part.block_indices
        }
    else:
        local_blocks = dict(enumerate(trunk))
    parts: list[nn.Module] = [part.net for part in stages] if stages is not None else [model]
    split_over_stages = stages is not None and (partition.vocab_stages or vocab_stages == "on")
    # the vocabulary layers split over the pipeline (x tensor-parallel) ranks instead, from the whole tables
    split_vocabulary_now = tp > 1 and arguments.vocab_parallel and not split_over_stages
    vocabulary = None
    if materialize_with is not None and split_vocabulary_now and load_weights is not None:
        # each rank allocates and reads only its vocabulary rows; see VocabularyRows for random init
        vocabulary = VocabularyRows(parts, groups.tensor_mesh, sequence_parallel, materialize_with)
        split_vocabulary_now = False
    rows_first = split_over_stages and reads_rows_first(head_shape, materialize_with, load_weights)
    if rows_first:  # each rank allocates only its rows of the split tables; the loader reads only those
        split_vocabulary_over_stages(stages, head_shape, embedding_path, trace, groups, global_rank, device, True)
    if materialize_with is not None:
        for part in parts:
            _materialize_outside_trunk(part, trace.trunk_path, materialize_with(part))
    if stages is not None:  # the materialised parameters, not the meta ones they replaced (split rows: one weight)
        rows = {id(param) for param in split_vocabulary_parameters(stages, trainable_only=False)}
        tied = [entry for entry in _tied_gradient_groups(stages, tied_names, groups, global_rank)
                if id(entry.param) not in rows]
    layout_changes: dict[str, LayoutChange] = {}
    tensor_partial: list[nn.Parameter] = []
    if (splits is not None or materialize_with is not None) and local_blocks:
        layout_changes, tensor_partial = _shard_blocks(local_blocks, trace, splits, groups.tensor_mesh,
                                                       arguments.weight_grad_overlap, materialize_with)
    if materialize_with is not None and tied and vocabulary is None:
        _start_tied_equal(tied, stages, groups.mesh, global_rank)
    root = stages if stages is not None else model
    if vocabulary is not None:
        vocabulary.load(lambda: load_weights(_local_tensors(root), layout_changes))
        if tied:  # random init draws the tied rows per stage; loaded ones are equal already
            _start_tied_equal(tied, stages, groups.mesh, global_rank)
    elif rows_first:
        check_rows_loaded(stages, lambda: load_weights(_local_tensors(root), layout_changes))
    elif load_weights is not None:
        load_weights(_local_tensors(root), layout_changes)
    if materialize_with is not None:
        _after_materialize(parts, root, layout_changes, load_weights)
    if split_over_stages and not rows_first:
        split_vocabulary_over_stages(stages, head_shape, embedding_path, trace, groups, global_rank, device)
        tied = [entry for entry in tied if any(entry.param is param for param in stages.parameters())]  # one weight
    if split_vocabulary_now:
        replaced = split_vocabulary(list(stages) if stages is not None else [model], groups.tensor_mesh,
                                    sequence_parallel=sequence_parallel)
        tied = [entry._replace(param=replaced.get(id(entry.param), entry.param)) for entry in tied]
    if tied:  # the gradient sum between the stages joins the copies as they are now
        check_tied_shapes(tied, stages)
    if sequence_parallel:
        segments = [part.block_indices for part in stages] if stages is not None else [list(local_blocks)]
        _split_sequence(local_blocks, segments, trace, groups.tensor_group)
    _fast_blocks([(f"{trace.trunk_path}.{index}", block) for index, block in local_blocks.items()], arguments)
    _wrap_recompute(list(local_blocks.values()), groups)
    if layout.tp_overlap > 1:
        for part in stages if stages is not None else [model]:
            part.forward = SubBatchForward(part, layout.tp_overlap)
    return BuiltModel(stages, local_blocks, tensor_partial, tied, layout_changes, partition)


def check_skips_split(trace: ModelTrace, tp: int, sequence_parallel: bool) -> None:
    """Refuse the tensor-parallel splits that skip values (earlier blocks' outputs a block reads) would break.

    A skip value that is an earlier block's hidden state is whole on every tensor-parallel rank (the row
    layers' all-reduce made it); any other output may be one rank's heads, and the split is checked on block
    0 alone, which reads none.
    """
    if sequence_parallel and trace.skips:
        raise ValueError(
            f"sequence_parallel=True splits the sequence inside each stage's run of blocks, but blocks of "
            f"{trace.trunk_path} read earlier blocks' outputs ({len(trace.skips)} skip values), which may cross "
            "from one run into another split differently; set sequence_parallel=False")
    hidden_leaf = trace.block_output_index or 0
    inner = [skip for skip in trace.skips if skip.leaf != hidden_leaf]
    if tp > 1 and inner:
        raise ValueError(
            f"tensor_parallel={tp}: blocks {list(inner[0].consumers)} of {trace.trunk_path} read an output of block "
            f"{inner[0].producer} other than its hidden state (a value-residual model's values?), which the split "
            "may leave as this rank's heads only and which the split check of block 0 never sees; set "
            "tensor_parallel=1")


def _router_aux(model: nn.Module, arguments: Merak3DArguments, layout: Layout) -> Optional[RouterAux]:
    """The router aux loss the stages carry router logits for (``output_router_logits=True`` under
    ``pipeline_parallel>1``), or None; refused, before any work, where the layout or the model cannot train it."""
    output_router_logits = (getattr(getattr(model, "config", None), "output_router_logits", False)
                            and not adds_no_router_aux_loss(model))  # the flag then only returns logits
    problem = router_aux_loss_problem(output_router_logits, layout.pipeline_parallel,
                                      micro_batching=arguments.micro_batching,
                                      sequence_parallel=arguments.sequence_parallel,
                                      tensor_parallel=layout.tensor_parallel, tp_overlap=layout.tp_overlap,
                                      context_parallel=layout.context_parallel)
    if problem is not None:
        raise ValueError(problem)
    if not output_router_logits or layout.pipeline_parallel == 1:
        return None
    return router_aux_of(model, find_trunk(model)[1])


def _tied_gradient_groups(stages: RankStages, tied_names: list[tuple[str, ...]], groups: LayoutGroups,
                          global_rank: int) -> list[TiedParameter]:
    """Groups joining the first and last stage of each replica for every parameter tied across them (the ties
    whose copies one stage holds together stay one parameter there: a masked-LM head's bias and its decoder's)."""
    if not tied_names:
        return []
    ranks_mesh = groups.mesh.mesh
    pp, dp, tp = ranks_mesh.shape
    my_group = None
    for d in range(dp):
        for t in range(tp):
            ranks = sorted({int(ranks_mesh[0, d, t]), int(ranks_mesh[pp - 1, d, t])})
            group = new_group(ranks)
            if global_rank in ranks:
                my_group = group
    params = {stages.original_name(name): param for name, param in stages.named_parameters()}
    held = [index for index, names in enumerate(tied_names) if any(name in params for name in names)]
    held_by_rank: list[Any] = [None] * dist.get_world_size(groups.pipeline_group)
    dist.all_gather_object(held_by_rank, held, group=groups.pipeline_group)
    tied = []
    for index in ties_between_end_stages(tied_names, held_by_rank):
        if index in held:  # a middle stage holds no copy
            param = [params[name] for name in tied_names[index] if name in params][0]
            tied.append(TiedParameter(my_group, param, stages.is_first))
    return tied


def ties_between_end_stages(tied_names: Sequence[tuple[str, ...]], held_by_rank: Sequence[Sequence[int]]
                            ) -> list[int]:
    """The indexes of ``tied_names`` whose copies the first and the last pipeline rank hold (``held_by_rank``: the
    indexes each rank of the pipeline holds a copy of); a tie one rank holds alone is one parameter there. A tie
    spread over other ranks is refused: merak3d keeps copies equal between the first and the last stage only."""
    last = len(held_by_rank) - 1
    across = []
    for index, names in enumerate(tied_names):
        holders = [rank for rank, held in enumerate(held_by_rank) if index in held]
        if len(holders) <= 1:
            continue
        if holders != [0, last]:
            raise ValueError(f"merak3d: the tied parameters {', '.join(names)} sit on pipeline ranks {holders}; "
                             "merak3d keeps a tie equal between the first and the last stage only (an embedding and "
                             "the LM head): untie them, or train with pipeline_parallel=1")
        across.append(index)
    return across


def _shard_blocks(blocks: dict[int, nn.Module], trace: ModelTrace, splits: Optional[BlockSplits], mesh: DeviceMesh,
                  weight_grad_overlap: bool, materialize_with: Optional[Callable[[nn.Module], Any]] = None,
                  ) -> tuple[dict[str, LayoutChange], list[nn.Parameter]]:
    """Split every local block (by trunk index) over the tensor-parallel group, each by its structure's plan
    (materialised first when on meta: one whole block at a time, so a rank never holds more than its shards and
    one block).

    Returns the parameters whose layout changed and those left whole that see only part of the work.
    """
    layout_changes = {}
    for index, block in blocks.items():
        if materialize_with is not None:
            materialize_with(block)(block, f"{trace.trunk_path}.{index}")
        if splits is None:
            continue
        changes = apply_tensor_parallel(block, splits.plan(index), mesh, splits.sequence_plan(index),
                                        weight_grad_overlap)
        layout_changes.update({f"{trace.trunk_path}.{index}.{name}": c for name, c in changes.items()})
    if splits is None:
        return layout_changes, []
    # sequence-split blocks see only their tokens everywhere; plain TP blocks only their heads inside a region
    if splits.sequence_plans is not None:
        return layout_changes, sequence_partial_parameters(list(blocks.values()))
    return layout_changes, [param for index, block in blocks.items()
                            for param in region_partial_parameters(block, splits.plan(index))]


def _split_sequence(blocks: dict[int, nn.Module], segments: list[list[int]], trace: ModelTrace,
                    group: dist.ProcessGroup) -> None:
    """Each run of consecutive local blocks (one per stage) works on sequence slices."""
    for indices in segments:
        if indices:
            split_sequence_between(blocks[indices[0]], blocks[indices[-1]], group, trace.block_output_index)


def _fast_blocks(blocks: list[tuple[str, nn.Module]], arguments: Merak3DArguments) -> None:
    """fp8 linear layers, then compilation, on each split block (before recomputation wraps it)."""
    converted = arguments.fast_blocks.apply(blocks)
    if arguments.float8 is not None:
        rank_zero_info(f"merak3d: float8={arguments.float8} on {len(converted)} linear layers of this rank's "
                       f"{len(blocks)} blocks (those with both widths at least {MIN_FEATURES} and multiples of 16: "
                       "narrower ones run faster unconverted)")


def _wrap_recompute(blocks: list[nn.Module], groups: LayoutGroups) -> None:
    layout = groups.layout
    if layout.recompute == "none" or not blocks:
        return
    if layout.recompute == "full":
        ratio = 1.0
    else:
        ratio = stage_aware_recompute_ratios(layout.recompute_ratio, layout.pipeline_parallel)[groups.pipeline_rank]
    count = math.floor(len(blocks) * ratio + 1e-9)
    for block in blocks[:count]:
        block.forward = RecomputedForward(block.forward)


# Meta-device models --------------------------------------------------------------------------

def _materialize_outside_trunk(part: nn.Module, trunk_path: str, materialize: Callable[..., None]) -> None:
    """Materialise what ``part`` holds besides its blocks: the prefix and head modules it kept, and the
    trunk's containers' own tensors."""
    done: list[str] = []
    for name, module in part.named_modules():
        if any(name.startswith(prefix + ".") for prefix in done) or name == trunk_path \
                or name.startswith(trunk_path + "."):
            continue
        if name == "" or trunk_path.startswith(name + "."):
            materialize(module, name, False)
        elif has_meta(module):
            materialize(module, name)
            done.append(name)


def _start_tied_equal(tied: list[TiedParameter], stages: RankStages, mesh: DeviceMesh, global_rank: int) -> None:
    """Tied copies initialised on different stages start from the first stage's values."""
    check_tied_shapes(tied, stages)
    ranks = mesh.mesh
    _, d, t = (int(i) for i in (ranks == global_rank).nonzero()[0])
    for parameter in tied:
        data = parameter.param.data
        dist.broadcast(data.to_local() if isinstance(data, DTensor) else data, src=int(ranks[0, d, t]),
                       group=parameter.group)


def check_tied_shapes(tied: list[TiedParameter], stages: RankStages) -> None:
    """Refuse tied copies whose local shapes differ between the first and last stage (one split by vocabulary, one
    whole): the broadcast and the gradient sum between them go element by element, and would mix rows silently."""
    names = {id(param): stages.original_name(name) for name, param in stages.named_parameters()}
    for parameter in tied:
        side = ("first" if parameter.is_first else "last", tuple(local_tensor(parameter.param).shape))
        sides: list[Any] = [None] * dist.get_world_size(parameter.group)
        dist.all_gather_object(sides, side, group=parameter.group)
        if len({shape for _, shape in sides}) > 1:
            held = " but ".join(f"{list(shape)} on the {stage} stage" for stage, shape in sorted(set(sides)))
            raise ValueError(
                f"merak3d: the tied parameter {names.get(id(parameter.param), '(embedding/LM head)')} holds local "
                f"shape {held}: one copy is split by vocabulary and the other is not, so they cannot be kept equal; "
                "set vocab_parallel=false, or untie or leave untargeted the embedding and LM head")


def _after_materialize(parts: list[nn.Module], root: nn.Module, layout_changes: dict[str, LayoutChange],
                       load_weights: Optional[WeightLoader]) -> None:
    """Run each meta-built part's ``after_materialize(part)`` hook, if it has one, once its weights are in (an
    adapter model quantises its frozen base there: :mod:`lightning_merak.adapters.meta`); then a checkpoint of the
    rewritten model is copied in (:class:`~lightning_merak.parallel.materialize.RestoreAfterRewrite`), this rank's
    quantised shards cut from the whole layers where the checkpoint was written at another tensor-parallel degree."""
    for part in parts:
        hook = getattr(part, "after_materialize", None)
        if hook is not None:
            hook(part)
    if isinstance(load_weights, RestoreAfterRewrite):
        load_weights.restore(_local_tensors(root), layout_changes, quantized_shards(root, _original_name(root)))


def _original_name(root: nn.Module) -> Callable[[str], str]:
    """A name in ``root`` (this rank's stages, or the model) as the unsplit model names it."""
    return root.original_name if isinstance(root, RankStages) else (lambda name: name)


def _local_tensors(root: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers by their unsplit names (the pretrained loader's view)."""
    original = _original_name(root)
    non_persistent = {f"{prefix}.{name}" if prefix else name for prefix, module in root.named_modules()
                      for name in module._non_persistent_buffers_set}
    return local_tensors(root.named_parameters(), root.named_buffers(), non_persistent, original)


def _data_parallel_only(model: nn.Module, layout: Layout, groups: LayoutGroups,
                        materialize_with: Optional[Callable[[nn.Module], Any]],
                        load_weights: Optional[WeightLoader], arguments: Merak3DArguments) -> BuiltModel:
    """pp=1, tp=1: the whole model on every rank, untraced, so any model DDP trains trains here too.

    Recomputation, fp8 and compilation work on the blocks of the model's ModuleList trunk, which they then need.
    """
    try:
        trunk_path, trunk = find_trunk(model)
        blocks = dict(enumerate(trunk))
    except TraceError as error:
        if layout.recompute != "none":
            raise ValueError(f"recompute={layout.recompute!r} recomputes transformer blocks: {error}") from error
        for name, wanted in (("compile", arguments.compile), ("float8", arguments.float8)):
            if wanted:
                raise ValueError(f"{name}={wanted!r} works on transformer blocks one by one: {error}") from error
        trunk_path, blocks = "", {}
    if materialize_with is not None:
        materialize_with(model)(model, "")
    if load_weights is not None:
        load_weights(_local_tensors(model), {})
    if materialize_with is not None:
        _after_materialize([model], model, {}, load_weights)
    _fast_blocks([(f"{trunk_path}.{index}", block) for index, block in blocks.items()], arguments)
    _wrap_recompute(list(blocks.values()), groups)
    if layout.tp_overlap > 1:
        model.forward = SubBatchForward(model, layout.tp_overlap)
    return BuiltModel(None, blocks, [], [], {}, None)


def _ready_quantized(model: nn.Module) -> list[nn.Parameter]:
    """Ready a bitsandbytes base for FSDP2 (4-bit codes shard, their statistics stay whole); returns the weights it
    must leave whole (int8). A model holding any has imported bitsandbytes. The project's INT4 needs nothing: its
    codes, scales and zeros are frozen parameters, which FSDP2 shards and gathers as they are."""
    if "bitsandbytes" not in sys.modules:
        return []
    from lightning_merak.adapters.quantize import prepare_fully_shard  # lazy: PEFT

    return prepare_fully_shard(model)


def shard_built_model(model: nn.Module, built: BuiltModel, groups: LayoutGroups, shard_size: Optional[int], *,
                      row_shared: bool = False) -> tuple[FullySharded, BuiltModel]:
    """Fully shard ``model`` (this rank's part of the built layout: a ``RankStages`` or the whole model) over the
    data-parallel ranks; returns the result and ``built`` with its parameter lists pointing at the sharded ones.

    ``row_shared``: the build left split parameters whose rows several tensor-parallel ranks hold (more
    ranks than key/value heads); their per-row norm shares do not follow a second split, so it is refused.
    """
    if row_shared:
        raise ValueError(
            "data_parallel_sharding='full' cannot shard key/value projections whose heads several tensor-parallel "
            "ranks share (tensor_parallel > num_key_value_heads); choose tensor_parallel <= num_key_value_heads or "
            "data_parallel_sharding='optimizer'/'gradients'"
        )
    stages = built.stages
    if stages is not None:
        roots: list[nn.Module] = list(stages)
        blocks = [[built.local_blocks[index] for index in part.block_indices] for part in stages]
    else:
        roots, blocks = [model], [list(built.local_blocks.values())]
    mesh = data_parallel_mesh(groups.mesh, shard_size)
    rows = split_vocabulary_parameters(stages, trainable_only=False) if stages is not None else []
    if rows:  # split rows (frozen too) and head LoRA factors: gradients set after the schedule, averaged over dp
        stages.rows_data_parallel_group = groups.data_parallel_group
    sharded = apply_fully_shard(roots, blocks, mesh, pipelined=stages is not None,
                                replicated=_ready_quantized(model), reduced_elsewhere=rows)
    remapped = replace(built, tensor_partial=[sharded.sharded(param) for param in built.tensor_partial],
                       tied=[entry._replace(param=sharded.sharded(entry.param)) for entry in built.tied])
    return sharded, remapped
