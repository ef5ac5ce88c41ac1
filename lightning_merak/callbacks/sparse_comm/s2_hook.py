"""S2 reducer: row-sparse gradient reduction as a DDP comm hook and for tables outside DDP.

Per table and step, every rank:

1. finds its non-zero gradient rows (from the lookup ids when :meth:`S2Reducer.watch_lookups`
   is on, else by scanning the gradient) and packs them into a bitmap;
2. all-gathers the packed bitmaps (one collective for all tables of a bucket) and ORs
   them, so every rank knows every rank's row count and the union U: the sketch size
   and the method are derived from U *after* this exchange, hence identical on all
   ranks (option (a) of the spec, no separate size agreement);
3. sends its rows by the chosen method (:mod:`cost_model`), pre-divided by N like DDP;
4. decodes the union rows into a gradient of the table's shape.

``s2_exact`` all-reduces the union rows compacted (a sketch whose hash is the position
in the union: one row, U buckets, no collisions), so it reproduces dense all-reduce;
``s2_sketch`` all-reduces an ``r x ceil(alpha U)`` count sketch and decodes by median,
within :func:`sketch.error_bound`, when that is smaller than the union's rows
(:func:`wire_cost_model.sketch_pays`), and sends the union exactly otherwise. Rows
found from lookup ids skip the padding row, and all-zero rows (masked tokens) when
scanning for them costs less than sending them (:func:`wire_cost_model.scan_pays`).
Only dense collectives are used (all-gather and
all-reduce of dense tensors), so the same code runs on gloo and on NCCL, which has no
sparse all-reduce. Every rank takes part in every collective even when its batch
touched no row: its bitmap is empty and its payload is zeros of the agreed size.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_merak.callbacks.sparse_comm.bytes_counter import CommLedger
from lightning_merak.callbacks.sparse_comm.sketch import (
    CountSketch,
    bitmap_counts,
    bitmap_rows,
    check_row_ids_hashable,
    drop_zero_rows,
    merge_bitmaps,
    nonzero_rows,
    pack_bitmap,
)
from lightning_merak.callbacks.sparse_comm.wire_cost_model import (
    HOOK_METHODS,
    Decision,
    NetworkModel,
    TableTraffic,
    choose_method,
    scan_pays,
    sketch_columns,
    sketch_pays,
)

log = logging.getLogger(__name__)

EMBEDDING = "embedding"
DENSE = "dense"
AUTO = "auto"
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class _TablePlan:
    """One table's share of a reduction: what it puts in the all-reduce and how to read it back."""

    name: str
    shape: torch.Size
    sparse_output: bool
    method: str
    union: torch.Tensor
    payload: torch.Tensor
    gathered_rows: torch.Tensor | None = None


