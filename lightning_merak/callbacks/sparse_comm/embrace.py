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

A tied output head (a ``Linear`` whose weight *is* the table) is swapped for :class:`ShardedTiedHead`: it
all-gathers the full table for the logits and reduce-scatters the head's gradient back to the owners. The head's
gradient is dense, so this costs what a dense all-reduce of the table does; it keeps tied models correct without
editing them. Embeddings sharing one weight become one table, installed under each of their names.

Ranks that take different branches: every collective of a table starts with one all-gather
of a request ``[table, kind, ids, upcoming ids, wants gradient]`` on the table's group. The
lowest request is served; a rank that asked for something else (or nothing: it has reached
:func:`join_lookups`, called before the backward pass) serves it with no ids of its own and
asks again. So a rank whose batch never looks a table up still answers its peers' lookups
instead of leaving them waiting, and every rank records the same operations in the same
order. In a step where a rank served an operation it did not ask for, no gradient is
exchanged inside the graph (the graphs differ); every operation's exchange runs in forward
order at the end of the backward pass instead, a rank without a gradient for it sending zeros.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_merak.callbacks.sparse_comm.bytes_counter import CommLedger
from lightning_merak.util.timing import DeviceStamp

EMBEDDING = "embedding"
_LOOKUP, _GATHER = 0, 1
_IDLE = 2**62
"""The request of a rank with nothing left to ask (it has reached :func:`join_lookups`)."""
_MAX_RECORDED = 4096
"""Operations remembered for a deferred exchange; older ones (no backward ever came) are dropped."""
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
    """One backward gradient exchange of a table: seconds on the table's device from launch until the rows of the
    priority chunk, and of all chunks, were added into the slice gradient."""

    priority_rows_s: float | None
    all_rows_s: float
    priority_tokens: int
    tokens: int


