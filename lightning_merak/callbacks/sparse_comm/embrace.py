"""EmbRace: embedding tables column-sharded across the data-parallel ranks.

Each rank keeps the columns ``[V, H_r]`` of a table (column sharding is balanced under
Zipf-distributed ids, row sharding is not). A lookup all-gathers the token ids, looks
up its columns for every rank's tokens and returns them with one all-to-all; backward
sends each owner its columns of the output gradient with the reverse all-to-all, and
the owner adds them into its slice. The tables are kept out of DDP, so they are never
all-reduced, and their optimizer state is sharded for free.

The backward all-to-all is issued asynchronously on the table's own process group and
awaited at the end of the backward pass (an autograd engine callback), so it overlaps
DDP's all-reduce of the last dense buckets. Issue order on that group follows the
model's graph, identical on every rank.

Priority ("rows needed first sent first"): when the ids of the next batch are known
(:meth:`ShardedEmbedding.prioritize`), they travel with this step's id all-gather, and
backward splits the gradient exchange into two all-to-alls launched back to back on the
table's group: first the tokens whose row the next batch looks up, then the rest. The
priority chunk is awaited and added first. Every row's contributions fall in one chunk,
in their original order, so the gradient is the same as without priority;
:attr:`ShardedEmbedding.last_exchange` records when each chunk's rows were in place.

A tied output head (a ``Linear`` whose weight *is* the table) is swapped for
:class:`ShardedTiedHead`: it all-gathers the full table for the logits and
reduce-scatters the head's gradient back to the owners. The head's gradient is dense,
so this costs what a dense all-reduce of the table does; it keeps tied models correct
without editing them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_merak.callbacks.sparse_comm.bytes_counter import CommLedger

EMBEDDING = "embedding"
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def column_bounds(dim: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous column ranges ``[start, stop)`` per rank, sizes differing by at most one."""
    if dim < world_size:
        raise ValueError(
            f"cannot column-shard an embedding of width {dim} over {world_size} ranks; "
            "use fewer ranks or keep this table out of EmbRace (min_table_rows / method='s2')"
        )
    base, extra = divmod(dim, world_size)
    bounds, start = [], 0
    for rank in range(world_size):
        stop = start + base + (1 if rank < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def exchange_chunks(all_ids: torch.Tensor, upcoming_ids: torch.Tensor) -> list[tuple[bool, torch.Tensor]]:
    """``(is_priority, mask over all_ids)`` in sending order: the tokens whose row is among
    ``upcoming_ids`` (needed by the next lookup) first, then the rest; empty chunks dropped."""
    needed = torch.isin(all_ids, upcoming_ids)
    return [(priority, mask) for priority, mask in ((True, needed), (False, ~needed)) if bool(mask.any())]


@dataclass(frozen=True)
class ExchangeTiming:
    """One backward gradient exchange of a table: seconds from launch until the rows of the
    priority chunk, and of all chunks, were added into the slice gradient."""

    priority_rows_s: float | None
    all_rows_s: float
    priority_tokens: int
    tokens: int


class _ShardedLookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, shard: torch.Tensor, ids: torch.Tensor, upcoming: torch.Tensor, table: ShardedEmbedding
    ) -> torch.Tensor:
        group, world_size, rank = table.process_group, table.world_size, table.group_rank
        flat_ids = ids.reshape(-1).to(torch.int64)
        upcoming = upcoming.to(flat_ids.device)
        local_count = torch.tensor([flat_ids.numel(), upcoming.numel()], dtype=torch.int64, device=shard.device)
        counts = torch.empty(2 * world_size, dtype=torch.int64, device=shard.device)
        _all_gather_into_tensor(counts, local_count, group=group)
        per_rank = counts.view(world_size, 2).tolist()
        counts_list = [current for current, _ in per_rank]
        longest = max(current + ahead for current, ahead in per_rank)
        padded = flat_ids.new_zeros(longest)
        padded[: flat_ids.numel()] = flat_ids
        padded[flat_ids.numel() : flat_ids.numel() + upcoming.numel()] = upcoming
        gathered = flat_ids.new_empty(world_size * longest)
        _all_gather_into_tensor(gathered, padded, group=group)
        table.record("all_gather", local_count.numel() * local_count.element_size())
        table.record("all_gather", padded.numel() * padded.element_size())
        blocks = gathered.view(world_size, longest)
        all_ids = torch.cat([blocks[r, :current] for r, (current, _) in enumerate(per_rank)])
        all_upcoming = torch.cat([blocks[r, current : current + ahead] for r, (current, ahead) in enumerate(per_rank)])

        widths = table.widths
        looked_up = shard.index_select(0, all_ids)
        received = shard.new_empty(flat_ids.numel() * table.dim)
        dist.all_to_all_single(
            received, looked_up.reshape(-1),
            output_split_sizes=[flat_ids.numel() * width for width in widths],
            input_split_sizes=[count * widths[rank] for count in counts_list],
            group=group,
        )
        table.record_lookup(counts_list, shard.element_size())
        received_blocks = received.split([flat_ids.numel() * width for width in widths])
        output = torch.cat(
            [block.view(flat_ids.numel(), width) for block, width in zip(received_blocks, widths)], dim=1
        )
        ctx.table = table
        ctx.counts = counts_list
        ctx.save_for_backward(all_ids, all_upcoming.unique())
        return output.view(*ids.shape, table.dim)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, None, None, None]:
        table: ShardedEmbedding = ctx.table
        all_ids, upcoming = ctx.saved_tensors
        widths, rank = table.widths, table.group_rank
        local_tokens = grad_output.numel() // table.dim
        grad = grad_output.reshape(local_tokens, table.dim)
        launched = time.perf_counter()
        chunks = []
        for priority, mask in exchange_chunks(all_ids, upcoming):
            chunk_counts = [int(part.sum()) for part in mask.split(ctx.counts)]
            mine = grad[mask.split(ctx.counts)[rank]]
            send = torch.cat([mine[:, start:stop].reshape(-1) for start, stop in table.bounds])
            received = grad.new_empty(sum(chunk_counts) * widths[rank])
            work = dist.all_to_all_single(
                received, send,
                output_split_sizes=[count * widths[rank] for count in chunk_counts],
                input_split_sizes=[mine.shape[0] * width for width in widths],
                group=table.process_group, async_op=True,
            )
            table.record_lookup(chunk_counts, grad.element_size())
            chunks.append((priority, work, received, all_ids[mask]))

        def accumulate() -> None:
            shard_grad = torch.zeros_like(table.shard)
            priority_ready, all_ready, priority_tokens = None, 0.0, 0
            for priority, work, received, ids in chunks:
                work.wait()
                rows = received.view(ids.numel(), widths[rank]).div(table.world_size)
                if table.padding_idx is not None:
                    rows = rows.masked_fill(ids.eq(table.padding_idx).unsqueeze(1), 0)
                shard_grad.index_add_(0, ids, rows)
                all_ready = time.perf_counter() - launched
                if priority:
                    priority_ready, priority_tokens = all_ready, ids.numel()
            table.last_exchange = ExchangeTiming(priority_ready, all_ready, priority_tokens, all_ids.numel())
            if table.shard.grad is None:
                table.shard.grad = shard_grad
            else:
                table.shard.grad.add_(shard_grad)

        torch.autograd.Variable._execution_engine.queue_callback(accumulate)
        return None, None, None, None


