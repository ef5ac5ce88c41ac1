"""Ulysses attention: trade the sequence split for a head split with two all-to-alls, attend locally, trade back.

Each rank sends every other rank its tokens of that rank's heads (``dist.all_to_all_single``), so it holds the
whole sequence for ``heads / cp`` heads, runs one attention over it, and returns the output the same way. Each of
``q, k, v`` and the output crosses the wire in one collective (their gradients likewise in backward) instead of
``cp - 1`` ring steps; the price is that ``cp`` must divide the key/value heads.

The gathered sequence arrives rank by rank; it is put in global order (one gather), so a causal mask over the
load-balanced layout is a single call of the kernels' causal attention rather than a patchwork of blocks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_merak.parallel.context.blockwise import attend_block
from lightning_merak.parallel.context.ring import check_positions, gather_document_ids

__all__ = ["check_heads_divisible", "ulysses_attention"]


def check_heads_divisible(key_value_heads: int, context_parallel: int, tensor_parallel: int = 1) -> None:
    """Refuse a head count Ulysses cannot scatter, naming both numbers and the fix; ``key_value_heads`` is the
    model's count, of which each of ``tensor_parallel`` ranks holds a share (at least one) that Ulysses scatters."""
    per_rank = max(key_value_heads // tensor_parallel, 1)
    if per_rank % context_parallel:
        held = (f"{key_value_heads} key/value heads" if tensor_parallel == 1 else
                f"{key_value_heads} key/value heads split over tensor_parallel={tensor_parallel} ranks: {per_rank} "
                "key/value heads per rank,")
        raise ValueError(
            f"Ulysses attention scatters heads over context_parallel={context_parallel} ranks, but the model has "
            f"{held} not divisible by {context_parallel}; use ring attention, or a context_parallel that divides "
            f"{per_rank}" + (", or a smaller tensor_parallel" if tensor_parallel > 1 else "")
        )


def _all_to_all(tensor: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """Cut ``scatter_dim`` into one piece per rank, send piece ``i`` to rank ``i``, lay the received pieces
    (in rank order) end to end along ``gather_dim``."""
    size = dist.get_world_size(group)
    send = torch.stack(tensor.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """``_all_to_all`` whose gradient is the opposite all-to-all."""

    @staticmethod
    def forward(ctx, tensor, group, scatter_dim, gather_dim):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(tensor, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


_HEADS, _SEQUENCE = 1, 2


def ulysses_attention(
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
    """Attention of this rank's queries over every rank's keys, differentiable; same arguments as ring attention.

    ``query`` ``(batch, heads, seq_local, head_dim)``, ``key``/``value`` ``(batch, key_heads, seq_local,
    head_dim)``; ``positions`` ``(group size, seq_local)`` holds every group rank's global token positions (CPU,
    ``LoadBalancedLayout.rank_positions()``); ``document_ids`` ``(batch, seq_local)`` this rank's packed-document
    ids. Raises ``ValueError`` when the group size does not divide ``key_heads``.
    """
    size = dist.get_world_size(group)
    check_heads_divisible(key.shape[_HEADS], size)
    check_positions(positions, group, query.shape[_SEQUENCE])
    gathered_positions = positions.flatten()
    order = torch.argsort(gathered_positions)
    in_order = torch.equal(order, torch.arange(len(order)))
    order_on_device = order.to(query.device)

    def whole_sequence(tensor: Tensor) -> Tensor:
        gathered = _AllToAll.apply(tensor, group, _HEADS, _SEQUENCE)
        return gathered if in_order else gathered.index_select(_SEQUENCE, order_on_device)

    all_document_ids = None
    if document_ids is not None:
        all_document_ids = torch.cat(gather_document_ids(document_ids, group), dim=-1)
        all_document_ids = all_document_ids if in_order else all_document_ids.index_select(-1, order_on_device)
    sorted_positions = gathered_positions[order]
    out, _ = attend_block(
        whole_sequence(query), whole_sequence(key), whole_sequence(value),
        query_positions=sorted_positions, key_positions=sorted_positions, causal=causal,
        sliding_window=sliding_window, query_document_ids=all_document_ids, key_document_ids=all_document_ids,
        scale=scale,
    )
    if not in_order:
        out = out.index_select(_SEQUENCE, torch.argsort(order).to(query.device))
    return _AllToAll.apply(out, group, _SEQUENCE, _HEADS)
