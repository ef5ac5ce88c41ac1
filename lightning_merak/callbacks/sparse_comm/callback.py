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

Clipping has one owner per run. A layout-aware strategy clips, and EmbRace registers its
column shards with it (``register_sharded_gradients``) so the norm sums their squares over
the group. Lightning's DDP has no owner that could know of shards: there EmbRace installs
:meth:`~lightning_merak.distributed.gradient_norm.ShardedGradients.clip` as the precision plugin's
``clip_grad_by_norm``, the only clipping of that run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_merak.callbacks.sparse_comm.arguments import check_arguments, table_names
from lightning_merak.callbacks.sparse_comm.bytes_counter import CommLedger
from lightning_merak.callbacks.sparse_comm.embrace import (
    ShardedEmbedding,
    join_lookups,
    shard_embeddings,
    table_groups,
    weight_holder_names,
)
from lightning_merak.callbacks.sparse_comm.s2_hook import AUTO, S2Reducer, SparseLookups, s2_comm_hook
from lightning_merak.callbacks.sparse_comm.sketch import CountSketch, drop_zero_rows
from lightning_merak.callbacks.sparse_comm.wire_cost_model import NetworkModel
from lightning_merak.distributed.gradient_norm import ShardedGradients
from lightning_merak.distributed.process_groups import collective_device, new_group
from lightning_merak.parallel.pipeline.stage import RankStages, tied_parameter_names
from lightning_merak.protocols.layout_aware import LayoutAwareStrategy, data_parallel_groups_from_mesh, layout_aware
from lightning_merak.util.timing import DeviceTimer

log = logging.getLogger(__name__)

Method = Literal["s2", "embrace", "auto"]
Mode = Literal["exact", "sketch"]
EMBRACE_NEEDS_ONE_STAGE = (
    "method='embrace' under merak3d needs pipeline_parallel=1: with pipeline stages the layout trace runs the first "
    "stage on rank 0 alone, which a sharded table cannot; set pipeline_parallel=1 (merak-train: "
    "strategy.pipeline_parallel=1) or use method='s2' (merak-train: comm=s2)")
"""Why EmbRace refuses a merak3d layout with pipeline stages (merak-train checks it before launch too)."""
_BANDWIDTH_PROBE_BYTES = 4 * 1024 * 1024
_BANDWIDTH_PROBE_REPEATS = 3


def data_parallel_group(strategy: pl.strategies.Strategy) -> dist.ProcessGroup | None:
    """The strategy's data-parallel group (``None`` means the world group)."""
    group = getattr(strategy, "data_parallel_group", None)
    return group() if callable(group) else group