@dataclass
class S2Reducer:
    """Configuration and running state shared by the comm hook and the excluded-table path.

    ``tables`` maps ``id(parameter)`` to a display name; parameters not in it are
    reduced densely. ``method`` is one of :data:`cost_model.HOOK_METHODS` or ``"auto"``.
    ``scan_bytes_per_s`` (how fast this rank finds zero rows; the callback measures it) and
    ``rescan_every`` drive the search for looked-up rows with a zero gradient.
    """

    tables: dict[int, str]
    sketch: CountSketch
    method: str = "s2_exact"
    column_factor: float = 2.0
    network: NetworkModel = field(default_factory=lambda: NetworkModel.from_gbit(10.0))
    process_group: dist.ProcessGroup | None = None
    ledger: CommLedger | None = None
    auto_candidates: tuple[str, ...] = ("dense", "s2_exact", "allgather")
    freeze_dense_after: int = 3
    scan_bytes_per_s: float = 8e9
    rescan_every: int = 16
    zero_fractions: dict[str, float] = field(default_factory=dict)
    token_counts: dict[str, int] = field(default_factory=dict)
    row_hints: dict[str, torch.Tensor] = field(default_factory=dict)
    decisions: dict[str, Decision] = field(default_factory=dict)
    decision_log: list[str] = field(default_factory=list)
    _dense_streak: dict[str, int] = field(default_factory=dict)
    _frozen_dense: set[str] = field(default_factory=set)
    _steps_since_scan: dict[str, int] = field(default_factory=dict)
    _sketch_declined: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.method not in (*HOOK_METHODS, AUTO):
            raise ValueError(f"method must be one of {(*HOOK_METHODS, AUTO)}, got {self.method!r}")
        if self.rescan_every < 1:
            raise ValueError(f"rescan_every must be >= 1, got {self.rescan_every}")

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def watch_lookups(self, name: str, embedding: nn.Embedding) -> RemovableHandle:
        """Take the table's non-zero rows from its lookup ids instead of scanning the gradient.

        Valid only when the table's weight is read by this module alone (no tied head, no
        functional use); the ids of every gradient-enabled forward since the last
        reduction are kept, so gradient accumulation is covered. The padding row never gets a
        gradient, so its id is left out.
        """

        def remember(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            self.token_counts[name] = int(inputs[0].numel())
            if not torch.is_grad_enabled():
                return
            ids = inputs[0].reshape(-1).unique()
            if embedding.padding_idx is not None:
                ids = ids[ids != embedding.padding_idx]
            previous = self.row_hints.get(name)
            self.row_hints[name] = ids if previous is None else torch.cat([previous, ids]).unique()

        return embedding.register_forward_pre_hook(remember)

    def _record(self, operation: str, payload_bytes: float, category: str) -> None:
        if self.ledger is not None and payload_bytes > 0:
            self.ledger.record(operation, payload_bytes, category)

    def _decide(self, name: str, traffic: TableTraffic) -> str:
        if self.method != AUTO:
            return self.method
        decision = choose_method(traffic, self.network, self.sketch.num_rows, self.column_factor, self.auto_candidates)
        previous = self.decisions.get(name)
        self.decisions[name] = decision
        if previous is None or previous.method != decision.method:
            self.decision_log.append(decision.reason)
            log.info("sparse_comm auto: %s", decision.reason)
        self._dense_streak[name] = self._dense_streak.get(name, 0) + 1 if decision.method == DENSE else 0
        if self._dense_streak[name] >= self.freeze_dense_after:
            self._frozen_dense.add(name)
            message = (
                f"{name}: dense for {self.freeze_dense_after} consecutive steps, frozen to dense "
                "(row bitmaps no longer exchanged)"
            )
            self.decision_log.append(message)
            log.info("sparse_comm auto: %s", message)
        return decision.method

    def plan(self, named_gradients: list[tuple[str, torch.Tensor | None, torch.Size]]) -> list[_TablePlan]:
        """Exchange bitmaps and build each table's payload (collectives: one all-gather,
        plus one more per ``allgather`` table). ``None`` gradients count as empty."""
        world_size = self.world_size
        local: list[tuple[str, torch.Size, bool, torch.Tensor, torch.Tensor]] = []
        dense_plans: dict[str, _TablePlan] = {}
        for name, gradient, shape in named_gradients:
            check_row_ids_hashable(shape[0])
            if name in self._frozen_dense:
                self.row_hints.pop(name, None)
                dense = torch.zeros(shape) if gradient is None else gradient.to_dense()
                dense_plans[name] = _TablePlan(
                    name, shape, gradient is not None and gradient.is_sparse, DENSE,
                    torch.empty(0, dtype=torch.int64), dense.flatten() / world_size,
                )
                continue
            hint = self.row_hints.pop(name, None)
            if gradient is None:
                ids, rows = torch.empty(0, dtype=torch.int64), torch.zeros(0, shape[1])
            elif hint is not None and not gradient.is_sparse:
                hint = hint.to(gradient.device)
                ids, rows = self._without_zero_rows(name, hint, gradient.index_select(0, hint))
            elif gradient.is_sparse:
                ids, rows = self._without_zero_rows(name, *nonzero_rows(gradient))
            else:
                ids, rows = nonzero_rows(gradient)
            local.append((name, shape, gradient is not None and gradient.is_sparse, ids, rows))

        plans: list[_TablePlan] = []
        if local:
            bitmaps = [pack_bitmap(ids, shape[0]) for _, shape, _, ids, _ in local]
            flat = torch.cat(bitmaps)
            gathered = torch.empty(world_size * flat.numel(), dtype=torch.uint8, device=flat.device)
            _all_gather_into_tensor(gathered, flat, group=self.process_group)
            self._record("all_gather", flat.numel(), EMBEDDING)
            per_rank = gathered.view(world_size, -1)
            offset = 0
            for (name, shape, sparse_output, ids, rows), bitmap in zip(local, bitmaps):
                rank_bitmaps = per_rank[:, offset : offset + bitmap.numel()]
                offset += bitmap.numel()
                plans.append(self._plan_table(name, shape, sparse_output, ids, rows, rank_bitmaps))
        by_name = {plan.name: plan for plan in plans} | dense_plans
        return [by_name[name] for name, _, _ in named_gradients]

    def _without_zero_rows(self, name: str, ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop rows found from lookups whose gradient is zero, when scanning for them pays.

        Whether it pays is judged from the zero fraction this table's last scan found; a table
        is scanned on its first step and at least every ``rescan_every`` steps. Rank-local: the
        bitmaps exchanged next carry the result, so ranks need not agree.
        """
        since = self._steps_since_scan.get(name, self.rescan_every)
        fraction = self.zero_fractions.get(name, 1.0)
        if since < self.rescan_every and not scan_pays(fraction, self.world_size, self.network, self.scan_bytes_per_s):
            self._steps_since_scan[name] = since + 1
            return ids, rows
        kept_ids, kept_rows = drop_zero_rows(ids, rows)
        self.zero_fractions[name] = 1.0 - kept_ids.numel() / max(ids.numel(), 1)
        self._steps_since_scan[name] = 1
        return kept_ids, kept_rows

    def _sketch_or_exact(self, name: str, union_rows: int) -> str:
        """``s2_sketch`` when the sketch is smaller than the union's rows, else ``s2_exact`` (logged once)."""
        if sketch_pays(union_rows, self.sketch.num_rows, self.column_factor):
            return "s2_sketch"
        if name not in self._sketch_declined:
            self._sketch_declined.add(name)
            sketch_rows = self.sketch.num_rows * sketch_columns(union_rows, self.column_factor)
            message = (
                f"{name}: a {self.sketch.num_rows} x ceil({self.column_factor:g} U) count sketch of U={union_rows} "
                f"rows holds {sketch_rows} rows, no fewer than the union; sending the union exactly "
                f"(a sketch pays only when sketch_rows * column_factor < 1)"
            )
            self.decision_log.append(message)
            log.info("sparse_comm: %s", message)
        return "s2_exact"

    def _plan_table(
        self,
        name: str,
        shape: torch.Size,
        sparse_output: bool,
        ids: torch.Tensor,
        rows: torch.Tensor,
        rank_bitmaps: torch.Tensor,
    ) -> _TablePlan:
        world_size = self.world_size
        num_rows, dim = shape[0], shape[1]
        union = bitmap_rows(merge_bitmaps(rank_bitmaps), num_rows)
        local_counts = tuple(int(c) for c in bitmap_counts(rank_bitmaps).tolist())
        traffic = TableTraffic(
            name, num_rows, dim, rows.element_size(), local_counts, union.numel(), self.token_counts.get(name) or None
        )
        method = self._decide(name, traffic)
        if method == "s2_sketch":
            method = self._sketch_or_exact(name, union.numel())
        scaled = rows / world_size
        if method == DENSE:
            dense = scaled.new_zeros(num_rows, dim).index_put_((ids,), scaled)
            return _TablePlan(name, shape, sparse_output, DENSE, union, dense.flatten())
        if union.numel() == 0:
            return _TablePlan(name, shape, sparse_output, method, union, scaled.new_zeros(0))
        if method == "s2_exact":
            compact = scaled.new_zeros(union.numel(), dim)
            compact[torch.searchsorted(union, ids)] = scaled
            return _TablePlan(name, shape, sparse_output, method, union, compact.flatten())
        if method == "s2_sketch":
            columns = sketch_columns(union.numel(), self.column_factor)
            return _TablePlan(
                name, shape, sparse_output, method, union, self.sketch.encode(ids, scaled, columns).flatten()
            )
        padded = scaled.new_zeros(max(local_counts), dim)
        padded[: ids.numel()] = scaled
        gathered = torch.empty(world_size * padded.numel(), dtype=padded.dtype, device=padded.device)
        _all_gather_into_tensor(gathered, padded.flatten(), group=self.process_group)
        self._record("all_gather", padded.numel() * padded.element_size(), EMBEDDING)
        # Summed in the union's rows, not the table's: a table-sized buffer would cost a [V, H] memset per step.
        summed = scaled.new_zeros(union.numel(), dim)
        per_rank = gathered.view(world_size, -1, dim)
        for rank in range(world_size):
            rank_ids = bitmap_rows(rank_bitmaps[rank], num_rows)
            summed.index_add_(0, torch.searchsorted(union, rank_ids), per_rank[rank, : rank_ids.numel()])
        return _TablePlan(name, shape, sparse_output, method, union, scaled.new_zeros(0), summed)

    def finish(
        self, plan: _TablePlan, reduced_payload: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The averaged gradient of one table from its slice of the all-reduced payload,
        written into ``out`` when given, saving a table-sized copy: ``out`` is the dense ``[V, H]`` bucket view
        holding this rank's own gradient of the table, whose rows outside the union are already zero (no rank,
        this one included, has a non-zero row there), so only the union's rows are written (a table-sized
        memset less per step)."""
        num_rows, dim = plan.shape[0], plan.shape[1]
        if plan.method == DENSE:
            dense = reduced_payload.view(num_rows, dim)
            if out is not None:
                return out.copy_(dense)
            # row-sparse like the embedding's own gradient: DDP copies the result into it, which needs equal sparse dims
            return dense.to_sparse(1) if plan.sparse_output else dense
        if plan.method == "allgather":
            union_values = plan.gathered_rows
        elif plan.union.numel() == 0:
            union_values = reduced_payload.new_zeros(0, dim)
        elif plan.method == "s2_exact":
            union_values = reduced_payload.view(-1, dim)
        else:
            sketch = reduced_payload.view(self.sketch.num_rows, -1, dim)
            union_values = self.sketch.decode(sketch, plan.union)
        if out is not None:
            return out.index_copy_(0, plan.union, union_values)
        if plan.sparse_output:
            return torch.sparse_coo_tensor(
                plan.union.unsqueeze(0), union_values, (num_rows, dim), is_coalesced=True, check_invariants=False
            )
        return union_values.new_zeros(num_rows, dim).index_copy_(0, plan.union, union_values)

    def reduce_now(self, named_gradients: list[tuple[str, torch.Tensor | None, torch.Size]]) -> list[torch.Tensor]:
        """Synchronous reduction of whole tables (the path for tables excluded from DDP)."""
        plans = self.plan(named_gradients)
        payload = torch.cat([plan.payload for plan in plans])
        if payload.numel():
            dist.all_reduce(payload, group=self.process_group)
            self._record("all_reduce", payload.numel() * payload.element_size(), EMBEDDING)
        results, offset = [], 0
        for plan in plans:
            results.append(self.finish(plan, payload[offset : offset + plan.payload.numel()]))
            offset += plan.payload.numel()
        return results


@dataclass
class SparseLookups:
    """Tables the S2 hook reduces, switched to sparse lookups (``nn.Embedding.sparse``) before DDP wraps them.

    Why: a dense lookup's backward builds a zeroed ``[V, H]`` gradient that DDP then copies into its bucket, two
    table-sized passes per step that torch's own ``sparse=True`` path (the all-gather baseline) does not make. A
    sparse lookup hands the hook its touched rows directly (no scan, no hint) and DDP keeps no bucket for the
    table; the hook returns the averaged rows as a sparse gradient, which :meth:`densify` makes dense right after
    the backward, so later hooks, the optimizer, clipping and checkpoints see the same dense gradient as before.
    Only for tables read by their embedding alone: another use of the weight would add a dense gradient to the
    sparse one.
    """

    embeddings: list[nn.Embedding]
    _dense: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for embedding in self.embeddings:
            embedding.sparse = True

    def clear_stale(self) -> None:
        """Before a backward: a dense gradient left from the last optimizer step (zeroed, not set to None) would
        turn the next sparse one dense, which DDP refuses; dropping it is the same as zeroing it."""
        for embedding in self.embeddings:
            if embedding.weight.grad is not None and not embedding.weight.grad.is_sparse:
                embedding.weight.grad = None

    def densify(self) -> None:
        """After the backward that reduced them, before any hook reads gradients: each table's reduced sparse
        gradient as a dense one, written into the same table-sized tensor every step (zeroed, then the rows
        copied in). ``to_dense`` would allocate it afresh, and a fresh table's pages fault in as they are first
        written: 61 ms for a 500k x 64 float table on one CPU thread, against 6 ms to zero the kept one. Like DDP's
        bucket views, the tensor is reused: a gradient kept past its step is overwritten by the next."""
        for index, embedding in enumerate(self.embeddings):
            gradient = embedding.weight.grad
            if gradient is None or not gradient.is_sparse:
                continue
            dense = self._dense.get(index)
            if dense is None or dense.shape != gradient.shape or dense.dtype != gradient.dtype \
                    or dense.device != gradient.device:
                dense = self._dense[index] = torch.zeros(gradient.shape, dtype=gradient.dtype, device=gradient.device)
            else:
                dense.zero_()
            coalesced = gradient.coalesce()
            embedding.weight.grad = dense.index_copy_(0, coalesced.indices()[0], coalesced.values())

    def restore(self) -> None:
        """After training: the embeddings as the user built them, the kept gradients released."""
        for embedding in self.embeddings:
            embedding.sparse = False
        self._dense.clear()


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def s2_comm_hook(reducer: S2Reducer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: table gradients through :class:`S2Reducer`, the rest of the bucket
    through one all-reduce shared with the tables' payloads. Returns a Future of one tensor
    shaped like the bucket (a sparse tensor for a sparse bucket)."""
    buffer = bucket.buffer()
    parameters = bucket.parameters()
    world_size = reducer.world_size
    if buffer.is_sparse:
        parameter = parameters[0]
        name = reducer.tables.get(id(parameter), f"sparse parameter {tuple(parameter.shape)}")
        return _completed(reducer.reduce_now([(name, buffer, parameter.shape)])[0])

    tables: list[tuple[str, torch.Tensor | None, torch.Size]] = []
    table_slices: list[slice] = []
    dense_slices: list[slice] = []
    offset = 0
    for parameter in parameters:
        span = slice(offset, offset + parameter.numel())
        offset += parameter.numel()
        name = reducer.tables.get(id(parameter))
        if name is None:
            dense_slices.append(span)
        else:
            tables.append((name, buffer[span].view(parameter.shape), parameter.shape))
            table_slices.append(span)

    if not tables:
        buffer.div_(world_size)
        reducer._record("all_reduce", buffer.numel() * buffer.element_size(), DENSE)
        work = dist.all_reduce(buffer, group=reducer.process_group, async_op=True)
        return work.get_future().then(lambda future: future.value()[0])

    dense_part = (torch.cat([buffer[span] for span in dense_slices]) / world_size if dense_slices
                  else buffer.new_zeros(0))
    plans = reducer.plan(tables)
    payload = torch.cat([dense_part, *[plan.payload for plan in plans]])
    reducer._record("all_reduce", dense_part.numel() * dense_part.element_size(), DENSE)
    reducer._record("all_reduce", (payload.numel() - dense_part.numel()) * payload.element_size(), EMBEDDING)

    def write_back(reduced: torch.Tensor) -> torch.Tensor:
        position = 0
        for span in dense_slices:
            length = span.stop - span.start
            buffer[span].copy_(reduced[position : position + length])
            position += length
        for plan, span in zip(plans, table_slices):
            length = plan.payload.numel()
            reducer.finish(plan, reduced[position : position + length], out=buffer[span].view(plan.shape))
            position += length
        return buffer

    if payload.numel() == 0:
        return _completed(write_back(payload))
    work = dist.all_reduce(payload, group=reducer.process_group, async_op=True)
    return work.get_future().then(lambda future: write_back(future.value()[0]))