@dataclass(eq=False)
class _Operation:
    """One served request as a rank records it, whether it asked for it or served it for a peer."""

    table: ShardedEmbedding
    kind: int
    local_tokens: int
    counts: list[int]
    all_ids: torch.Tensor
    grad: torch.Tensor | None = None

    def add_grad(self, grad: torch.Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad


class _Coordinator:
    """The requests, recorded operations and deferred gradient exchange of one group's tables."""

    def __init__(self, group: dist.ProcessGroup | None, resolved: dist.ProcessGroup) -> None:
        self.group = group
        self.resolved = resolved  # held, so no later group can reuse its id in ``_coordinators``
        self.tables: list[weakref.ref[ShardedEmbedding]] = []  # weak: a coordinator must not keep models alive
        self.operations: list[_Operation] = []
        self.mixed = False
        self.deferred = False

    def register(self, table: ShardedEmbedding) -> int:
        """The table's number on this group: tables are built in the same order on every rank."""
        self.tables.append(weakref.ref(table))
        return len(self.tables) - 1

    def request(self, table: ShardedEmbedding, kind: int, ids: int, upcoming: int) -> torch.Tensor:
        """Serve every lower request of a peer, then return the requests of the round serving this one."""
        wants_grad = int(torch.is_grad_enabled() and table.shard.requires_grad)
        mine = (table.key, kind)
        while True:
            requests = self._gather([table.key, kind, ids, upcoming, wants_grad], table)
            served = self._served(requests)
            if served == mine:
                return requests
            self._serve(served, requests)

    def join(self) -> None:
        """Serve the peers' requests until every rank of the group has nothing left to ask."""
        table = next(table for table in (ref() for ref in reversed(self.tables)) if table is not None)
        while True:
            requests = self._gather([_IDLE, 0, 0, 0, 0], table)
            served = self._served(requests)
            if served[0] == _IDLE:
                return
            self._serve(served, requests)

    def record(self, table: ShardedEmbedding, kind: int, requests: torch.Tensor, all_ids: torch.Tensor) -> _Operation:
        """Remember a served operation for a possible deferred exchange (every rank records the same ones)."""
        rank = table.group_rank
        asked = requests[rank, :2].tolist() == [table.key, kind]
        operation = _Operation(table, kind, int(requests[rank, 2]) if asked else 0, requests[:, 2].tolist(), all_ids)
        self.operations.append(operation)
        del self.operations[:-_MAX_RECORDED]
        return operation

    def exchange_deferred(self) -> None:
        """Every recorded operation's gradient exchange, in forward order (the same on every rank)."""
        operations, self.operations, self.deferred = self.operations, [], False
        for operation in operations:
            if operation.kind == _LOOKUP:
                operation.table.exchange_rows(operation)
            else:
                operation.table.exchange_columns(operation)

    def _gather(self, request: list[int], table: ShardedEmbedding) -> torch.Tensor:
        mine = torch.tensor(request, dtype=torch.int64, device=table.shard.device)
        requests = mine.new_empty(table.world_size * mine.numel())
        _all_gather_into_tensor(requests, mine, group=self.group)
        table.record("all_gather", mine.numel() * mine.element_size())
        return requests.view(table.world_size, mine.numel())

    def _served(self, requests: torch.Tensor) -> tuple[int, int]:
        asked = [(key, kind) for key, kind in requests[:, :2].tolist()]
        served = min(asked)
        self.mixed = self.mixed or any(request != served for request in asked)
        return served

    def _serve(self, served: tuple[int, int], requests: torch.Tensor) -> None:
        """A peer's request this rank did not make: take part with no ids of its own."""
        key, kind = served
        table = self.tables[key]()
        if table is None:
            raise RuntimeError(
                f"a peer looked up EmbRace table #{key} of its group, which this rank has deleted; every rank "
                "must keep the same ShardedEmbedding tables (build and drop models on every rank alike)"
            )
        with torch.no_grad():
            if kind == _LOOKUP:
                no_ids = torch.empty(0, dtype=torch.int64)
                _, all_ids, _ = _look_up(table, table.shard, no_ids, no_ids, requests)
            else:
                _gather_columns(table, table.shard)
                all_ids = torch.empty(0, dtype=torch.int64)
        if bool(requests[:, 4].any()):
            self.record(table, kind, requests, all_ids)


_coordinators: dict[int, _Coordinator] = {}


def _coordinator(group: dist.ProcessGroup | None) -> _Coordinator:
    resolved = group if group is not None else dist.group.WORLD
    coordinator = _coordinators.get(id(resolved))
    if coordinator is None:
        coordinator = _coordinators[id(resolved)] = _Coordinator(group, resolved)
    return coordinator


def join_lookups(tables: Iterable[ShardedEmbedding], loss: torch.Tensor | None = None) -> None:
    """Answer the peers' outstanding lookups of ``tables``; call it on every rank before the backward
    pass of ``loss`` (Lightning: ``on_before_backward``), or with no loss after a forward without one.

    Why: a rank whose batch did not look a table up would otherwise leave its peers waiting in
    their lookup forever. When any rank served a request it did not make in this step, every
    gradient exchange of the step waits for the end of the backward pass of ``loss``.
    """
    coordinators = list({id(table.coordinator): table.coordinator for table in tables}.values())
    for coordinator in coordinators:
        coordinator.join()
    for coordinator in coordinators:
        if coordinator.deferred:  # an earlier call already scheduled this backward's exchange
            continue
        defer = coordinator.mixed and loss is not None and loss.requires_grad and bool(coordinator.operations)
        coordinator.mixed = False
        if not defer:
            coordinator.operations = []
            continue
        coordinator.deferred = True
        queue = torch.autograd.Variable._execution_engine.queue_callback
        loss.register_hook(lambda grad, exchange=coordinator.exchange_deferred: queue(exchange))


def _look_up(
    table: ShardedEmbedding, shard: torch.Tensor, flat_ids: torch.Tensor, upcoming: torch.Tensor,
    requests: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``[len(flat_ids), dim]`` rows (its columns looked up by every rank, one all-to-all),
    every rank's ids, and every rank's ids of its next batch (they travel with this lookup's ids)."""
    group, world_size, rank = table.process_group, table.world_size, table.group_rank
    flat_ids = flat_ids.to(shard.device)
    per_rank = requests[:, 2:4].tolist()
    counts_list = [current for current, _ in per_rank]
    longest = max(current + ahead for current, ahead in per_rank)
    padded = flat_ids.new_zeros(longest)
    padded[: flat_ids.numel()] = flat_ids
    padded[flat_ids.numel() : flat_ids.numel() + upcoming.numel()] = upcoming.to(flat_ids)
    gathered = flat_ids.new_empty(world_size * longest)
    _all_gather_into_tensor(gathered, padded, group=group)
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
    output = torch.cat([block.view(flat_ids.numel(), width) for block, width in zip(received_blocks, widths)], dim=1)
    return output, all_ids, all_upcoming.unique()


def _add_to_shard_grad(table: ShardedEmbedding, gradient: torch.Tensor) -> None:
    if table.shard.grad is None:
        table.shard.grad = gradient
    else:
        table.shard.grad.add_(gradient)


def _rows_to_columns(table: ShardedEmbedding, ids: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """The slice gradient of the rows every rank sent for ``ids`` (averaged over the ranks)."""
    shard_grad = torch.zeros_like(table.shard)
    rows = received.view(ids.numel(), table.widths[table.group_rank]).div(table.world_size)
    if table.padding_idx is not None:
        rows = rows.masked_fill(ids.eq(table.padding_idx).unsqueeze(1), 0)
    return shard_grad.index_add_(0, ids, rows)


class _ShardedLookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, shard: torch.Tensor, ids: torch.Tensor, upcoming: torch.Tensor, table: ShardedEmbedding,
        requests: torch.Tensor,
    ) -> torch.Tensor:
        flat_ids = ids.reshape(-1).to(torch.int64)
        output, all_ids, all_upcoming = _look_up(table, shard, flat_ids, upcoming, requests)
        ctx.table = table
        ctx.counts = requests[:, 2].tolist()
        ctx.operation = None
        if bool(requests[:, 4].any()):
            ctx.operation = table.coordinator.record(table, _LOOKUP, requests, all_ids)
        ctx.save_for_backward(all_ids, all_upcoming)
        return output.view(*ids.shape, table.dim)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, None, None, None, None]:
        table: ShardedEmbedding = ctx.table
        grad = grad_output.reshape(-1, table.dim)
        if table.coordinator.deferred and ctx.operation is not None:
            ctx.operation.add_grad(grad)
            return None, None, None, None, None
        all_ids, upcoming = ctx.saved_tensors
        widths, rank = table.widths, table.group_rank
        launched = DeviceStamp(grad.device)
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
            chunks.append((priority, work, received, all_ids[mask], send))  # send held until the wait

        def accumulate() -> None:
            shard_grad = torch.zeros_like(table.shard)
            priority_ready, all_ready, priority_tokens = None, launched, 0
            for priority, work, received, ids, _sent in chunks:
                work.wait()
                shard_grad += _rows_to_columns(table, ids, received)
                all_ready = DeviceStamp(grad.device)
                if priority:
                    priority_ready, priority_tokens = all_ready, ids.numel()
            table.last_exchange = ExchangeTiming(
                priority_ready.seconds_since(launched) if priority_ready is not None else None,
                all_ready.seconds_since(launched), priority_tokens, all_ids.numel())
            _add_to_shard_grad(table, shard_grad)

        torch.autograd.Variable._execution_engine.queue_callback(accumulate)
        return None, None, None, None, None


def _gather_columns(table: ShardedEmbedding, shard: torch.Tensor) -> torch.Tensor:
    """The full ``[V, H]`` table from every rank's columns (one all-gather)."""
    widest = max(table.widths)
    padded = F.pad(shard, (0, widest - shard.shape[1]))
    gathered = shard.new_empty(table.world_size * table.num_embeddings * widest)
    _all_gather_into_tensor(gathered, padded.reshape(-1), group=table.process_group)
    table.record("all_gather", padded.numel() * padded.element_size())
    blocks = gathered.view(table.world_size, table.num_embeddings, widest)
    return torch.cat([blocks[r, :, :width] for r, width in enumerate(table.widths)], dim=1)


def _reduce_columns(table: ShardedEmbedding, grad_full: torch.Tensor) -> torch.Tensor:
    """This rank's columns of ``grad_full`` summed over the ranks, averaged (one reduce-scatter)."""
    widest = max(table.widths)
    blocks = torch.stack([
        F.pad(grad_full[:, start:stop], (0, widest - (stop - start))) for start, stop in table.bounds
    ])
    reduced = grad_full.new_empty(table.num_embeddings * widest)
    _reduce_scatter_tensor(reduced, blocks.reshape(-1), group=table.process_group)
    table.record("reduce_scatter", blocks.numel() * blocks.element_size())
    return reduced.view(table.num_embeddings, widest)[:, : table.widths[table.group_rank]].div(table.world_size)


class _GatherColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, table: ShardedEmbedding, requests: torch.Tensor) -> torch.Tensor:
        ctx.table = table
        ctx.operation = None
        if bool(requests[:, 4].any()):
            ctx.operation = table.coordinator.record(table, _GATHER, requests, torch.empty(0, dtype=torch.int64))
        return _gather_columns(table, shard)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        table: ShardedEmbedding = ctx.table
        if table.coordinator.deferred and ctx.operation is not None:
            ctx.operation.add_grad(grad_full)
            return None, None, None
        return _reduce_columns(table, grad_full), None, None


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
        self.coordinator = _coordinator(process_group)
        self.key = self.coordinator.register(self)

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, process_group: dist.ProcessGroup | None = None, ledger: CommLedger | None = None
    ) -> ShardedEmbedding:
        """Shard ``embedding``; its weight is broadcast from the group's first rank first,
        because the table leaves DDP, which would otherwise do that."""
        check_shardable(embedding)
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
        upcoming = self._take_upcoming_ids()
        requests = self.coordinator.request(self, _LOOKUP, ids.numel(), upcoming.numel())
        return _ShardedLookup.apply(self.shard, ids, upcoming, self, requests)

    def gathered_weight(self) -> torch.Tensor:
        """The full ``[V, H]`` table, differentiable (used by a tied head)."""
        requests = self.coordinator.request(self, _GATHER, 0, 0)
        return _GatherColumns.apply(self.shard, self, requests)

    def full_weight(self) -> torch.Tensor:
        """The full table as a plain tensor (a collective: every rank of the group must call it)."""
        with torch.no_grad():
            self.coordinator.request(self, _GATHER, 0, 0)
            return _gather_columns(self, self.shard.detach())

    def exchange_rows(self, operation: _Operation) -> None:
        """A deferred lookup's gradient exchange: every rank's rows of this rank's columns (zeros for
        tokens without a gradient), added into the slice gradient."""
        rank, widths = self.group_rank, self.widths
        grad = operation.grad
        if grad is None:
            grad = self.shard.new_zeros(operation.local_tokens, self.dim)
        send = torch.cat([grad[:, start:stop].reshape(-1) for start, stop in self.bounds])
        received = grad.new_empty(sum(operation.counts) * widths[rank])
        dist.all_to_all_single(
            received, send,
            output_split_sizes=[count * widths[rank] for count in operation.counts],
            input_split_sizes=[operation.local_tokens * width for width in widths],
            group=self.process_group,
        )
        self.record_lookup(operation.counts, grad.element_size())
        _add_to_shard_grad(self, _rows_to_columns(self, operation.all_ids, received))

    def exchange_columns(self, operation: _Operation) -> None:
        """A deferred tied-head gradient exchange (zeros from a rank whose head was not used)."""
        grad_full = operation.grad
        if grad_full is None:
            grad_full = self.shard.new_zeros(self.num_embeddings, self.dim)
        _add_to_shard_grad(self, _reduce_columns(self, grad_full))

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


