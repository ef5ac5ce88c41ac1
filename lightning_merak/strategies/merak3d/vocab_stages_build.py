"""The build's part of ``vocab_stages``: whether the LM head splits over the pipeline ranks, AutoPipe pricing the
split, the group its collectives run on, and where each rank's rows come from: scattered from the stage that built
the whole table, or, on a meta model with a pretrained loader, allocated on each rank and read from the files, so
no rank holds or reads a whole table (:mod:`lightning_merak.parallel.pipeline.vocab_stages`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_merak.distributed.process_groups import collective_device, new_group
from lightning_merak.parallel import pipeline
from lightning_merak.parallel.layout import Layout, LayoutGroups
from lightning_merak.parallel.pipeline.embedding_stages import (
    embedding_split_problem,
    split_embedding_over_stages,
    split_vocabulary_parameters,
)
from lightning_merak.parallel.pipeline.head_adapters import head_lora, head_lora_layout_problem
from lightning_merak.parallel.pipeline.trace import ModelTrace
from lightning_merak.parallel.pipeline.vocab_stages import (
    HeadShape,
    split_head_over_stages,
    tied_to_head,
    vocab_stage_rows_problem,
    vocab_stages_problem,
)
from lightning_merak.strategies.merak3d.arguments import Merak3DArguments

__all__ = ["check_rows_loaded", "embedding_splits_with_head", "reads_rows_first", "replica_vocabulary_group",
           "split_vocabulary_over_stages", "splittable_embedding", "splittable_head", "vocab_split_autopipe",
           "vocabulary_mesh"]


def splittable_head(model: nn.Module, trace: ModelTrace, arguments: Merak3DArguments, layout: Layout
                    ) -> Optional[HeadShape]:
    """The LM head ``vocab_stages`` splits over the pipeline ranks, or None (off, or 'auto' where it cannot run;
    'on' there is refused with the reason)."""
    if arguments.vocab_stages == "off":
        return None
    problem = vocab_stages_problem(model, trace, schedule=layout.schedule)
    if problem is None:
        problem = head_lora_layout_problem(head_lora(model.get_output_embeddings()), layout.tensor_parallel)
    if problem is None:
        problem = vocab_stage_rows_problem(model.get_output_embeddings().out_features,
                                           layout.pipeline_parallel * layout.tensor_parallel)
    if problem is not None:
        if arguments.vocab_stages == "on":
            raise ValueError(problem)
        rank_zero_info(f"merak3d: vocab_stages='auto' keeps the LM head on the last stage: {problem}")
        return None
    head = model.get_output_embeddings()
    path = _module_path(model, head)
    embedding = model.get_input_embeddings()
    tied = tied_to_head(embedding, head)
    return HeadShape(path, head.out_features, head.in_features, head.bias is not None, head.weight.dtype,
                     head.weight.requires_grad, _module_path(model, embedding) if tied else None, head_lora(head))


def splittable_embedding(model: nn.Module, trace: ModelTrace, head: HeadShape,
                         schedule: str = "1f1b") -> Optional[str]:
    """The path of the input embedding that splits over the pipeline ranks with the head under ``schedule``, or
    None where it stays on the first stage (the reason is logged). A tied embedding splits as the head's weight."""
    if head.tied_embedding is not None:
        return head.tied_embedding
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    problem = embedding_split_problem(embedding, schedule)
    path = _module_path(model, embedding) if embedding is not None else None
    if problem is None and path is not None and any(
            path == inner or path.startswith(inner + ".") for inner in (trace.trunk_path, *trace.suffix_paths)):
        problem = f"the input embedding {path} is not computed before the blocks"
    if problem is not None:
        rank_zero_info(f"merak3d: vocab_stages keeps the input embedding on the first stage: {problem}")
        return None
    return path


