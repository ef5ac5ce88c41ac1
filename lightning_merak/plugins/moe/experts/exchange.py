"""Expert ownership and the dropless exchange of token copies between expert-parallel ranks (pure core).

Rank ``r`` of ``ep`` owns experts ``[r*E/ep, (r+1)*E/ep)``: contiguous, as DeepSpeed and
:func:`~lightning_merak.plugins.moe.core.placement.owner_of` lay them out, so routes sorted by global
expert are already grouped by destination rank. From the ``[ep, E]`` count matrix (identical on every
rank after one all-gather) each rank derives its send and receive splits and the permutation that
turns its received rows (source-major) into expert-major segments. This is the no-replica, one-chunk,
dropless case of :class:`~lightning_merak.plugins.moe.core.dispatch.ExchangeLayout`, computed with a
few tensor ops instead of per-block Python so it costs nothing at 64-256 experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DroplessExchange", "local_expert_range"]


def local_expert_range(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """The global expert ids expert-parallel rank ``ep_rank`` holds: the one source of truth for ownership."""
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} is not a rank of an expert group of size {ep_size}")
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split evenly over {ep_size} expert-parallel ranks; "
                         f"choose an expert-parallel size that divides {num_experts}")
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


@dataclass(frozen=True)
class DroplessExchange:
    """One layer's exchange on one rank: splits for both all-to-alls and the expert-major permutation."""

    send_splits: list[int]
    recv_splits: list[int]
    expert_rows: list[int]
    recv_to_expert_major: torch.Tensor
    local_expert_ids: torch.Tensor
    expert_major_to_recv: torch.Tensor
    """The inverse of ``recv_to_expert_major``: expert outputs back in the received (source-major) order."""

    @classmethod
    def build(cls, counts: torch.Tensor, ep_rank: int) -> DroplessExchange:
        """From ``counts[r, e]``, the routes rank ``r`` sends to global expert ``e`` (a CPU tensor)."""
        ep_size, num_experts = counts.shape
        mine = local_expert_range(num_experts, ep_rank, ep_size)
        per_rank = len(mine)
        send_splits = counts[ep_rank].view(ep_size, per_rank).sum(1).tolist()
        received = counts[:, mine.start:mine.stop]
        recv_splits = received.sum(1).tolist()
        expert_rows = received.sum(0).tolist()
        expert_of_row = torch.arange(per_rank).repeat(ep_size).repeat_interleave(received.reshape(-1))
        order = torch.sort(expert_of_row, stable=True)
        inverse = torch.empty_like(order.indices)
        inverse[order.indices] = torch.arange(order.indices.numel())
        return cls(send_splits, recv_splits, expert_rows, order.indices, order.values, inverse)
