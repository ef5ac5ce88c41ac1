"""EmbRace's collectives: the request protocol of a group's tables, the autograd lookups and the gradient exchanges.

The backward all-to-all of a lookup is issued asynchronously on the table's own process group and
awaited at the end of the backward pass (an autograd engine callback), so it overlaps
DDP's all-reduce of the last dense buckets. Issue order on that group follows the
model's graph, identical on every rank.

Priority ("rows needed first sent first"): when the ids of the next batch are known
(:meth:`~.embrace.ShardedEmbedding.prioritize`), they travel with this step's id all-gather, and
backward splits the gradient exchange into two all-to-alls launched back to back on the
table's group: first the tokens whose row the next batch looks up, then the rest. The
priority chunk is awaited and added first. Every row's contributions fall in one chunk,
in their original order, so the gradient is the same as without priority;
``last_exchange`` records when each chunk's rows were in place.

Ranks that take different branches: every collective of a table starts with one all-gather
of a request ``[table, kind, ids, upcoming ids, wants gradient]`` on the table's group. The
lowest request is served; a rank that asked for something else (or nothing: it has reached
:func:`~.embrace.join_lookups`, called before the backward pass) serves it with no ids of its own and
asks again. So a rank whose batch never looks a table up still answers its peers' lookups
instead of leaving them waiting, and every rank records the same operations in the same
order. In a step where a rank served an operation it did not ask for, no gradient is
exchanged inside the graph (the graphs differ); every operation's exchange runs in forward
order at the end of the backward pass instead, a rank without a gradient for it sending zeros.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_merak.util.timing import DeviceStamp

LOOKUP, GATHER = 0, 1
_IDLE = 2**62
"""The request of a rank with nothing left to ask (it has reached :func:`~.embrace.join_lookups`)."""
_MAX_RECORDED = 4096
"""Operations remembered for a deferred exchange; older ones (no backward ever came) are dropped."""
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def exchange_chunks(all_ids: torch.Tensor, upcoming_ids: torch.Tensor) -> list[tuple[bool, torch.Tensor]]:
    """``(is_priority, mask over all_ids)`` in sending order: the tokens whose row is among
    ``upcoming_ids`` (needed by the next lookup) first, then the rest; empty chunks dropped."""
    needed = torch.isin(all_ids, upcoming_ids)
    return [(priority, mask) for priority, mask in ((True, needed), (False, ~needed)) if bool(mask.any())]


class ShardedTable(Protocol):
    """What the exchange reads and writes of a column-sharded table (:class:`~.embrace.ShardedEmbedding`)."""

    process_group: dist.ProcessGroup | None
    world_size: int
    group_rank: int
    num_embeddings: int
    dim: int
    bounds: list[tuple[int, int]]
    widths: list[int]
    padding_idx: int | None
    shard: nn.Parameter
    key: int
    coordinator: Coordinator
    last_exchange: ExchangeTiming | None

    def record(self, operation: str, payload_bytes: float) -> None: ...

    def record_all_to_all(self, input_split_sizes: list[int], element_bytes: int) -> None: ...


@dataclass(frozen=True)
class ExchangeTiming:
    """One backward gradient exchange of a table: seconds on the table's device from launch until the rows of the
    priority chunk, and of all chunks, were added into the slice gradient."""

    priority_rows_s: float | None
    all_rows_s: float
    priority_tokens: int
    tokens: int


@dataclass(eq=False)
class Operation:
    """One served request as a rank records it, whether it asked for it or served it for a peer."""

    table: ShardedTable
    kind: int
    local_tokens: int
    counts: list[int]
    all_ids: torch.Tensor
    grad: torch.Tensor | None = None

    def add_grad(self, grad: torch.Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad


class Coordinator:
    """The requests, recorded operations and deferred gradient exchange of one group's tables."""

    def __init__(self, group: dist.ProcessGroup | None, resolved: dist.ProcessGroup) -> None:
        self.group = group
        self.resolved = resolved  # held, so no later group can reuse its id in ``_coordinators``
        self.tables: list[weakref.ref[ShardedTable]] = []  # weak: a coordinator must not keep models alive
        self.operations: list[Operation] = []
        self.mixed = False
        self.deferred = False

    def register(self, table: ShardedTable) -> int:
        """The table's number on this group: tables are built in the same order on every rank."""
        self.tables.append(weakref.ref(table))
        return len(self.tables) - 1

    def request(self, table: ShardedTable, kind: int, ids: int, upcoming: int) -> torch.Tensor:
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

    def record(self, table: ShardedTable, kind: int, requests: torch.Tensor, all_ids: torch.Tensor) -> Operation:
        """Remember a served operation for a possible deferred exchange (every rank records the same ones)."""
        rank = table.group_rank
        asked = requests[rank, :2].tolist() == [table.key, kind]
        operation = Operation(table, kind, int(requests[rank, 2]) if asked else 0, requests[:, 2].tolist(), all_ids)
        self.operations.append(operation)
        del self.operations[:-_MAX_RECORDED]
        return operation

    def exchange_deferred(self) -> None:
        """Every recorded operation's gradient exchange, in forward order (the same on every rank)."""
        operations, self.operations, self.deferred = self.operations, [], False
        for operation in operations:
            if operation.kind == LOOKUP:
                _exchange_rows(operation)
            else:
                _exchange_columns(operation)

    def schedule_exchange(self, loss: torch.Tensor | None) -> None:
        """After :meth:`join`: when a rank served a request it did not make in this step, run every recorded
        operation's gradient exchange at the end of the backward pass of ``loss``; else forget the operations."""
        if self.deferred:  # an earlier call already scheduled this backward's exchange
            return
        defer = self.mixed and loss is not None and loss.requires_grad and bool(self.operations)
        self.mixed = False
        if not defer:
            self.operations = []
            return
        self.deferred = True
        queue = torch.autograd.Variable._execution_engine.queue_callback
        loss.register_hook(lambda grad: queue(self.exchange_deferred))

    def _gather(self, request: list[int], table: ShardedTable) -> torch.Tensor:
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
            if kind == LOOKUP:
                no_ids = torch.empty(0, dtype=torch.int64)
                _, all_ids, _ = _look_up(table, table.shard, no_ids, no_ids, requests)
            else:
                gather_columns(table, table.shard)
                all_ids = torch.empty(0, dtype=torch.int64)
        if bool(requests[:, 4].any()):
            self.record(table, kind, requests, all_ids)