def embedding_splits_with_head(model: nn.Module, schedule: str) -> bool:
    """Whether a split LM head would take ``model``'s input embedding with it under ``schedule`` (for the
    planner's pricing; :func:`splittable_embedding` decides at build, with the trace)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return tied_to_head(embedding, head) or embedding_split_problem(embedding, schedule) is None


def _module_path(model: nn.Module, target: nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is target)


def vocabulary_mesh(groups: LayoutGroups) -> DeviceMesh:
    """The ranks a replica's vocabulary rows split over: its pipeline ranks, or with tensor parallelism its
    pipeline × tensor-parallel ranks flattened stage-major (``DeviceMesh._flatten``, feature-detected)."""
    if groups.layout.tensor_parallel == 1:
        return groups.mesh["pp"]
    submesh = groups.mesh["pp", "tp"]
    if not hasattr(submesh, "_flatten"):
        raise RuntimeError("vocab_stages at tensor_parallel>1 flattens the pipeline and tensor-parallel mesh "
                           "dimensions (DeviceMesh._flatten), which this torch lacks; use the tested torch 2.13, "
                           "tensor_parallel=1 or vocab_stages='off'")
    return submesh._flatten("pp_tp")


def replica_vocabulary_group(groups: LayoutGroups, global_rank: int) -> dist.ProcessGroup:
    """A second group over this replica's pipeline (× tensor-parallel) ranks, in :func:`vocabulary_mesh`'s order,
    for the split layers' collectives (run beside the schedule's sends); every rank creates every replica's, in
    one order."""
    ranks = groups.mesh.mesh  # [pp, dp, tp]
    mine = None
    for replica in ranks.permute(1, 0, 2).reshape(ranks.shape[1], -1).tolist():
        group = new_group(replica)
        if global_rank in replica:
            mine = group
    assert mine is not None
    return mine


def vocab_split_autopipe(trace: ModelTrace, layout: Layout, mode: str, split_embedding: bool = True) -> Any:
    """AutoPipe with the head (and with ``split_embedding`` the input embedding) split over the stages ('on'),
    without, or whichever simulates faster ('auto')."""
    num_stages, micro_batches = layout.num_stages, layout.micro_batches
    if mode != "auto":
        return pipeline.partition_autopipe(trace.costs, num_stages, micro_batches, vocab_stages=mode == "on",
                                           split_embedding=split_embedding)
    options = [pipeline.partition_autopipe(trace.costs, num_stages, micro_batches, vocab_stages=split,
                                           split_embedding=split_embedding)
               for split in (False, True)]
    iterations = [pipeline.predicted_step_s(option, micro_batches) for option in options]
    rank_zero_info(f"merak3d: vocab_stages='auto' simulates {iterations[0] * 1e3:.1f} ms per step with the head on "
                   f"the last stage, {iterations[1] * 1e3:.1f} ms split over the stages")
    return options[1] if iterations[1] < iterations[0] else options[0]


def split_vocabulary_over_stages(stages: Any, head: HeadShape, embedding_path: Optional[str], trace: ModelTrace,
                                 groups: LayoutGroups, global_rank: int, device: torch.device,
                                 allocate: bool = False) -> None:
    """Put this rank's rows of the LM head (and of the input embedding at ``embedding_path``) in ``stages`` with
    their exchanges: scattered from the stages that hold the whole tables, or with ``allocate`` (a meta model and
    a pretrained loader) allocated on each rank for the loader to fill, so no rank holds or reads a whole table."""
    mesh, tp = vocabulary_mesh(groups), groups.layout.tensor_parallel
    stages.vocabulary = split_head_over_stages(
        stages, head, trace, mesh, replica_vocabulary_group(groups, global_rank), device, tp, groups.context_group,
        allocate=allocate)
    if embedding_path is not None:
        tied_weight = stages.vocabulary.head.weight if head.tied_embedding is not None else None
        stages.embedding = split_embedding_over_stages(stages, embedding_path, mesh, stages.vocabulary.group, device,
                                                       tied_weight, tp, allocate=allocate)


def reads_rows_first(head: HeadShape, materialize_with: Optional[Callable[..., Any]],
                     load_weights: Optional[Callable[..., Any]]) -> bool:
    """Whether each rank allocates its rows of the split ``head`` (and embedding) before the pretrained load
    (:func:`split_vocabulary_over_stages` with ``allocate``): on a meta model (``materialize_with``) whose loader is
    a module's pretrained seam with a checkpoint to read (``CausalLMModule(pretrained_path=...)``), without LoRA on
    the head. Otherwise the rows keep the single-process initialisation the stage holding the table gives them."""
    reads = getattr(getattr(load_weights, "__self__", None), "pretrained_path", None) is not None
    return materialize_with is not None and reads and head.lora is None


def check_rows_loaded(stages: Any, load: Callable[[], None]) -> None:
    """Run ``load`` (the pretrained loader) and refuse, on every rank of the vocabulary group, rows it left unwritten:
    allocated for it, they hold no values (a tensor the model's keys to ignore on load skip)."""
    params = split_vocabulary_parameters(stages, trainable_only=False)
    versions = [param.to_local()._version for param in params]
    load()
    written = all(param.to_local()._version != version for param, version in zip(params, versions))
    group = stages.vocabulary.group
    flag = torch.tensor([1.0 if written else 0.0], device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if not flag.item():
        raise ValueError("the pretrained load left rows of the split LM head or input embedding unwritten (the model "
                         "ignores that tensor on load); set vocab_stages='off' to keep the model's own initialisation "
                         "of them")
