"""The global batch's token mean under data parallelism, however unevenly ``-100`` labels fall on the replicas.

Each batch replica computes next-token cross-entropy as a mean over its own scored tokens, and the gradient
reduction averages the replicas. That average is the mean of the replicas' means, not the mean over the global
batch's tokens that one process computes on the whole batch (transformers' Trainer weighs by
``num_items_in_batch`` for the same reason). Weighting replica ``r``'s mean by ``n_r / (N / R)`` (its scored tokens
``n_r`` over the global batch's ``N`` per replica, ``R`` replicas) makes the average exact; a replica that scores no
token adds 0.

:class:`ReplicaTokens` sums the counts over the data-parallel group. Every rank of that group calls it in the same
order, once per batch (training and evaluation alike), with the count of its replica's batch: context-parallel
ranks of one replica pass the same whole-batch count, so the group's mean is still ``N / R``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_merak.parallel.context.model import IGNORE_INDEX, ContextParallelForward
from lightning_merak.parallel.layout import LayoutGroups

__all__ = ["ReplicaTokens", "TokenWeightedLoss", "scored_tokens", "token_mean_loss", "weigh_replica_tokens"]


def scored_tokens(targets: Tensor) -> Tensor:
    """Tokens a next-token loss scores in ``targets`` ``[samples, tokens]``: every label but each sample's first,
    less those set to ``-100``."""
    return (targets[:, 1:] != IGNORE_INDEX).sum()


class ReplicaTokens:
    """Scored-token counts averaged over ``group``, the ranks that hold different samples of one global batch
    (None or a group of one: a single replica, no collective)."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)

    def per_replica(self, scored: Tensor) -> Tensor:
        """``N / R`` (float64): the global batch's scored tokens per replica, from this replica's ``scored`` (a
        collective over the group when it has more than one rank; summed as integers, exactly)."""
        total = scored.detach().to(torch.int64).reshape(()).clone()
        if self.size > 1:
            dist.all_reduce(total, group=self.group)
        return total.to(torch.float64) / self.size


class TokenWeightedLoss:
    """``loss_fn`` (a mean over one micro-batch's scored tokens, ``CausalLMModule.loss_from_logits``'s) times the
    micro-batch's share of its global batch's scored tokens, so the mean over a batch's ``micro_batches``, averaged
    over the batch replicas (``replicas``), is the global batch's mean over its tokens, as one process computes it,
    however unevenly ``-100`` labels fall; a micro-batch scoring no token adds 0 instead of NaN. :meth:`begin` each
    batch first."""

    def __init__(self, loss_fn: Callable[[Any, Any], Tensor], micro_batches: int,
                 replicas: Optional[ReplicaTokens] = None) -> None:
        self._loss_fn, self._micro_batches = loss_fn, micro_batches
        self._replicas = replicas if replicas is not None else ReplicaTokens(None)
        self._mean_tokens = torch.ones(())

    def begin(self, targets: Tensor) -> None:
        """Weigh the micro-batches of the batch whose whole targets (this replica's) are ``targets``; a collective
        over the replicas."""
        per_replica = self._replicas.per_replica(scored_tokens(targets))
        self._mean_tokens = per_replica.clamp(min=1e-30) / self._micro_batches

    def __call__(self, logits: Any, targets: Tensor) -> Tensor:
        loss = self._loss_fn(logits, targets)
        scored = scored_tokens(targets).to(loss.device)
        weighted = loss * (scored / self._mean_tokens.to(loss.device)).to(loss.dtype)
        return torch.where(scored > 0, weighted, torch.zeros_like(weighted))


def token_mean_loss(loss_fn: Callable[[Any, Tensor], Tensor], tokens: ReplicaTokens
                    ) -> Callable[[Any, Tensor], Tensor]:
    """``loss_fn`` (a mean over one batch's scored tokens, ``CausalLMModule.loss_from_logits``'s) weighted by this
    replica's share of the global batch's scored tokens, so the replicas' average is the global token mean: a
    :class:`TokenWeightedLoss` of one micro-batch per call."""
    weights = TokenWeightedLoss(loss_fn, 1, tokens)

    def weighted(logits: Any, targets: Tensor) -> Tensor:
        weights.begin(targets)
        return weights(logits, targets)

    weighted.__wrapped__ = loss_fn  # type: ignore[attr-defined]
    return weighted


def weigh_replica_tokens(module: Any, network: Any, groups: LayoutGroups) -> None:
    """Make the batch replicas' average of ``module``'s next-token loss the global batch's token mean: a network
    with context parallelism scores its shards itself and divides by the tokens per replica; otherwise ``module``'s
    ``loss_from_logits`` is weighted (:func:`token_mean_loss`)."""
    tokens = ReplicaTokens(groups.data_parallel_group)
    forward = getattr(network, "forward", None)
    if isinstance(forward, ContextParallelForward):
        forward.replica_tokens = tokens
    else:
        module.loss_from_logits = token_mean_loss(module.loss_from_logits, tokens)
