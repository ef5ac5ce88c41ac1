"""Ring attention: each rank keeps its query shard and the key/value shards travel around the ring.

At step ``t`` rank ``r`` holds the key/value shard of rank ``r - t`` and sends it on to ``r + 1`` (P2P with
``dist.batch_isend_irecv``) while it attends to it, merging the step's ``(out, lse)`` into its running result.
Backward passes the key/value shards around again, each followed one step behind by its accumulated key/value
gradient, so after ``cp`` steps every shard's gradient arrives home; query gradients stay local. The kernels'
backward takes the merged ``(out, lse)``, so the gradients are exact, not an approximation per block.

Masks follow the tokens' global positions, so any sharding works; in the load-balanced layout
(:class:`~lightning_merak.parallel.context.sharding.LoadBalancedLayout`) each step is one kernel call and every
rank does the same causal work.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_merak.parallel.context.blockwise import attend_block, attend_block_backward, merge_attention

__all__ = ["check_positions", "gather_document_ids", "ring_attention"]

_KEY_TAG, _VALUE_TAG, _KEY_GRAD_TAG, _VALUE_GRAD_TAG = range(4)
"""P2P tags: the forward-moving shards and their gradients travel between the same neighbours at once."""


class _RingNeighbours:
    """The global ranks a group rank sends to (next) and receives from (previous)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.send_to = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.receive_from = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start_exchange(self, sends: Sequence[Tensor], receives: Sequence[Tensor], tags: Sequence[int]) -> list:
        """Send ``sends`` to the next rank and receive ``receives`` from the previous one; returns the requests."""
        operations = [dist.P2POp(dist.isend, each, self.send_to, self.group, tag) for each, tag in zip(sends, tags)]
        operations += [
            dist.P2POp(dist.irecv, each, self.receive_from, self.group, tag) for each, tag in zip(receives, tags)
        ]
        return dist.batch_isend_irecv(operations)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    """Forward and backward rings; saves only this rank's q, k, v, merged output and lse (as flash attention does)."""

    @staticmethod
    def forward(ctx, query, key, value, group, positions, document_ids, causal, sliding_window, scale):
        ring = _RingNeighbours(group)
        key, value = key.contiguous(), value.contiguous()
        options = {"causal": causal, "sliding_window": sliding_window, "scale": scale}
        receive_buffers = [(torch.empty_like(key), torch.empty_like(value)) for _ in range(min(2, ring.size - 1))]
        current = (key, value)
        out = lse = None
        for step in range(ring.size):
            requests = []
            if step < ring.size - 1:
                incoming = receive_buffers[step % 2]
                requests = ring.start_exchange(current, incoming, (_KEY_TAG, _VALUE_TAG))
            block_out, block_lse = attend_block(
                query, *current, **_block_coordinates(ring, step, positions, document_ids), **options
            )
            if out is None:  # accumulate in float32 (float64 for float64 inputs), round once at the end
                out, lse = block_out.to(torch.promote_types(block_out.dtype, torch.float32)), block_lse
            else:
                out, lse = merge_attention(out, lse, block_out, block_lse)
            _wait(requests)
            if requests:
                current = incoming
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.positions, ctx.document_ids, ctx.options = group, positions, document_ids, options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        ring = _RingNeighbours(ctx.group)
        grad_out = grad_out.contiguous()
        kv_buffers = [(torch.empty_like(key), torch.empty_like(value)) for _ in range(min(2, ring.size - 1))]
        current = (key, value)
        grad_query = None
        shard_grads: tuple[Tensor, Tensor] | None = None  # the held shard's key/value gradient, summed so far
        grad_buffers: list[tuple[Tensor, Tensor]] = []  # receive into one while the other, filled last step, is sent
        grad_requests: list = []
        for step in range(ring.size):
            kv_requests = []
            if step < ring.size - 1:
                incoming = kv_buffers[step % 2]
                kv_requests = ring.start_exchange(current, incoming, (_KEY_TAG, _VALUE_TAG))
            block_grad_query, block_grad_key, block_grad_value = attend_block_backward(
                grad_out, query, *current, out, lse,
                **_block_coordinates(ring, step, ctx.positions, ctx.document_ids), **ctx.options,
            )
            grad_query = block_grad_query if grad_query is None else grad_query.add_(block_grad_query)
            if step == 0:
                shard_grads = (block_grad_key, block_grad_value)
                if ring.size > 1:
                    grad_buffers = [tuple(torch.empty_like(each) for each in shard_grads) for _ in range(2)]
            else:
                _wait(grad_requests)
                shard_grads = grad_buffers[(step - 1) % 2]
                shard_grads[0].add_(block_grad_key)
                shard_grads[1].add_(block_grad_value)
            if ring.size > 1:
                tags = (_KEY_GRAD_TAG, _VALUE_GRAD_TAG)
                grad_requests = ring.start_exchange(shard_grads, grad_buffers[step % 2], tags)
            _wait(kv_requests)
            if kv_requests:
                current = incoming
        _wait(grad_requests)  # the last hop brings this rank's own shard's gradient home
        grad_key, grad_value = grad_buffers[(ring.size - 1) % 2] if ring.size > 1 else shard_grads
        return (
            grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
            None, None, None, None, None, None,
        )


def _block_coordinates(
    ring: _RingNeighbours, step: int, positions: Tensor, document_ids: Sequence[Tensor] | None
) -> dict[str, Tensor | None]:
    """Positions and document ids of this rank's queries and of the key/value shard it holds at ``step``."""
    source = (ring.rank - step) % ring.size
    return {
        "query_positions": positions[ring.rank],
        "key_positions": positions[source],
        "query_document_ids": None if document_ids is None else document_ids[ring.rank],
        "key_document_ids": None if document_ids is None else document_ids[source],
    }


def gather_document_ids(document_ids: Tensor, group: dist.ProcessGroup) -> list[Tensor]:
    """Every group rank's ``(batch, seq_local)`` document ids (one small all-gather), indexed by group rank."""
    document_ids = document_ids.contiguous()
    gathered = [torch.empty_like(document_ids) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, document_ids, group=group)
    return gathered


def check_positions(positions: Tensor, group: dist.ProcessGroup, local_length: int) -> None:
    """Refuse a positions table that is not ``(group size, local sequence length)``."""
    expected = (dist.get_world_size(group), local_length)
    if tuple(positions.shape) != expected:
        raise ValueError(
            f"positions must hold every rank's global positions, shape {expected} "
            f"(LoadBalancedLayout.rank_positions()), got {tuple(positions.shape)}"
        )


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    group: dist.ProcessGroup,
    *,
    positions: Tensor,
    document_ids: Tensor | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """Attention of this rank's queries over every rank's keys, with exact gradients for query, key and value.

    ``query`` ``(batch, heads, seq_local, head_dim)`` and ``key``/``value`` ``(batch, key_heads, seq_local,
    head_dim)`` are this rank's shard (transformers layout; ``key_heads`` dividing ``heads``). ``positions`` is
    ``(group size, seq_local)``: every group rank's global token positions, the same on all ranks and on the CPU
    (``LoadBalancedLayout.rank_positions()``). ``document_ids`` ``(batch, seq_local)`` are this rank's tokens'
    packed-document ids (gathered from all ranks once). Returns this rank's ``(batch, heads, seq_local, head_dim)``.
    """
    check_positions(positions, group, query.shape[2])
    all_document_ids = None if document_ids is None else gather_document_ids(document_ids, group)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(query, key, value, group, positions, all_document_ids, causal, sliding_window, scale)
