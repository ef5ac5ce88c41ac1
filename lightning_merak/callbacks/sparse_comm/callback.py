"""``SparseCommunication``: S2 Reducer or EmbRace for a model's embedding tables under
Lightning's DDP or merak3d.

Data-parallel group: the callback reduces over ``strategy.data_parallel_group`` when
the strategy defines it (a ``ProcessGroup``, or a zero-argument method returning
one), so a 3D-parallel strategy can hand over its data-parallel group; otherwise the
world group (plain ``DDPStrategy``). A strategy may also expose
``sparse_comm_process_group`` for the dedicated group on which excluded tables and
EmbRace communicate; without it the callback creates one spanning the data-parallel
ranks (one per data-parallel group of merak3d's device mesh) or reuses the
data-parallel group.

Under a layout-aware strategy (:class:`~lightning_merak.protocols.layout_aware.LayoutAwareStrategy`:
merak3d), which averages gradients itself after ``on_after_backward``, the tables (and,
with ``pipeline_parallel>1``, the tied LM-head copy on the last stage) are reduced by S2
in ``on_after_backward`` over the data-parallel group and named in
``_ddp_params_and_buffers_to_ignore`` so the strategy skips them; names are looked up
after the layout is built, since pipeline stages rename parameters. EmbRace shards the
tables over the data-parallel group with ``pipeline_parallel=1``.

Tables are replaced in ``setup``, before the strategy wraps the model and creates the optimizers; for a
LightningModule that builds its model in ``configure_model`` (which Lightning calls after the callbacks'
``setup``), right after that instead (:func:`~.strategy_wiring.before_strategy_setup`).

Clipping has one owner per run. A layout-aware strategy clips, and EmbRace registers its
column shards with it (``register_sharded_gradients``) so the norm sums their squares over
the group. Lightning's DDP has no owner that could know of shards: there EmbRace installs
:meth:`~lightning_merak.distributed.gradient_norm.ShardedGradients.clip` as the precision plugin's
``clip_grad_by_norm``, the only clipping of that run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_merak.callbacks.sparse_comm.arguments import check_arguments, check_merak3d_layout, table_names
from lightning_merak.callbacks.sparse_comm.bytes_counter import CommLedger
from lightning_merak.callbacks.sparse_comm.embrace import (
    ShardedEmbedding,
    join_lookups,
    shard_embeddings,
    table_groups,
)
from lightning_merak.callbacks.sparse_comm.embrace_checkpoint import (
    GATHERED_ENTRIES,
    gather_optimizer_states,
    save_whole_tables,
    slice_optimizer_states,
)
from lightning_merak.callbacks.sparse_comm.lookahead import next_batch_ids
from lightning_merak.callbacks.sparse_comm.s2_hook import AUTO, S2Reducer, SparseLookups, s2_comm_hook
from lightning_merak.callbacks.sparse_comm.sketch import CountSketch
from lightning_merak.callbacks.sparse_comm.strategy_wiring import (
    before_strategy_setup,
    clip_with_shards,
    data_parallel_group,
    dedicated_group,
    finds_unused_parameters,
    gradients_in_buckets,
    ignore_in_ddp,
    measure_bandwidth,
    measure_scan_speed,
)
from lightning_merak.callbacks.sparse_comm.table_discovery import (
    builds_model_later,
    check_materialised,
    find_tables,
    layout_table_names,
    no_table_message,
    read_alone,
)
from lightning_merak.callbacks.sparse_comm.wire_cost_model import NetworkModel
from lightning_merak.parallel.data.agreed_overflow import agree_on_overflow
from lightning_merak.parallel.pipeline.stage import RankStages
from lightning_merak.protocols.layout_aware import LayoutAwareStrategy, layout_aware

log = logging.getLogger(__name__)

Method = Literal["s2", "embrace", "auto"]
Mode = Literal["exact", "sketch"]


class SparseCommunication(pl.Callback):
    """Replace DDP's dense all-reduce of large embedding tables by a sparse method.

    Args:
        method: ``"s2"`` (S2 reducer: bitmaps + union rows or count sketch), ``"embrace"``
            (column-sharded tables, all-to-all lookups) or ``"auto"`` (per table and step,
            the fastest of dense / s2_exact / allgather by the cost model among those sending no
            more bytes than s2_exact, reasons logged).
        mode: for ``"s2"``: ``"exact"`` reproduces dense all-reduce; ``"sketch"`` sends an
            ``sketch_rows x ceil(column_factor * U)`` count sketch (lossy, see ``sketch.error_bound``)
            when that is fewer rows than the union's U, i.e. ``sketch_rows * column_factor < 1``, and
            the union exactly otherwise (so with the defaults, 3 x 2.0, it sends exactly).
        sketch_rows: odd number of sketch rows (median decode).
        column_factor: sketch columns per union row (alpha).
        seed: hash seed, identical on all ranks and stored in checkpoints.
        min_table_rows: ``nn.Embedding`` modules with at least this many rows are tables.
        tables: explicit module names instead of ``min_table_rows``; a single string is one name
            (``"embed"`` means ``["embed"]``).
        bandwidth_gbit: link bandwidth for the cost model; ``None`` measures it at fit start.
        latency_us: per-message latency for the cost model, in microseconds.
        freeze_dense_after: ``auto`` stops exchanging bitmaps for a table chosen dense this many steps in a row.
        rows_from_ids: take a table's non-zero rows from its lookup ids (cheap) rather than by
            scanning its gradient, and under DDP look it up sparsely (``SparseLookups``; not when the
            ``DDPStrategy`` has ``find_unused_parameters=True``, under which DDP refuses a rank's missing sparse
            gradient); tied tables are always scanned and looked up densely. Set ``False`` if the model reads a
            table's weight outside its ``nn.Embedding`` (e.g. ``F.linear(x, emb.weight)``).
        priority: for ``"embrace"``: send the gradient rows the next batch looks up first
            (the next batch is read one step ahead from Lightning's batch iterator; the
            gradient is unchanged, only the order of communication). Timings land in each
            table's ``last_exchange``.
        priority_ids: maps a batch to the token ids the tables look up; default
            ``pl_module.split_batch(batch)[0]`` (merak3d's module contract).
    """

    fully_sharded_refusal = "its tables' gradients are plain tensors where FSDP2's are sharded DTensors"
    """Why ``data_parallel_sharding="full"`` is refused with it (:mod:`lightning_merak.protocols.callbacks`)."""

    def __init__(
        self,
        method: Method = "auto",
        mode: Mode = "exact",
        sketch_rows: int = 3,
        column_factor: float = 2.0,
        seed: int = 0,
        min_table_rows: int = 1024,
        tables: str | list[str] | None = None,
        bandwidth_gbit: float | None = None,
        latency_us: float = 50.0,
        freeze_dense_after: int = 3,
        rows_from_ids: bool = True,
        priority: bool = False,
        priority_ids: Callable[[Any], torch.Tensor] | None = None,
    ) -> None:
        check_arguments(
            method=method, mode=mode, column_factor=column_factor, min_table_rows=min_table_rows,
            bandwidth_gbit=bandwidth_gbit, latency_us=latency_us, freeze_dense_after=freeze_dense_after,
            rows_from_ids=rows_from_ids, priority=priority, priority_ids=priority_ids,
        )
        self.method = method
        self.mode = mode
        self.sketch = CountSketch(sketch_rows, seed)
        self.column_factor = column_factor
        self.min_table_rows = min_table_rows
        self.table_names = table_names(tables)
        self.bandwidth_gbit = bandwidth_gbit
        self.latency_us = latency_us
        self.freeze_dense_after = freeze_dense_after
        self.rows_from_ids = rows_from_ids
        self.priority = priority
        self.priority_ids = priority_ids
        self.ledger: CommLedger | None = None
        self.hook_reducer: S2Reducer | None = None
        self.excluded_reducer: S2Reducer | None = None
        self.excluded_tables: dict[str, nn.Parameter] = {}
        self.sharded_tables: dict[str, ShardedEmbedding] = {}
        self._restored_frozen: set[str] = set()
        self._active = False
        self._layout_aware = False
        self._layout_tables: dict[str, str] = {}
        self._sparse_lookups: SparseLookups | None = None
        self._unsliced_checkpoint: dict[str, Any] | None = None

    @property
    def seed(self) -> int:
        return self.sketch.seed

    @property
    def distinct_tables(self) -> list[ShardedEmbedding]:
        """Each EmbRace table once: embeddings sharing one weight map several names to one table."""
        return list({id(table): table for table in self.sharded_tables.values()}.values())

    def _hook_method(self) -> str:
        if self.method == "auto":
            return AUTO
        return "s2_exact" if self.mode == "exact" else "s2_sketch"

    def check_tables(self, pl_module: pl.LightningModule) -> None:
        """Refuse tables EmbRace cannot shard (an option it lacks, a class overriding the lookup: Gemma's scaled
        embedding; embeddings sharing a weight that differ in ``padding_idx``; weights on the meta device, whose
        columns it would keep before any rank has values), with no collective: ``merak-train`` calls it before
        launch, ``setup`` (or, for a model built in ``configure_model``, the moment after it) before any other work."""
        if self.method == "embrace":
            tables = find_tables(pl_module, self.table_names, self.min_table_rows)
            table_groups(pl_module, list(tables))
            check_materialised(tables)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check the run, then replace the tables: now, or once ``configure_model`` has built them."""
        if stage != "fit" or not self._replaces_communication(trainer, pl_module):
            return
        if builds_model_later(pl_module):
            before_strategy_setup(trainer.strategy, lambda: self._replace_tables(trainer, pl_module))
        else:
            self._replace_tables(trainer, pl_module)

    def _replaces_communication(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Refuse a strategy or ``priority`` it cannot work with; ``False`` (logged) where there is no gradient
        communication to replace."""
        strategy = trainer.strategy
        layout = layout_aware(strategy)
        self._layout_aware = layout is not None
        if layout is None and not isinstance(strategy, DDPStrategy):
            if trainer.world_size == 1:
                log.warning("SparseCommunication: single process, no gradient communication to replace")
                return False
            raise TypeError(
                f"SparseCommunication works under DDP or merak3d; the trainer uses {type(strategy).__name__}. "
                "Use strategy='ddp' (or a DDPStrategy subclass) or Merak3DStrategy"
            )
        if layout is not None:
            self._check_layout(layout)
            if layout.data_parallel == 1:
                log.warning("SparseCommunication: merak3d has data_parallel=1, no gradient communication to replace")
                return False
        if self.priority and self.priority_ids is None and not callable(getattr(pl_module, "split_batch", None)):
            raise ValueError(
                f"priority=True needs the token ids of a batch: {type(pl_module).__name__} has no split_batch; "
                "pass priority_ids=<function from a batch to its ids>"
            )
        return True

    def _replace_tables(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Shard the tables (EmbRace) or hand them to S2 reducers, before DDP wraps the model: refuses what
        EmbRace cannot shard first, with no collective."""
        self.check_tables(pl_module)
        tables = find_tables(pl_module, self.table_names, self.min_table_rows)
        if not tables:
            rank_zero_warn(no_table_message(pl_module, self.method, self.table_names, self.min_table_rows))
            return
        strategy = trainer.strategy
        layout = layout_aware(strategy)
        group = data_parallel_group(strategy)
        comm_group = dedicated_group(strategy, group)
        self.ledger = CommLedger(dist.get_world_size(group))
        ignored: list[str] = []
        if self.method == "embrace":
            if self._layout_aware:
                for module in tables.values():
                    dist.broadcast(module.weight.data, src=0)  # merak3d's replicas all start from rank 0's weights
            self.sharded_tables = shard_embeddings(pl_module, list(tables), comm_group, self.ledger)
            self._slice_loaded_optimizer_states()
            save_whole_tables(pl_module, self.distinct_tables)
            ignored = [f"{name}.shard" for name in self.sharded_tables]
            shards = [table.shard for table in self.distinct_tables]
            if layout is not None:
                layout.register_sharded_gradients(shards, comm_group)
            else:
                clip_with_shards(trainer, shards, comm_group)
                scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
                if scaler is not None:  # each rank's shard may overflow alone: every rank skips that step
                    agree_on_overflow(scaler)
        elif self._layout_aware:
            self._layout_tables = layout_table_names(pl_module, tables)
            self.excluded_reducer = self._reducer({}, comm_group)
            self._watch_lookups(pl_module, tables)
        else:
            self.excluded_tables = {name: m.weight for name, m in tables.items() if m.sparse}
            hooked = {id(m.weight): name for name, m in tables.items() if not m.sparse}
            self.hook_reducer = self._reducer(hooked, group)
            self.excluded_reducer = self._reducer({id(p): n for n, p in self.excluded_tables.items()}, comm_group)
            ignored = [f"{name}.weight" for name in self.excluded_tables]
            self._watch_lookups(pl_module, tables)
            if hooked:
                gradients_in_buckets(strategy)
                sparse_lookups = self.rows_from_ids and not finds_unused_parameters(strategy)
                if self.rows_from_ids and not sparse_lookups:
                    log.info("SparseCommunication: DDP finds unused parameters, so the tables keep dense lookups")
                self._sparse_lookups = SparseLookups([m for m in tables.values() if id(m.weight) in hooked
                                                      and sparse_lookups and read_alone(pl_module, m)])
        if ignored:
            ignore_in_ddp(pl_module, ignored)
        self._active = True
        log.info(
            "SparseCommunication(%s): tables %s; excluded from DDP: %s", self.method, sorted(tables), ignored or "none"
        )

    def _reducer(self, tables: dict[int, str], group: dist.ProcessGroup | None) -> S2Reducer:
        reducer = S2Reducer(
            tables=tables,
            sketch=self.sketch,
            method=self._hook_method(),
            column_factor=self.column_factor,
            process_group=group,
            ledger=self.ledger,
            freeze_dense_after=self.freeze_dense_after,
        )
        reducer._frozen_dense.update(self._restored_frozen)
        return reducer

    def _watch_lookups(self, pl_module: pl.LightningModule, tables: dict[str, nn.Embedding]) -> None:
        """Rows from lookup ids for tables read only by their embedding (spec: bitmap from
        the batch's ids); a table whose weight another module also holds (a tied head) is
        scanned, since its gradient has rows no id names."""
        for name, module in tables.items():
            reducer = self.excluded_reducer if module.sparse or self._layout_aware else self.hook_reducer
            alone = read_alone(pl_module, module)
            if self.rows_from_ids and alone and reducer is not None:
                reducer.watch_lookups(name, module)
            elif not alone:
                log.info("SparseCommunication: %s is shared with another module (tied); scanning its gradient", name)

    def _check_layout(self, strategy: LayoutAwareStrategy) -> None:
        """Refuse a merak3d layout the method cannot run under (:func:`~.arguments.check_merak3d_layout`: the fix
        in both spellings, the strategy argument and merak-train's Hydra override), before any collective."""
        check_merak3d_layout(self.method, strategy)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """EmbRace: answer the peers' lookups this rank's batch did not make, so none of them waits forever.
        S2 under DDP: no dense gradient left on a sparse-lookup table (:meth:`SparseLookups.clear_stale`)."""
        if self._sparse_lookups is not None:
            self._sparse_lookups.clear_stale()
        if self.sharded_tables:
            join_lookups(self.distinct_tables, loss)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        """EmbRace: the same after an evaluation forward, which has no backward pass to wait for."""
        if self.sharded_tables:
            join_lookups(self.distinct_tables)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """S2 under DDP, on a backward that synchronises (not one under ``no_sync``, gradient accumulation, which
        keeps its local gradients for the next backward to add to): the hook's reduced sparse gradients made dense
        as soon as DDP has written them, and the tables kept out of DDP (``sparse=True`` embeddings) reduced, so
        every later hook (metrics, user callbacks, clipping, the optimizer) sees the reduced gradients whatever the
        callbacks' order. Under merak3d: reduce this rank's table gradients over the data-parallel group with S2
        and name them in ``_ddp_params_and_buffers_to_ignore``, right before merak3d averages the rest."""
        if not self._layout_aware and getattr(trainer.strategy.model, "require_backward_grad_sync", True):
            if self._sparse_lookups is not None:
                self._sparse_lookups.densify()
            self._reduce_excluded_tables(trainer.optimizers)
        if not (self._active and self._layout_aware and self.excluded_reducer is not None):
            return
        model = pl_module.model
        rename = model.original_name if isinstance(model, RankStages) else (lambda name: name)
        local = [
            (f"model.{name}", self._layout_tables[rename(name)], parameter)
            for name, parameter in model.named_parameters()
            if rename(name) in self._layout_tables
        ]
        ignore_in_ddp(pl_module, [name for name, _, _ in local])
        reduced = self.excluded_reducer.reduce_now([(table, p.grad, p.shape) for _, table, p in local])
        for (_, _, parameter), gradient in zip(local, reduced):
            parameter.grad = gradient

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """With ``priority``: hand each sharded table the ids of the next batch."""
        if not (self._active and self.priority and self.sharded_tables):
            return
        upcoming = next_batch_ids(trainer, pl_module, self.priority_ids)
        for table in self.distinct_tables:
            table.prioritize(upcoming)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        strategy = trainer.strategy
        if self.bandwidth_gbit is not None:
            network = NetworkModel.from_gbit(self.bandwidth_gbit, self.latency_us)
        else:
            measured = measure_bandwidth(data_parallel_group(strategy))
            network = NetworkModel(measured.bandwidth_bytes_per_s, self.latency_us * 1e-6)
            log.info("SparseCommunication: measured %.3g Gbit/s", network.bandwidth_bytes_per_s * 8 / 1e9)
        scan_speed = measure_scan_speed(pl_module.device)
        for reducer in (self.hook_reducer, self.excluded_reducer):
            if reducer is not None:
                reducer.network = network
                reducer.scan_bytes_per_s = scan_speed
        if self.hook_reducer is None or not self.hook_reducer.tables:
            return
        model = strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"expected the strategy to have wrapped the model in DDP, found {type(model).__name__}")
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError(
                "the DDPStrategy already has ddp_comm_hook set and DDP accepts one hook per model; "
                "remove ddp_comm_hook from the strategy or drop SparseCommunication"
            )
        model.register_comm_hook(self.hook_reducer, s2_comm_hook)

    def _reduce_excluded_tables(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Under DDP: reduce the tables excluded from DDP (``sparse=True`` embeddings) that an optimizer steps."""
        if not self.excluded_tables or self.excluded_reducer is None:
            return
        in_optimizer = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
        tables = [(name, p) for name, p in self.excluded_tables.items() if id(p) in in_optimizer]
        reduced = self.excluded_reducer.reduce_now([(name, p.grad, p.shape) for name, p in tables])
        for (_, parameter), gradient in zip(tables, reduced):
            parameter.grad = gradient

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log ``sparse_comm/<category>_wire_mb``: the megabytes this rank has sent per category since fit start,
        a running total (two steps' difference is what the step sent)."""
        if self.ledger is None:
            return
        for category, wire in self.ledger.snapshot().items():
            pl_module.log(f"sparse_comm/{category}_wire_mb", wire / 1e6, on_step=True, reduce_fx="max")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._sparse_lookups is not None:
            self._sparse_lookups.restore()
            self._sparse_lookups = None

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Replace the optimizer state of each EmbRace slice by the whole table's (:mod:`.embrace_checkpoint`), as
        one rank writes the checkpoint; the model's own hook puts in the whole tables (:func:`.save_whole_tables`)."""
        if self.sharded_tables and "optimizer_states" in checkpoint:
            gather_optimizer_states(checkpoint, trainer.optimizers, self.sharded_tables)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Keep this rank's columns of each EmbRace table's optimizer state, before Lightning restores the
        optimizers: now, or, for a model built in ``configure_model`` (restored before its tables are sharded),
        right after sharding them."""
        if self.method != "embrace" or GATHERED_ENTRIES not in checkpoint:
            return  # an unsharded run resumes the whole tables' state as it is
        self._unsliced_checkpoint = checkpoint
        if self.sharded_tables:
            self._slice_loaded_optimizer_states()

    def _slice_loaded_optimizer_states(self) -> None:
        if self._unsliced_checkpoint is not None:
            slice_optimizer_states(self._unsliced_checkpoint, self.sharded_tables)
            self._unsliced_checkpoint = None

    def state_dict(self) -> dict[str, Any]:
        frozen = sorted({
            name for reducer in (self.hook_reducer, self.excluded_reducer) if reducer is not None
            for name in reducer._frozen_dense
        })
        return {
            "method": self.method,
            "mode": self.mode,
            "seed": self.sketch.seed,
            "sketch_rows": self.sketch.num_rows,
            "column_factor": self.column_factor,
            "frozen_dense": frozen,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the hash seed and sketch shape, so a resumed run hashes as before."""
        self.sketch = CountSketch(int(state_dict["sketch_rows"]), int(state_dict["seed"]))
        self.column_factor = float(state_dict["column_factor"])
        self._restored_frozen = set(state_dict.get("frozen_dense", []))
        for reducer in (self.hook_reducer, self.excluded_reducer):
            if reducer is not None:
                reducer.sketch = self.sketch
                reducer._frozen_dense.update(self._restored_frozen)