def _measure_bandwidth(group: dist.ProcessGroup | None) -> NetworkModel:
    """Time an all-reduce on ``group``; the slowest rank's time, so all ranks agree."""
    probe = torch.zeros(_BANDWIDTH_PROBE_BYTES // 4, device=collective_device(group))
    dist.all_reduce(probe, group=group)
    with DeviceTimer(probe.device) as timer:
        for _ in range(_BANDWIDTH_PROBE_REPEATS):
            dist.all_reduce(probe, group=group)
    elapsed = torch.tensor([timer.seconds / _BANDWIDTH_PROBE_REPEATS], dtype=torch.float64, device=probe.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    world_size = dist.get_world_size(group)
    wire_bytes = 2 * (world_size - 1) / world_size * _BANDWIDTH_PROBE_BYTES
    return NetworkModel(bandwidth_bytes_per_s=wire_bytes / max(elapsed.item(), 1e-9))


def _measure_scan_speed(device: torch.device) -> float:
    """Bytes per second at which this rank finds all-zero gradient rows (local, no collective)."""
    probe = torch.ones(_BANDWIDTH_PROBE_BYTES // 4 // 64, 64, device=device)
    drop_zero_rows(torch.arange(probe.shape[0], device=device), probe)
    with DeviceTimer(device) as timer:
        for _ in range(_BANDWIDTH_PROBE_REPEATS):
            drop_zero_rows(torch.arange(probe.shape[0], device=device), probe)
    elapsed = timer.seconds / _BANDWIDTH_PROBE_REPEATS
    return _BANDWIDTH_PROBE_BYTES / max(elapsed, 1e-9)


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
            scanning its gradient, and under DDP look it up sparsely (``SparseLookups``); tied
            tables are always scanned and looked up densely. Set ``False`` if the model reads a table's weight outside
            its ``nn.Embedding`` (e.g. ``F.linear(x, emb.weight)``).
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

    @property
    def seed(self) -> int:
        return self.sketch.seed

    def _hook_method(self) -> str:
        if self.method == "auto":
            return AUTO
        return "s2_exact" if self.mode == "exact" else "s2_sketch"

    def _find_tables(self, pl_module: pl.LightningModule) -> dict[str, nn.Embedding]:
        embeddings = {name: m for name, m in pl_module.named_modules() if isinstance(m, nn.Embedding)}
        if self.table_names is not None:
            missing = [name for name in self.table_names if name not in embeddings]
            if missing:
                raise ValueError(
                    f"tables {missing} are not nn.Embedding modules of the LightningModule; "
                    f"embeddings found: {sorted(embeddings)}"
                )
            return {name: embeddings[name] for name in self.table_names}
        return {name: m for name, m in embeddings.items() if m.num_embeddings >= self.min_table_rows}

    def _no_table_message(self, pl_module: pl.LightningModule) -> str:
        """Why nothing was replaced, with the embeddings' sizes and the override that would pick them.

        A run that asked for a sparse method and silently trains dense is easy to mistake for one
        that used it; the override is named in both spellings, as the callback cannot tell whether
        it was built in Python or by ``merak-train``'s ``comm`` option.
        """
        skipped = f"SparseCommunication({self.method!r}) replaces nothing, every gradient stays dense"
        sizes = {name: m.num_embeddings for name, m in pl_module.named_modules() if isinstance(m, nn.Embedding)}
        if not sizes:
            return f"{skipped}: {type(pl_module).__name__} has no nn.Embedding; drop it (merak-train: comm=dense)"
        listed = ", ".join(f"{name}: {rows} rows" for name, rows in sizes.items())
        if self.table_names is not None:
            return f"{skipped}: tables=[] names no table; name some of: {listed}"
        largest = max(sizes.values())
        return (
            f"{skipped}: no nn.Embedding has min_table_rows={self.min_table_rows} rows or more ({listed}). "
            f"To use {self.method!r} on them, set min_table_rows={largest} "
            f"(merak-train: comm.min_table_rows={largest})"
        )

    def check_tables(self, pl_module: pl.LightningModule) -> None:
        """Refuse tables EmbRace cannot shard (an option it lacks, a class overriding the lookup: Gemma's scaled
        embedding; embeddings sharing a weight that differ in ``padding_idx``), with no collective: ``merak-train``
        calls it before launch, ``setup`` before any other work."""
        if self.method == "embrace":
            table_groups(pl_module, list(self._find_tables(pl_module)))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.check_tables(pl_module)
        strategy = trainer.strategy
        layout = layout_aware(strategy)
        self._layout_aware = layout is not None
        if layout is None and not isinstance(strategy, DDPStrategy):
            if trainer.world_size == 1:
                log.warning("SparseCommunication: single process, no gradient communication to replace")
                return
            raise TypeError(
                f"SparseCommunication works under DDP or merak3d; the trainer uses {type(strategy).__name__}. "
                "Use strategy='ddp' (or a DDPStrategy subclass) or Merak3DStrategy"
            )
        if layout is not None:
            self._check_layout(layout)
            if layout.data_parallel == 1:
                log.warning("SparseCommunication: merak3d has data_parallel=1, no gradient communication to replace")
                return
        if self.priority and self.priority_ids is None and not callable(getattr(pl_module, "split_batch", None)):
            raise ValueError(
                f"priority=True needs the token ids of a batch: {type(pl_module).__name__} has no split_batch; "
                "pass priority_ids=<function from a batch to its ids>"
            )
        tables = self._find_tables(pl_module)
        if not tables:
            rank_zero_warn(self._no_table_message(pl_module))
            return
        group = data_parallel_group(strategy)
        comm_group = self._dedicated_group(strategy, group)
        self.ledger = CommLedger(dist.get_world_size(group))
        ignored: list[str] = []
        if self.method == "embrace":
            if self._layout_aware:
                for module in tables.values():
                    dist.broadcast(module.weight.data, src=0)  # merak3d's replicas all start from rank 0's weights
            self.sharded_tables = shard_embeddings(pl_module, list(tables), comm_group, self.ledger)
            ignored = [f"{name}.shard" for name in self.sharded_tables]
            # each shard once: the names of embeddings sharing a weight map to one table
            shards = list({id(table): table.shard for table in self.sharded_tables.values()}.values())
            if layout is not None:
                layout.register_sharded_gradients(shards, comm_group)
            else:
                self._clip_with_shards(trainer, shards, comm_group)
        elif self._layout_aware:
            self._layout_tables = self._layout_table_names(pl_module, tables)
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
                _gradients_in_buckets(strategy)
                self._sparse_lookups = SparseLookups([m for m in tables.values() if id(m.weight) in hooked
                                                      and self.rows_from_ids and _read_alone(pl_module, m)])
        if ignored:
            self._ignore_in_ddp(pl_module, ignored)
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
            alone = _read_alone(pl_module, module)
            if self.rows_from_ids and alone and reducer is not None:
                reducer.watch_lookups(name, module)
            elif not alone:
                log.info("SparseCommunication: %s is shared with another module (tied); scanning its gradient", name)

    @staticmethod
    def _dedicated_group(strategy: pl.strategies.Strategy, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        provided = getattr(strategy, "sparse_comm_process_group", None)
        if provided is not None:
            return provided() if callable(provided) else provided
        layout = layout_aware(strategy)
        if layout is not None:
            return _new_data_parallel_groups(layout)
        if group is None or group is dist.group.WORLD:
            return new_group(ranks=list(range(dist.get_world_size())))
        return group

    def _check_layout(self, strategy: LayoutAwareStrategy) -> None:
        """Refuse what EmbRace cannot do under merak3d, before any collective."""
        if self.method != "embrace":
            return
        # the fix in both spellings: the strategy argument and merak-train's Hydra override
        if strategy.pipeline_parallel > 1:
            raise ValueError(EMBRACE_NEEDS_ONE_STAGE)

    @staticmethod
    def _layout_table_names(pl_module: pl.LightningModule, tables: dict[str, nn.Embedding]) -> dict[str, str]:
        """Each table's weight and its tied copies, by name in ``pl_module.model`` before the layout
        is built, mapped to the name the reducer knows the table by (its module name)."""
        model = pl_module.model
        owners = {f"{name}.weight": name for name in tables}
        prefix = "model."
        if any(not weight.startswith(prefix) for weight in owners):
            raise ValueError(
                f"merak3d parallelises pl_module.model; tables {sorted(tables)} must live inside it"
            )
        names = {weight[len(prefix):]: owner for weight, owner in owners.items()}
        for group in tied_parameter_names(model):
            if any(name in names for name in group):
                names.update({name: f"{prefix}{name}" for name in group if name not in names})
        return names

    @staticmethod
    def _ignore_in_ddp(pl_module: pl.LightningModule, names: list[str]) -> None:
        ignore = getattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None)
        if ignore is None:
            raise RuntimeError(
                "this torch has no DistributedDataParallel._set_params_and_buffers_to_ignore_for_model, "
                "needed to keep tables out of DDP; use method='s2' with dense-gradient embeddings"
            )
        already = list(getattr(pl_module, "_ddp_params_and_buffers_to_ignore", []))
        ignore(pl_module, sorted(set(already) | set(names)))

    @staticmethod
    def _clip_with_shards(trainer: pl.Trainer, shards: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
        """Under DDP, which has no clipping owner of its own, clip by the norm over the whole sharded tables,
        not this rank's columns: otherwise ranks clip by different factors and replicated weights drift apart."""
        sharded = ShardedGradients()
        sharded.register(shards, group)
        trainer.strategy.precision_plugin.clip_grad_by_norm = sharded.clip

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """EmbRace: answer the peers' lookups this rank's batch did not make, so none of them waits forever.
        S2 under DDP: no dense gradient left on a sparse-lookup table (:meth:`SparseLookups.clear_stale`)."""
        if self._sparse_lookups is not None:
            self._sparse_lookups.clear_stale()
        if self.sharded_tables:
            join_lookups(self.sharded_tables.values(), loss)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        """EmbRace: the same after an evaluation forward, which has no backward pass to wait for."""
        if self.sharded_tables:
            join_lookups(self.sharded_tables.values())

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """S2 under DDP: the hook's reduced sparse gradients made dense as soon as DDP has written them, so every
        later hook (metrics, user callbacks, clipping) sees dense gradients whatever the callbacks' order; a
        backward under ``no_sync`` (gradient accumulation) keeps its local sparse gradient for the next one to add to.
        Under merak3d: reduce this rank's table gradients over the data-parallel group with S2
        and name them in ``_ddp_params_and_buffers_to_ignore``, right before merak3d averages the rest."""
        if self._sparse_lookups is not None and getattr(trainer.strategy.model, "require_backward_grad_sync", True):
            self._sparse_lookups.densify()
        if not (self._active and self._layout_aware and self.excluded_reducer is not None):
            return
        model = pl_module.model
        rename = model.original_name if isinstance(model, RankStages) else (lambda name: name)
        local = [
            (f"model.{name}", self._layout_tables[rename(name)], parameter)
            for name, parameter in model.named_parameters()
            if rename(name) in self._layout_tables
        ]
        self._ignore_in_ddp(pl_module, [name for name, _, _ in local])
        reduced = self.excluded_reducer.reduce_now([(table, p.grad, p.shape) for _, table, p in local])
        for (_, _, parameter), gradient in zip(local, reduced):
            parameter.grad = gradient

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """With ``priority``: hand each sharded table the ids of the next batch."""
        if not (self._active and self.priority and self.sharded_tables):
            return
        upcoming = self._next_batch_ids(trainer, pl_module)
        for table in self.sharded_tables.values():
            table.prioritize(upcoming)

    def _next_batch_ids(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.Tensor | None:
        """The ids of the batch after this one, or ``None`` at the end of the epoch."""
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if getattr(fetcher, "iterator", None) is None:
            raise RuntimeError(
                "priority=True reads the next batch from the iterator of Lightning's data fetcher "
                "(trainer.fit_loop._data_fetcher.iterator), which this Lightning version lacks; set priority=False"
            )
        if not isinstance(fetcher.iterator, _Lookahead):
            fetcher.iterator = _Lookahead(fetcher.iterator)
        upcoming = fetcher.iterator.peek()
        if upcoming is None:
            return None
        next_batch = upcoming[0]  # the iterator yields (batch, batch_idx, dataloader_idx)
        ids = self.priority_ids(next_batch) if self.priority_ids is not None else pl_module.split_batch(next_batch)[0]
        return ids.to(pl_module.device)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        strategy = trainer.strategy
        if self.bandwidth_gbit is not None:
            network = NetworkModel.from_gbit(self.bandwidth_gbit, self.latency_us)
        else:
            measured = _measure_bandwidth(data_parallel_group(strategy))
            network = NetworkModel(measured.bandwidth_bytes_per_s, self.latency_us * 1e-6)
            log.info("SparseCommunication: measured %.3g Gbit/s", network.bandwidth_bytes_per_s * 8 / 1e9)
        scan_speed = _measure_scan_speed(pl_module.device)
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

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Reduce the tables excluded from DDP (``sparse=True`` embeddings) that this optimizer steps."""
        if self._layout_aware or not self.excluded_tables or self.excluded_reducer is None:
            return
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        tables = [(name, p) for name, p in self.excluded_tables.items() if id(p) in in_optimizer]
        reduced = self.excluded_reducer.reduce_now([(name, p.grad, p.shape) for name, p in tables])
        for (_, parameter), gradient in zip(tables, reduced):
            parameter.grad = gradient

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
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
        """Replace each rank-local EmbRace slice by the full table (gathered on every rank, once per table), under
        every name the unsharded model saved it: each embedding sharing it and each tied head."""
        state = checkpoint.get("state_dict")
        for table in {id(table): table for table in self.sharded_tables.values()}.values():
            full = table.full_weight()
            if state is None:
                continue
            for name in weight_holder_names(pl_module, table):
                state.pop(f"{name}.shard", None)
                state[f"{name}.weight"] = full

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


def _read_alone(pl_module: pl.LightningModule, embedding: nn.Embedding) -> bool:
    """Whether no module but ``embedding`` holds its weight (a tied head would)."""
    return sum(any(p is embedding.weight for p in m.parameters(recurse=False)) for m in pl_module.modules()) == 1


def _new_data_parallel_groups(strategy: LayoutAwareStrategy) -> dist.ProcessGroup:
    """A new group per data-parallel group of the strategy's mesh (every rank creates all of them,
    in the same order); returns this rank's."""
    mesh = strategy.device_mesh
    rank = dist.get_rank()
    own = None
    for ranks in data_parallel_groups_from_mesh(mesh.mesh.tolist(), list(mesh.mesh_dim_names)):
        group = new_group(ranks=ranks)
        if rank in ranks:
            own = group
    assert own is not None, "every rank lies in one data-parallel group of the mesh"
    return own


_NOTHING = object()
_EXHAUSTED = object()


class _Lookahead(Iterator[Any]):
    """An iterator whose next item can be read before its turn; it yields exactly the items,
    in the order, of the iterator it wraps."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator
        self._peeked: Any = _NOTHING

    def __iter__(self) -> _Lookahead:
        return self

    def __next__(self) -> Any:
        if self._peeked is _NOTHING:
            return next(self._iterator)
        item, self._peeked = self._peeked, _NOTHING
        if item is _EXHAUSTED:
            raise StopIteration
        return item

    def peek(self) -> Any | None:
        """The next item without consuming it; ``None`` when the iterator is exhausted."""
        if self._peeked is _NOTHING:
            try:
                self._peeked = next(self._iterator)
            except StopIteration:
                self._peeked = _EXHAUSTED
        return None if self._peeked is _EXHAUSTED else self._peeked


def _gradients_in_buckets(strategy: pl.strategies.Strategy) -> None:
    """Let DDP keep gradients as views of its buckets, unless the user chose otherwise.

    The hook hands each bucket's dense table gradient to the S2 reducer and writes the result back into the bucket;
    with gradients copied into buckets and back, a table-sized gradient crosses memory twice more per step than
    torch's sparse path does (measured, a 500k × 64 table on one CPU thread: ~56 ms per copy). Only the
    ``DDPStrategy``'s keyword arguments (a private attribute, read if present) can ask for it before DDP wraps.
    """
    ddp_kwargs = getattr(strategy, "_ddp_kwargs", None)
    if isinstance(ddp_kwargs, dict):
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)
