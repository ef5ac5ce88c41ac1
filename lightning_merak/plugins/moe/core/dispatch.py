"""Where every routed token goes: the layout of the exchange buffer, and encode/decode.

Both dispatch paths share one layout. A (source rank, expert) *block* holds the
routes of that source to that expert in gate "location" order, so a route's row in
its block is its location. The capacity path pads every block to DeepSpeed's
capacity (equal splits: DeepSpeed's padded all-to-all); the dropless path sizes
each block by its count and exchanges with ``all_to_all_single`` split sizes.

Blocks a rank computes itself as a replica are kept out of the all-to-all. Lancet
chunking cuts every block into ``chunks`` nearly equal row ranges; chunk ``c`` of
all blocks forms one all-to-all. Gating happened once on the full batch, so chunking
never changes which tokens are kept.

The local buffer (one row per block row) is ``[sent rows | replica rows]``; sent rows
are ordered (chunk, destination rank, expert, row), replica rows (plan order, row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_merak.plugins.moe.core.placement import Counts, Padding, PlacementPlan, block_rows, replica_rows

__all__ = ["ExchangeLayout", "chunk_sizes", "decode", "encode", "routes_from_dense"]


def chunk_sizes(rows: int, chunks: int) -> list[int]:
    """``rows`` split into ``chunks`` parts, the first ``rows % chunks`` one larger."""
    base, extra = divmod(rows, chunks)
    return [base + (1 if c < extra else 0) for c in range(chunks)]


@dataclass
class ExchangeLayout:
    """The exchange of one layer on one EP rank, derived from data identical on all ranks."""

    rank: int
    ep_size: int
    experts_per_rank: int
    chunks: int
    send_splits: list[list[int]]
    recv_splits: list[list[int]]
    recv_by_expert: list[torch.Tensor]
    expert_rows: list[list[int]]
    replica_segments: list[tuple[int, int, int]]
    num_sent: int
    block_position: torch.Tensor
    block_offset: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.num_sent + sum(length for _, _, length in self.replica_segments)

    @classmethod
    def build(
        cls,
        rank: int,
        counts: Counts,
        plan: PlacementPlan,
        padding: Padding,
        experts_per_rank: int,
        chunks: int,
    ) -> ExchangeLayout:
        if chunks < 1:
            raise ValueError(f"chunks must be at least 1, got {chunks}")
        ep_size = len(counts)
        num_experts = ep_size * experts_per_rank
        rows = block_rows(counts, plan, padding)
        split = [[chunk_sizes(n, chunks) for n in row] for row in rows]
        mine = range(rank * experts_per_rank, (rank + 1) * experts_per_rank)

        send_splits = [[0] * ep_size for _ in range(chunks)]
        recv_splits = [[0] * ep_size for _ in range(chunks)]
        positions: list[list[torch.Tensor]] = [[] for _ in range(num_experts)]
        cursor = 0
        for c in range(chunks):
            for dest in range(ep_size):
                for e in range(dest * experts_per_rank, (dest + 1) * experts_per_rank):
                    n = split[rank][e][c]
                    positions[e].append(torch.arange(cursor, cursor + n))
                    cursor += n
                    send_splits[c][dest] += n
            for src in range(ep_size):
                recv_splits[c][src] = sum(split[src][e][c] for e in mine)
        num_sent = cursor

        replica_segments = []
        for rep in plan.hosted_by(rank):
            n = replica_rows(counts, rank, rep.expert, padding)
            positions[rep.expert] = [torch.arange(cursor, cursor + n)]
            replica_segments.append((rep.expert, cursor, n))
            cursor += n

        recv_by_expert, expert_rows = [], []
        for c in range(chunks):
            offsets, start = {}, 0
            for src in range(ep_size):
                for e in mine:
                    offsets[src, e] = start
                    start += split[src][e][c]
            order = [
                torch.arange(offsets[src, e], offsets[src, e] + split[src][e][c])
                for e in mine for src in range(ep_size)
            ]
            recv_by_expert.append(torch.cat(order) if order else torch.zeros(0, dtype=torch.long))
            expert_rows.append([sum(split[src][e][c] for src in range(ep_size)) for e in mine])

        flat = [torch.cat(p) if p else torch.zeros(0, dtype=torch.long) for p in positions]
        sizes = torch.tensor([len(p) for p in flat], dtype=torch.long)
        block_offset = torch.cumsum(sizes, 0) - sizes
        block_position = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long)
        return cls(rank, ep_size, experts_per_rank, chunks, send_splits, recv_splits, recv_by_expert,
                   expert_rows, replica_segments, num_sent, block_position, block_offset)

    def route_rows(self, indices: torch.Tensor, locations: torch.Tensor) -> torch.Tensor:
        """Buffer row of every route ``[k, S]``; dropped routes (index −1) point at the zero row."""
        kept = indices >= 0
        experts = indices.long().clamp(min=0)
        slot = self.block_offset.to(indices.device)[experts] + locations.long()
        slot = torch.where(kept, slot, torch.zeros_like(slot))
        table = self.block_position.to(indices.device)
        rows = table[slot] if table.numel() else torch.zeros_like(slot)
        return torch.where(kept, rows, torch.full_like(rows, self.num_rows))


def encode(tokens: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Gather tokens ``[S, M]`` into the ``[num_rows, M]`` buffer; empty rows stay zero."""
    num_tokens, d_model = tokens.shape
    source = torch.full((num_rows + 1,), num_tokens, dtype=torch.long, device=tokens.device)
    token_ids = torch.arange(num_tokens, device=tokens.device).expand_as(rows)
    source.scatter_(0, rows.reshape(-1), token_ids.reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, d_model)])
    return padded.index_select(0, source[:num_rows])


def decode(expert_out: torch.Tensor, rows: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Each token's gate-weighted sum of its routes' expert outputs (fp32 accumulation)."""
    d_model = expert_out.size(-1)
    padded = torch.cat([expert_out, expert_out.new_zeros(1, d_model)])
    routed = padded.index_select(0, rows.reshape(-1)).view(*rows.shape, d_model)
    return (routed * gates.unsqueeze(-1)).sum(0).to(expert_out.dtype)


def routes_from_dense(combine_weights: torch.Tensor, dispatch_mask: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """DeepSpeed ≤0.19.3 gates return dense ``[S, E, C]`` tensors; turn them into ``[k, S]`` routes."""
    num_tokens, _, capacity = dispatch_mask.shape
    flags, slots = dispatch_mask.reshape(num_tokens, -1).float().topk(k, dim=1)
    kept = flags > 0
    indices = torch.where(kept, slots // capacity, torch.full_like(slots, -1))
    gates = combine_weights.reshape(num_tokens, -1).gather(1, slots) * kept
    return indices.t(), (slots % capacity).t(), gates.t(), torch.tensor(capacity)