class _GatherColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, table: ShardedEmbedding) -> torch.Tensor:
        widest = max(table.widths)
        padded = F.pad(shard, (0, widest - shard.shape[1]))
        gathered = shard.new_empty(table.world_size * table.num_embeddings * widest)
        _all_gather_into_tensor(gathered, padded.reshape(-1), group=table.process_group)
        table.record("all_gather", padded.numel() * padded.element_size())
        blocks = gathered.view(table.world_size, table.num_embeddings, widest)
        ctx.table = table
        return torch.cat([blocks[r, :, :width] for r, width in enumerate(table.widths)], dim=1)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[torch.Tensor, None]:
        table: ShardedEmbedding = ctx.table
        widest = max(table.widths)
        blocks = torch.stack([
            F.pad(grad_full[:, start:stop], (0, widest - (stop - start))) for start, stop in table.bounds
        ])
        reduced = grad_full.new_empty(table.num_embeddings * widest)
        _reduce_scatter_tensor(reduced, blocks.reshape(-1), group=table.process_group)
        table.record("reduce_scatter", blocks.numel() * blocks.element_size())
        own = reduced.view(table.num_embeddings, widest)[:, : table.widths[table.group_rank]]
        return own.div(table.world_size), None


class ShardedEmbedding(nn.Module):
    """Drop-in replacement of an ``nn.Embedding`` holding this rank's columns only.

    The state dict holds the local ``shard``; :meth:`full_weight` gathers the table
    (a collective), and loading a full ``weight`` (from an unsharded model or a
    gathered checkpoint) keeps this rank's columns, so checkpoints reshard to any N.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        process_group: dist.ProcessGroup | None = None,
        padding_idx: int | None = None,
        ledger: CommLedger | None = None,
    ) -> None:
        super().__init__()
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.group_rank = dist.get_rank(process_group)
        self.num_embeddings, self.dim = weight.shape
        self.bounds = column_bounds(self.dim, self.world_size)
        self.widths = [stop - start for start, stop in self.bounds]
        self.padding_idx = padding_idx
        self.ledger = ledger
        start, stop = self.bounds[self.group_rank]
        self.shard = nn.Parameter(weight.detach()[:, start:stop].clone())
        self._upcoming_ids: torch.Tensor | None = None
        self.last_exchange: ExchangeTiming | None = None

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, process_group: dist.ProcessGroup | None = None, ledger: CommLedger | None = None
    ) -> ShardedEmbedding:
        """Shard ``embedding``; its weight is broadcast from the group's first rank first,
        because the table leaves DDP, which would otherwise do that."""
        unsupported = {
            "max_norm": embedding.max_norm is not None,
            "scale_grad_by_freq": embedding.scale_grad_by_freq,
            "sparse": embedding.sparse,
        }
        offending = [name for name, present in unsupported.items() if present]
        if offending:
            raise ValueError(
                f"EmbRace cannot shard an nn.Embedding with {', '.join(offending)} set; "
                "build the embedding without them or use method='s2'"
            )
        weight = embedding.weight.detach().clone()
        dist.broadcast(weight, src=dist.get_global_rank(process_group or dist.group.WORLD, 0), group=process_group)
        return cls(weight, process_group, embedding.padding_idx, ledger)

    def record(self, operation: str, payload_bytes: float) -> None:
        if self.ledger is not None:
            self.ledger.record(operation, payload_bytes, EMBEDDING)

    def record_lookup(self, counts: list[int], element_bytes: int) -> None:
        """One all-to-all of looked-up rows: bytes this rank sends to the other ranks."""
        if self.ledger is None:
            return
        rank = self.group_rank
        sent = sum(count for r, count in enumerate(counts) if r != rank) * self.widths[rank] * element_bytes
        self.ledger.record_received(sent, EMBEDDING)

    def prioritize(self, upcoming_ids: torch.Tensor | None) -> None:
        """The ids this rank's next lookup will use: the next gradient-enabled lookup sends
        them along, and its backward sends the gradient rows of those ids first.

        Only the order of communication changes, never the gradient; ``None`` clears it.
        """
        self._upcoming_ids = None if upcoming_ids is None else upcoming_ids.detach().reshape(-1).to(torch.int64)

    def _take_upcoming_ids(self) -> torch.Tensor:
        """The ids set by :meth:`prioritize` (consumed by a lookup that will have a backward), else none."""
        if self._upcoming_ids is None or not (torch.is_grad_enabled() and self.shard.requires_grad):
            return torch.empty(0, dtype=torch.int64)
        upcoming, self._upcoming_ids = self._upcoming_ids, None
        return upcoming

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _ShardedLookup.apply(self.shard, ids, self._take_upcoming_ids(), self)

    def gathered_weight(self) -> torch.Tensor:
        """The full ``[V, H]`` table, differentiable (used by a tied head)."""
        return _GatherColumns.apply(self.shard, self)

    def full_weight(self) -> torch.Tensor:
        """The full table as a plain tensor (a collective: every rank of the group must call it)."""
        with torch.no_grad():
            return _GatherColumns.apply(self.shard.detach(), self)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        full_key = prefix + "weight"
        if full_key in state_dict:
            start, stop = self.bounds[self.group_rank]
            state_dict[prefix + "shard"] = state_dict.pop(full_key)[:, start:stop]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}, columns {self.bounds[self.group_rank]} of {self.world_size} ranks"


class ShardedTiedHead(nn.Module):
    """Replacement of a ``Linear`` tied to a sharded table: logits from the gathered table."""

    def __init__(self, table: ShardedEmbedding, bias: nn.Parameter | None) -> None:
        super().__init__()
        self._table = [table]  # a list keeps the table out of this module's parameters and state dict
        self.bias = bias

    @property
    def table(self) -> ShardedEmbedding:
        return self._table[0]

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        state_dict.pop(prefix + "weight", None)  # the tied table is loaded through its ShardedEmbedding
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.table.gathered_weight(), self.bias)


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def shard_embeddings(
    model: nn.Module,
    names: list[str],
    process_group: dist.ProcessGroup | None = None,
    ledger: CommLedger | None = None,
) -> dict[str, ShardedEmbedding]:
    """Swap the named ``nn.Embedding`` modules of ``model`` for sharded ones, in place.

    Every ``nn.Linear`` whose weight is one of those tables (a tied LM head) is swapped
    for a :class:`ShardedTiedHead`. Returns the new modules by name. Collective: every
    rank of ``process_group`` must call it with the same names in the same order.
    """
    modules = dict(model.named_modules())
    missing = [name for name in names if not isinstance(modules.get(name), nn.Embedding)]
    if missing:
        raise ValueError(f"not nn.Embedding modules of the model: {missing}")
    sharded: dict[str, ShardedEmbedding] = {}
    for name in names:
        embedding = modules[name]
        table = ShardedEmbedding.from_embedding(embedding, process_group, ledger)
        tied_heads = [
            head_name for head_name, head in modules.items()
            if isinstance(head, nn.Linear) and head.weight is embedding.weight
        ]
        _set_submodule(model, name, table)
        for head_name in tied_heads:
            _set_submodule(model, head_name, ShardedTiedHead(table, modules[head_name].bias))
        sharded[name] = table
    return sharded


def tied_head_names(model: nn.Module, table: ShardedEmbedding) -> list[str]:
    """Names of the :class:`ShardedTiedHead` modules of ``model`` that read ``table``."""
    return [
        name for name, module in model.named_modules()
        if isinstance(module, ShardedTiedHead) and module.table is table
    ]