_coordinators: dict[int, Coordinator] = {}


def coordinator_for(group: dist.ProcessGroup | None) -> Coordinator:
    """The one coordinator of ``group``'s tables (the world group's for ``None``)."""
    resolved = group if group is not None else dist.group.WORLD
    coordinator = _coordinators.get(id(resolved))
    if coordinator is None:
        coordinator = _coordinators[id(resolved)] = Coordinator(group, resolved)
    return coordinator


def _look_up(
    table: ShardedTable, shard: torch.Tensor, flat_ids: torch.Tensor, upcoming: torch.Tensor,
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
    sent_sizes = [count * widths[rank] for count in counts_list]
    dist.all_to_all_single(
        received, looked_up.reshape(-1),
        output_split_sizes=[flat_ids.numel() * width for width in widths],
        input_split_sizes=sent_sizes,
        group=group,
    )
    table.record_all_to_all(sent_sizes, shard.element_size())
    received_blocks = received.split([flat_ids.numel() * width for width in widths])
    output = torch.cat([block.view(flat_ids.numel(), width) for block, width in zip(received_blocks, widths)], dim=1)
    return output, all_ids, all_upcoming.unique()


def _add_to_shard_grad(table: ShardedTable, gradient: torch.Tensor) -> None:
    if table.shard.grad is None:
        table.shard.grad = gradient
    else:
        table.shard.grad.add_(gradient)


def _rows_to_columns(table: ShardedTable, ids: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """The slice gradient of the rows every rank sent for ``ids`` (averaged over the ranks)."""
    shard_grad = torch.zeros_like(table.shard)
    rows = received.view(ids.numel(), table.widths[table.group_rank]).div(table.world_size)
    if table.padding_idx is not None:
        rows = rows.masked_fill(ids.eq(table.padding_idx).unsqueeze(1), 0)
    return shard_grad.index_add_(0, ids, rows)


class ShardedLookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, shard: torch.Tensor, ids: torch.Tensor, upcoming: torch.Tensor, table: ShardedTable,
        requests: torch.Tensor,
    ) -> torch.Tensor:
        flat_ids = ids.reshape(-1).to(torch.int64)
        output, all_ids, all_upcoming = _look_up(table, shard, flat_ids, upcoming, requests)
        ctx.table = table
        ctx.counts = requests[:, 2].tolist()
        ctx.operation = None
        if bool(requests[:, 4].any()):
            ctx.operation = table.coordinator.record(table, LOOKUP, requests, all_ids)
        ctx.save_for_backward(all_ids, all_upcoming)
        return output.view(*ids.shape, table.dim)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, None, None, None, None]:
        table: ShardedTable = ctx.table
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
            sent_sizes = [mine.shape[0] * width for width in widths]
            work = dist.all_to_all_single(
                received, send,
                output_split_sizes=[count * widths[rank] for count in chunk_counts],
                input_split_sizes=sent_sizes,
                group=table.process_group, async_op=True,
            )
            table.record_all_to_all(sent_sizes, grad.element_size())
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


