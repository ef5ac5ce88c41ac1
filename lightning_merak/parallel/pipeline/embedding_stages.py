"""The input embedding split by vocabulary rows over the pipeline ranks, beside the split LM head (``vocab_stages``).

Left whole on the first stage, a large vocabulary's embedding makes that stage the fullest: at vocabulary 128k and
width 4096 its table, gradient and Adam state are 8 GiB against a block's 0.8. Split like the head
(:mod:`.vocab_stages`), every pipeline rank holds rows ``[r·c, min((r+1)·c, V))``, ``c = ⌈V/pp⌉``, of the table
(:class:`EmbeddingRows`, a DTensor sharded ``Shard(0)`` over the pipeline mesh with the table's whole shape, so a
sharded checkpoint holds it under its own name and any layout resumes it). A tied head and embedding are one
weight split once.

The first stage looks up every micro-batch's tokens, so before a step's schedule
(:meth:`EmbeddingExchange.begin`) it sends the step's distinct token ids to the other pipeline ranks, each fills
the rows it holds and a reduce (a sum in which every row has one non-zero term, so exact) hands the first stage
the table of just those rows; the first stage's lookups index it, whichever micro-batch or shape-inference pass
asks. After the schedule (:meth:`EmbeddingExchange.end`) the first stage broadcasts that table's gradient and
every rank adds its rows' part to its weight's gradient. Both exchange at most ``min(distinct tokens, V) × width``
values per step, once, outside the schedule: a step's cost, not a micro-batch's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_merak.distributed.dtensors import local_tensor
from lightning_merak.parallel.data.gather_waits import ReadsOutsideForward
from lightning_merak.parallel.pipeline.row_scatter import add_rows_gradient, rows_dtensor, scatter_rows
from lightning_merak.util.row_shards import row_shard_range

__all__ = ["EMBEDDING_STAGE_SCHEDULES", "EmbeddingExchange", "EmbeddingRows", "average_rows_gradients",
           "embedding_split_problem", "split_embedding_over_stages", "split_vocabulary_parameters"]

EMBEDDING_STAGE_SCHEDULES = ("1f1b", "gpipe", "shifted_critical_path", "interleaved_1f1b")
"""Schedules whose backward reaches the looked-up rows (a leaf of the first stage's graph, not a parameter): the
zero-bubble schedules compute weight gradients for the stage's parameters only. ``shifted_critical_path``'s
recomputed cool-down forwards look their tokens up again in the same step table, with no exchange."""

_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The embedding dtypes the first stage can announce to the others at build (by index)."""


def embedding_split_problem(embedding: Optional[nn.Module], schedule: str = "1f1b") -> Optional[str]:
    """Why ``embedding`` (the model's ``get_input_embeddings()``) cannot be split by rows over the pipeline ranks
    under ``schedule``, or None. Only a plain ``nn.Embedding`` is: a subclass may compute more than the lookup (a
    scaled embedding)."""
    if schedule not in EMBEDDING_STAGE_SCHEDULES:
        return (f"schedule {schedule!r} computes weight gradients for parameters only, which would miss the "
                "embedding's looked-up rows")
    if type(embedding) is not nn.Embedding:
        return f"the input embedding is {type(embedding).__name__}, not an nn.Embedding"
    if embedding.max_norm is not None:
        return "the input embedding renormalises its rows (max_norm)"
    if embedding.scale_grad_by_freq or embedding.sparse:
        return "the input embedding scales its gradient by frequency or makes it sparse"
    weight_hooks = (getattr(embedding.weight, name, None)
                    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"))
    if embedding._forward_hooks or embedding._forward_pre_hooks or any(weight_hooks):
        return ("something watches the input embedding (its hooks: a callback such as SparseCommunication reading "
                "its lookups or gradient), which replacing the module would drop")
    return None


class EmbeddingRows(ReadsOutsideForward):
    """This rank's rows ``[start, end)`` of the input embedding: ``weight`` is a DTensor sharded by rows over the
    pipeline mesh with the table's whole shape. On the first stage a call looks its tokens up in the step's table
    (:meth:`EmbeddingExchange.begin`, which reads the rows before any forward)."""

    def __init__(self, weight: nn.Parameter, padding_idx: Optional[int]) -> None:
        super().__init__()
        self.weight = weight
        self.padding_idx = padding_idx
        self.vocab_size = weight.shape[0]
        mesh = weight.device_mesh
        self.start, self.end = row_shard_range(self.vocab_size, mesh.size(), mesh.get_local_rank())
        self.tokens: Optional[torch.Tensor] = None
        """The step's distinct token ids, ascending."""
        self.table: Optional[torch.Tensor] = None
        """Their rows, one per token id (first stage only)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.table is None or self.tokens is None:
            raise RuntimeError("the split input embedding is looked up through its EmbeddingExchange: begin() the "
                               "step's exchange before running the first stage")
        positions = torch.searchsorted(self.tokens, input_ids).clamp(max=self.tokens.numel() - 1)
        if not torch.equal(self.tokens[positions], input_ids):
            raise RuntimeError("the first stage looked up token ids outside the step's batch; the split input "
                               "embedding serves the tokens of the batch the step was given only")
        return F.embedding(positions, self.table)


class EmbeddingExchange:
    """The split embedding's step collectives over ``group`` (this replica's pipeline ranks): the rows the first
    stage (global rank ``source``) looks up, and their gradient back. Every rank of the group calls
    :meth:`begin` and :meth:`end` in the same order; only the first stage's ``input_ids`` are read."""

    def __init__(self, rows: EmbeddingRows, group: dist.ProcessGroup, source: int, is_first: bool,
                 device: torch.device, first_ranks: int = 1) -> None:
        self.rows, self.group, self.source, self.is_first, self.device = rows, group, source, is_first, device
        self.first_ranks = first_ranks
        """Ranks running the first stage (its tensor-parallel ranks): each looks the tokens up."""

    def begin(self, input_ids: Optional[torch.Tensor], backward: bool) -> None:
        """Gather the rows of ``input_ids``'s distinct tokens onto the first stage (its table requires a gradient
        when ``backward``)."""
        if self.is_first:
            tokens = torch.unique(input_ids.to(self.device))
            count = torch.tensor([tokens.numel()], dtype=torch.long, device=self.device)
        else:
            count = torch.zeros(1, dtype=torch.long, device=self.device)
        dist.broadcast(count, src=self.source, group=self.group)
        if not self.is_first:
            tokens = torch.empty(int(count.item()), dtype=torch.long, device=self.device)
        dist.broadcast(tokens, src=self.source, group=self.group)
        self.rows.before_reads()  # a ZeRO-1 gather of the rows may still be in flight
        weight = self.rows.weight.to_local()
        inside = (tokens >= self.rows.start) & (tokens < self.rows.end)
        table = torch.zeros(tokens.numel(), weight.shape[1], dtype=weight.dtype, device=self.device)
        table[inside] = weight.detach()[tokens[inside] - self.rows.start]
        if self.first_ranks > 1:
            dist.all_reduce(table, group=self.group)
        else:
            dist.reduce(table, dst=self.source, group=self.group)
        self.rows.tokens = tokens
        if self.is_first:
            self.rows.table = table.requires_grad_(backward and self.rows.weight.requires_grad)

    def end(self, backward: bool) -> None:
        """Close the step: with ``backward``, every rank adds its rows' part of the table's gradient (the first
        stage's first rank's: its tensor-parallel ranks' are the same) to its weight's gradient (set where it has
        none)."""
        tokens, table = self.rows.tokens, self.rows.table
        self.rows.tokens = self.rows.table = None
        if not backward or not self.rows.weight.requires_grad:
            return
        assert tokens is not None
        weight = self.rows.weight
        local = weight.to_local()
        if self.is_first and table is not None and table.grad is not None:
            grad_table = table.grad
        else:
            grad_table = torch.zeros(tokens.numel(), local.shape[1], dtype=local.dtype, device=self.device)
        dist.broadcast(grad_table, src=self.source, group=self.group)
        inside = (tokens >= self.rows.start) & (tokens < self.rows.end)
        if self.rows.padding_idx is not None:
            inside &= tokens != self.rows.padding_idx
        add_rows_gradient(weight, torch.zeros_like(local).index_add_(0, tokens[inside] - self.rows.start,
                                                                      grad_table[inside]))


def split_embedding_over_stages(stages: nn.ModuleList, path: str, mesh: DeviceMesh, group: dist.ProcessGroup,
                                device: torch.device, tied_weight: Optional[nn.Parameter] = None,
                                tensor_parallel: int = 1, allocate: bool = False) -> EmbeddingExchange:
    """Put this rank's :class:`EmbeddingRows` in place of the input embedding at ``path`` (in its first stage's
    model, with several stages per rank: the one that has the embedding on the first rank) and return the
    exchange. ``tied_weight``: the split head's weight, which a tied embedding shares.

    Untied, the first stage sends every rank its rows of the table (a scatter over ``mesh``'s group, at build), or
    with ``allocate`` each rank allocates its rows for a pretrained loader to fill (the embedding on meta).
    """
    stage = next((part for part in stages if part.is_first), stages[0])
    first = dist.get_global_rank(mesh.get_group(), 0)
    sizes = torch.zeros(5, dtype=torch.long, device=device)
    holds = mesh.get_local_rank() == 0  # the first stage's first tensor-parallel rank
    if holds:
        embedding = stage.net.get_submodule(path)
        padding = -1 if embedding.padding_idx is None else embedding.padding_idx
        sizes = torch.tensor([*embedding.weight.shape, padding, _TABLE_DTYPES.index(embedding.weight.dtype),
                              embedding.weight.requires_grad], dtype=torch.long, device=device)
    dist.broadcast(sizes, src=first, group=mesh.get_group())
    vocab_size, width, padding, dtype, trainable = sizes.tolist()
    if tied_weight is not None:
        weight = tied_weight
    else:
        if allocate:
            start, end = row_shard_range(vocab_size, mesh.size(), mesh.get_local_rank())
            local = torch.empty((end - start, width), dtype=_TABLE_DTYPES[dtype], device=device)
        else:
            table = stage.net.get_submodule(path).weight.detach() if holds else None
            local = scatter_rows(table, vocab_size, (width,), _TABLE_DTYPES[dtype], device, mesh.get_group(), 0)
        weight = nn.Parameter(rows_dtensor(local, vocab_size, mesh), bool(trainable))
    rows = EmbeddingRows(weight, None if padding < 0 else padding)
    stage.net.set_submodule(path, rows)
    return EmbeddingExchange(rows, group, first, stage.is_first, device, first_ranks=tensor_parallel)


def split_vocabulary_parameters(stages: nn.Module, trainable_only: bool = True) -> list[nn.Parameter]:
    """The parameters of ``stages``' (a ``RankStages``) split head (with its LoRA factors) and embedding, each
    once: the trainable ones, or with ``trainable_only=False`` the frozen ones too (the rows a frozen base keeps)."""
    vocabulary = stages.vocabulary
    head = None if vocabulary is None else vocabulary.lora if vocabulary.lora is not None else vocabulary.head
    holders = [head, stages.embedding.rows if stages.embedding is not None else None]
    found = {id(param): param for holder in holders if holder is not None
             for param in holder.parameters() if param.requires_grad or not trainable_only}
    return list(found.values())


def average_rows_gradients(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average the rows' gradients over the data-parallel ``group`` (where FSDP2 reduces every other parameter's,
    under ``data_parallel_sharding='full'``, and leaves these alone)."""
    grads = [local_tensor(param.grad) for param in params if param.grad is not None]
    if not grads:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    for grad, part in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(part.view_as(grad))