def check_shardable(embedding: nn.Embedding, name: str = "the embedding") -> None:
    """Refuse an embedding whose lookup a :class:`ShardedEmbedding` would not reproduce: one with options it does
    not implement, or of a class that overrides ``forward`` (Gemma's ``embed_scale``), whose extra work the
    replacement would silently drop."""
    unsupported = {"max_norm": embedding.max_norm is not None, "scale_grad_by_freq": embedding.scale_grad_by_freq,
                   "sparse": embedding.sparse}
    offending = [option for option, present in unsupported.items() if present]
    if offending:
        raise ValueError(
            f"EmbRace cannot shard {name}, an nn.Embedding with {', '.join(offending)} set; "
            "build the embedding without them or use method='s2'"
        )
    if type(embedding).forward is not nn.Embedding.forward:
        kind = type(embedding)
        raise ValueError(
            f"EmbRace cannot shard {name} ({kind.__module__}.{kind.__qualname__}): its class overrides "
            "nn.Embedding.forward, which the sharded table would replace, changing the model's outputs; "
            "use method='s2' (merak-train: comm=s2) for this model"
        )


def table_groups(model: nn.Module, names: list[str]) -> list[list[str]]:
    """The named tables grouped by weight: every name under which an ``nn.Embedding`` holds it (one Parameter in two
    embeddings, one module under two names), as a table per name would train drifting copies. Refuses, with no
    collective, what one sharded table cannot reproduce."""
    modules = dict(model.named_modules(remove_duplicate=False))
    missing = [name for name in names if not isinstance(modules.get(name), nn.Embedding)]
    if missing:
        raise ValueError(f"not nn.Embedding modules of the model: {missing}")
    groups: dict[int, list[str]] = {id(modules[name].weight): [] for name in names}  # the modules hold the weights
    for name, module in modules.items():
        if isinstance(module, nn.Embedding) and id(module.weight) in groups:
            check_shardable(module, name)
            group = groups[id(module.weight)]
            if group and modules[group[0]].padding_idx != module.padding_idx:
                raise ValueError(f"EmbRace cannot shard {group[0]} and {name} as one table: they share one weight "
                                 f"but differ in padding_idx ({modules[group[0]].padding_idx} and "
                                 f"{module.padding_idx}); give them one padding_idx or use method='s2'")
            group.append(name)
    return list(groups.values())


