"""Context parallelism inside pipeline stages: every stage runs its blocks on this rank's shard of the sequence.

With ``pipeline_parallel > 1`` the model is cut into stages (:mod:`lightning_merak.parallel.pipeline.stage`), and
only the first stage calls the model's forward, where :class:`~.model.ContextParallelForward` takes this rank's
load-balanced shard of the tokens and sets the shard every attention call reads. Later stages receive the hidden
state of that shard (and the side tensors computed for its positions: rotary tables), so
:class:`ContextStageForward` sets the same shard from the received sequence length before their blocks run. The
last stage's logits are this rank's rows of the sequence: :func:`context_parallel_stage_loss` scores them against
the targets shifted on the whole sequence and sums the shards' parts over the context-parallel group, the whole
micro-batch's mean cross-entropy on every rank of the group (its backward scales this rank's part by the group
size, which the data-parallel average over ``dp x cp`` turns into the sum of the parts, as without stages).

Variable-length micro-batches (``micro_batching``) run the same way, each micro-batch's length a multiple of
``2 x cp``; the last stage sums its rows' token losses over the group (:func:`summed_shard_loss`). Rows packed with
several documents need every stage to keep them apart: the first stage computes this rank's document ids from the
restarting positions, and they travel with the hidden state to the next stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_merak.parallel.context.model import (
    IGNORE_INDEX,
    ContextShard,
    ContextState,
    SumOverGroup,
    gather_sequence,
    install_context_parallel,
    next_token_labels,
)
from lightning_merak.parallel.context.sharding import LoadBalancedLayout
from lightning_merak.parallel.layout import LayoutGroups

__all__ = ["ContextStageForward", "context_parallel_stage_loss", "gather_stage_logits",
           "install_context_parallel_layout", "sequence_shard", "shard_next_token_labels", "summed_shard_loss"]


class ContextStageForward:
    """A pipeline stage's forward that first sets the context-parallel shard its attention reads; the first stage's
    model call sets it again from the tokens (the same shard).

    With ``carries_documents`` (packed rows: ``micro_batching='pack'``) this rank's document ids of the shard travel
    with the hidden state as the last tensor a stage sends: the first stage's are what its model call computed from
    the restarting positions. Where every row is one sequence it sends a single column instead (the local sequence
    is at least 2 long: lengths are padded to a multiple of 2 × cp), which the next stage tells from its shape, sent
    ahead in the variable-shape header, without reading the ids back to the host.
    """

    def __init__(self, stage: nn.Module, state: ContextState, carries_documents: bool = False) -> None:
        self._forward = stage.forward
        self._state = state
        self._is_first = bool(getattr(stage, "is_first", False))
        self._is_last = bool(getattr(stage, "is_last", False))
        self._carries_documents = carries_documents
        self._size = dist.get_world_size(state.group)

    def __call__(self, *inputs: Tensor, **kwargs: Any) -> Any:
        documents: Optional[Tensor] = None
        if not self._is_first and inputs:
            if self._carries_documents:
                *inputs, documents = inputs  # type: ignore[assignment]
            length = inputs[0].shape[1] * self._size  # hidden [batch, local sequence, width]
            whole_rows = documents is None or documents.shape[1] != inputs[0].shape[1]
            self._state.shard = ContextShard(LoadBalancedLayout(length, self._size).rank_positions(),
                                             None if whole_rows else documents)
        outputs = self._forward(*inputs, **kwargs)
        if not self._carries_documents or self._is_last:
            return outputs
        if self._is_first:
            assert self._state.shard is not None, "the first stage's model call sets the shard"
            hidden = outputs[0]
            documents = self._state.shard.document_ids
            if documents is None:  # every row one sequence: the same on every rank of the group
                documents = torch.full((hidden.shape[0], 1), -1, dtype=torch.long, device=hidden.device)
        assert documents is not None
        return (*outputs, documents.to(outputs[0].device).contiguous())


def install_context_parallel_layout(network: nn.Module, stages: Optional[Sequence[nn.Module]],
                                    groups: LayoutGroups, carries_documents: bool = False) -> None:
    """Context parallelism over ``groups``' context group for the built network: on the whole ``network`` when it
    has no pipeline ``stages``, else on each stage's pruned model, the stage's forward setting the shard its input
    holds (:class:`ContextStageForward`; ``carries_documents``: packed rows' document ids travel between them)."""
    group, method = groups.context_group, groups.layout.context_attention
    assert group is not None, "context parallelism needs the layout's context-parallel group"
    if stages is None:
        install_context_parallel(network, group, method)
        return
    for stage in stages:
        stage.forward = ContextStageForward(stage, install_context_parallel(stage.net, group, method),
                                            carries_documents)


def context_parallel_stage_loss(group: dist.ProcessGroup) -> Callable[[Tensor, Tensor], Tensor]:
    """The last stage's loss on this rank's logits rows ``[batch, sequence / cp, vocab]``: next-token
    cross-entropy of the whole micro-batch ``targets`` ``[batch, sequence]`` (``CausalLMModule.loss_from_logits``'
    mean), the same on every rank of ``group``."""
    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        local, count = shard_next_token_labels(targets, group)
        summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), local.to(logits.device).reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="sum")
        return SumOverGroup.apply(summed / count.clamp(min=1).to(logits.device), group)  # no scored token: 0

    return loss


def summed_shard_loss(logits: Tensor, labels: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The whole sequence's summed cross-entropy from this rank's logits rows ``[batch, sequence / cp, vocab]`` and
    the whole sequence's position-aligned ``labels`` ``[batch, sequence]`` (each position's own target, ``-100``
    skipped), the same on every rank of ``group``; its backward scales this rank's part by the group size, as
    :func:`context_parallel_stage_loss`'s does."""
    local = sequence_shard(labels, group)
    summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), local.to(logits.device).reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="sum")
    return SumOverGroup.apply(summed, group)


def sequence_shard(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """This rank's load-balanced rows of a whole sequence ``[batch, sequence, ...]``, split over ``group``."""
    layout = LoadBalancedLayout(tensor.shape[1], dist.get_world_size(group))
    return layout.shard(tensor, dist.get_rank(group), dim=1)


def shard_next_token_labels(targets: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    """This rank's load-balanced shard of ``targets`` ``[batch, sequence]`` shifted on the whole sequence (each
    position's next token), and how many tokens the whole sequence scores: what a stage scoring its rows of the
    sequence needs (the last stage's loss, the split LM head's exchange)."""
    shifted = next_token_labels(targets)
    return sequence_shard(shifted, group), (shifted != IGNORE_INDEX).sum()


def gather_stage_logits(logits: Tensor, group: dist.ProcessGroup) -> Tensor:
    """This rank's rows of the logits put back into the whole sequence (the same on every rank of ``group``)."""
    size = dist.get_world_size(group)
    return gather_sequence(logits, group, LoadBalancedLayout(logits.shape[1] * size, size))
