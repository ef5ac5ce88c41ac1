"""Load-balanced sharding of the sequence over the context-parallel ranks.

Under a causal mask, token ``p`` attends to ``p + 1`` keys, so cutting the sequence into ``cp`` contiguous
pieces gives the last rank ``2 cp - 1`` times the work of the first. Cutting it into ``2 cp`` equal chunks and
giving rank ``r`` chunks ``r`` and ``2 cp - 1 - r`` pairs a light chunk with a heavy one: every rank then
attends to the same number of (query, key) pairs.

Everything here is pure tensor indexing: no process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["LoadBalancedLayout", "check_sequence_divisible", "document_ids_from_position_ids"]


def check_sequence_divisible(sequence_length: int, context_parallel: int) -> None:
    """Refuse a sequence that does not cut into ``2 x context_parallel`` equal chunks, naming the fix."""
    if context_parallel < 1:
        raise ValueError(f"context_parallel must be at least 1, got {context_parallel}")
    chunks = 2 * context_parallel
    if sequence_length % chunks:
        raise ValueError(
            f"sequence length {sequence_length} is not divisible by 2 x context_parallel={context_parallel}; "
            f"pad to a multiple of {chunks}"
        )


def document_ids_from_position_ids(position_ids: Tensor) -> Tensor:
    """Per-token document ids ``(batch, seq)`` from position ids that restart at 0 for each packed document.

    This is transformers' packed convention (``DataCollatorWithFlattening``). Call it on the whole sequence,
    before sharding: a shard's second chunk does not start a document, so ids derived from a shard would be wrong.
    A row whose first position is not 0 (a document cut by the packer) still starts a document there.
    """
    starts = position_ids == 0
    starts[..., 0] = True
    return starts.cumsum(dim=-1) - 1


@dataclass(frozen=True)
class LoadBalancedLayout:
    """Where each context-parallel rank's tokens sit in the full sequence: chunks ``r`` and ``2 cp - 1 - r``.

    ``shard`` and ``unshard`` are inverse; ``positions(rank)`` are the global positions of a rank's tokens,
    which attention masks with (and which a model without packed documents uses as its position ids).
    """

    sequence_length: int
    context_parallel: int

    def __post_init__(self) -> None:
        check_sequence_divisible(self.sequence_length, self.context_parallel)

    @property
    def chunk_length(self) -> int:
        return self.sequence_length // (2 * self.context_parallel)

    @property
    def local_length(self) -> int:
        """Tokens each rank holds."""
        return 2 * self.chunk_length

    def chunks(self, rank: int) -> tuple[int, int]:
        """The indices of the two chunks ``rank`` holds, in the order it stores them."""
        if not 0 <= rank < self.context_parallel:
            raise ValueError(f"rank {rank} is outside context_parallel={self.context_parallel}")
        return rank, 2 * self.context_parallel - 1 - rank

    def positions(self, rank: int) -> Tensor:
        """Global positions ``(local_length,)`` of ``rank``'s tokens (int64, CPU: masks are planned on the host)."""
        return torch.cat([
            torch.arange(chunk * self.chunk_length, (chunk + 1) * self.chunk_length) for chunk in self.chunks(rank)
        ])

    def rank_positions(self) -> Tensor:
        """Every rank's global positions, ``(context_parallel, local_length)``: row ``r`` is ``positions(r)``."""
        return torch.stack([self.positions(rank) for rank in range(self.context_parallel)])

    def shard(self, tensor: Tensor, rank: int, dim: int = 1) -> Tensor:
        """``rank``'s share of a tensor holding the whole sequence along ``dim`` (a new contiguous tensor)."""
        self._check_length(tensor, dim)
        pieces = tensor.chunk(2 * self.context_parallel, dim=dim)
        return torch.cat([pieces[chunk] for chunk in self.chunks(rank)], dim=dim)

    def unshard(self, shards: Sequence[Tensor], dim: int = 1) -> Tensor:
        """The whole sequence from every rank's shard (``shards[r]`` from rank ``r``): the inverse of ``shard``."""
        if len(shards) != self.context_parallel:
            raise ValueError(f"expected {self.context_parallel} shards (one per rank), got {len(shards)}")
        ordered: list[Tensor | None] = [None] * (2 * self.context_parallel)
        for rank, shard in enumerate(shards):
            if shard.shape[dim] != self.local_length:
                raise ValueError(
                    f"rank {rank}'s shard has {shard.shape[dim]} tokens along dim {dim}, expected {self.local_length}"
                )
            first, second = shard.split(self.chunk_length, dim=dim)
            low, high = self.chunks(rank)
            ordered[low], ordered[high] = first, second
        return torch.cat(ordered, dim=dim)

    def shard_document_ids(
        self, rank: int, *, document_ids: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """``rank``'s per-token document ids ``(batch, local_length)`` for a packed batch.

        Give the whole sequence's ``document_ids`` or its restarting ``position_ids`` (exactly one); the ids are
        derived before sharding, so every token keeps the document it has in the full sequence.
        """
        if (document_ids is None) == (position_ids is None):
            raise ValueError("give exactly one of document_ids or position_ids (restarting at 0 per document)")
        if document_ids is None:
            document_ids = document_ids_from_position_ids(position_ids)
        return self.shard(document_ids, rank, dim=-1)

    def _check_length(self, tensor: Tensor, dim: int) -> None:
        if tensor.shape[dim] != self.sequence_length:
            raise ValueError(
                f"tensor has {tensor.shape[dim]} tokens along dim {dim}, but the layout is for "
                f"sequence length {self.sequence_length}"
            )