def shard_embeddings(
    model: nn.Module,
    names: list[str],
    process_group: dist.ProcessGroup | None = None,
    ledger: CommLedger | None = None,
) -> dict[str, ShardedEmbedding]:
    """Swap the named ``nn.Embedding`` modules of ``model`` for sharded ones, in place.

    Embeddings sharing a weight (:func:`table_groups`) get one table, installed under each of their names, so all
    their lookups read and train it. Every ``nn.Linear`` whose weight is one of those tables (a tied LM head) is
    swapped for a :class:`ShardedTiedHead`. Returns the new modules by every name. Collective: every rank of
    ``process_group`` must call it with the same names in the same order."""
    modules = dict(model.named_modules(remove_duplicate=False))
    sharded: dict[str, ShardedEmbedding] = {}
    for group in table_groups(model, names):
        embedding = modules[group[0]]
        table = ShardedEmbedding.from_embedding(embedding, process_group, ledger)
        for name in group:
            model.set_submodule(name, table)
            sharded[name] = table
        for head_name, head in modules.items():
            if isinstance(head, nn.Linear) and head.weight is embedding.weight:
                model.set_submodule(head_name, ShardedTiedHead(table, head.bias))
    return sharded


def weight_holder_names(model: nn.Module, table: ShardedEmbedding) -> list[str]:
    """The names of ``model``'s modules whose ``<name>.weight`` the unsharded model saved as ``table``'s weight."""
    return [name for name, module in model.named_modules(remove_duplicate=False)
            if module is table or (isinstance(module, ShardedTiedHead) and module.table is table)]