def gather_columns(table: ShardedTable, shard: torch.Tensor) -> torch.Tensor:
    """The full ``[V, H]`` table from every rank's columns (one all-gather)."""
    widest = max(table.widths)
    padded = F.pad(shard, (0, widest - shard.shape[1]))
    gathered = shard.new_empty(table.world_size * table.num_embeddings * widest)
    _all_gather_into_tensor(gathered, padded.reshape(-1), group=table.process_group)
    table.record("all_gather", padded.numel() * padded.element_size())
    blocks = gathered.view(table.world_size, table.num_embeddings, widest)
    return torch.cat([blocks[r, :, :width] for r, width in enumerate(table.widths)], dim=1)


def _reduce_columns(table: ShardedTable, grad_full: torch.Tensor) -> torch.Tensor:
    """This rank's columns of ``grad_full`` summed over the ranks, averaged (one reduce-scatter)."""
    widest = max(table.widths)
    blocks = torch.stack([
        F.pad(grad_full[:, start:stop], (0, widest - (stop - start))) for start, stop in table.bounds
    ])
    reduced = grad_full.new_empty(table.num_embeddings * widest)
    _reduce_scatter_tensor(reduced, blocks.reshape(-1), group=table.process_group)
    table.record("reduce_scatter", blocks.numel() * blocks.element_size())
    return reduced.view(table.num_embeddings, widest)[:, : table.widths[table.group_rank]].div(table.world_size)


def _exchange_rows(operation: Operation) -> None:
    """A deferred lookup's gradient exchange: every rank's rows of this rank's columns (zeros for
    tokens without a gradient), added into the slice gradient."""
    table = operation.table
    rank, widths = table.group_rank, table.widths
    grad = operation.grad
    if grad is None:
        grad = table.shard.new_zeros(operation.local_tokens, table.dim)
    send = torch.cat([grad[:, start:stop].reshape(-1) for start, stop in table.bounds])
    received = grad.new_empty(sum(operation.counts) * widths[rank])
    sent_sizes = [operation.local_tokens * width for width in widths]
    dist.all_to_all_single(
        received, send,
        output_split_sizes=[count * widths[rank] for count in operation.counts],
        input_split_sizes=sent_sizes,
        group=table.process_group,
    )
    table.record_all_to_all(sent_sizes, grad.element_size())
    _add_to_shard_grad(table, _rows_to_columns(table, operation.all_ids, received))


def _exchange_columns(operation: Operation) -> None:
    """A deferred tied-head gradient exchange (zeros from a rank whose head was not used)."""
    table = operation.table
    grad_full = operation.grad
    if grad_full is None:
        grad_full = table.shard.new_zeros(table.num_embeddings, table.dim)
    _add_to_shard_grad(table, _reduce_columns(table, grad_full))


class GatherColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, table: ShardedTable, requests: torch.Tensor) -> torch.Tensor:
        ctx.table = table
        ctx.operation = None
        if bool(requests[:, 4].any()):
            ctx.operation = table.coordinator.record(table, GATHER, requests, torch.empty(0, dtype=torch.int64))
        return gather_columns(table, shard)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        table: ShardedTable = ctx.table
        if table.coordinator.deferred and ctx.operation is not None:
            ctx.operation.add_grad(grad_full)
            return None, None, None
        return _reduce_columns(table, grad_full), None, None
