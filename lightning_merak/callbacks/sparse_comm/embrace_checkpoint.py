"""EmbRace's tables and optimizer state in a checkpoint: whole tables, as an unsharded run saves them.

The weights go in through the LightningModule's own ``on_save_checkpoint`` (:func:`save_whole_tables`), which
Lightning calls for every checkpoint; a callback's hook runs for full checkpoints only, so a weights-only save
(``ModelCheckpoint(save_weights_only=True)``) would otherwise hold one rank's columns of each table.

Each rank's optimizer holds the state of its columns only (Adam's moments of a ``[V, H_r]`` slice), while the
checkpoint is written by one rank (DDP: rank 0) or keeps one copy of a tensor every rank holds (merak3d's sharded
checkpoint takes a plain tensor as replicated). So before a checkpoint is written every rank gathers each state
tensor of its slices into the whole table's (:func:`gather_optimizer_states`), and a resumed run keeps this rank's
columns of it (:func:`slice_optimizer_states`), for any number of ranks. The checkpoint records which entries it
gathered (:data:`GATHERED_ENTRIES`), since a whole table's moments cannot be told from an untied head's of the same
shape.

Both of Lightning's optimizer-state formats are read alike: torch's (entries numbered, DDP) and merak3d's (entries
keyed by parameter name); a composite optimizer's (``{"parts": [...]}``, ``MuonWithAdamW``) part by part.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_merak.callbacks.sparse_comm.embrace import ShardedEmbedding, weight_holder_names
from lightning_merak.util.optimizer_state import state_parts

GATHERED_ENTRIES = "sparse_comm_embrace_optimizer_entries"
"""Checkpoint key: per optimizer, ``[part, entry key, table name]`` of each state entry saved whole."""


def whole_tables_in(state: dict[str, Any] | None, model: nn.Module, tables: list[ShardedEmbedding]) -> None:
    """Replace each rank-local slice in the module state ``state`` by the whole table, under every name the unsharded
    model saved it (each embedding sharing it and each tied head). A collective per table: every rank calls it."""
    for table in tables:
        full = table.full_weight()
        if state is None:
            continue
        for name in weight_holder_names(model, table):
            state.pop(f"{name}.shard", None)
            state[f"{name}.weight"] = full


class _WholeTablesFirst:
    """``model.on_save_checkpoint`` with the whole tables put into the checkpoint's state dict first, so the
    model's own hook (``user_hook``) sees them as an unsharded run's."""

    def __init__(self, model: nn.Module, user_hook: Any, tables: list[ShardedEmbedding]) -> None:
        self.model, self.user_hook, self.tables = model, user_hook, tables

    def __call__(self, checkpoint: dict[str, Any]) -> None:
        whole_tables_in(checkpoint.get("state_dict"), self.model, self.tables)
        self.user_hook(checkpoint)


def save_whole_tables(model: nn.Module, tables: list[ShardedEmbedding]) -> None:
    """Make every checkpoint of ``model`` (a LightningModule whose ``tables`` EmbRace sharded) hold the whole
    tables, weights-only ones included; ``tables`` is the list the model's hook reads (kept current by the caller)."""
    hook = model.on_save_checkpoint
    if isinstance(hook, _WholeTablesFirst):
        hook.tables = tables
        return
    model.on_save_checkpoint = _WholeTablesFirst(model, hook, tables)


def _saved_entries(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> Iterator[tuple[int, Any, Any]]:
    """``(part, entry key, parameter)`` for each parameter of ``optimizer`` in its saved state ``saved``: the saved
    groups list their parameters' keys in the order of the optimizer's groups."""
    saved_groups = [(part, group) for part, state in enumerate(state_parts(saved)) for group in state["param_groups"]]
    for (part, saved_group), group in zip(saved_groups, optimizer.param_groups):
        for key, param in zip(saved_group["params"], group["params"]):
            yield part, key, param


def gather_optimizer_states(checkpoint: dict[str, Any], optimizers: list[torch.optim.Optimizer],
                            tables: dict[str, ShardedEmbedding]) -> None:
    """Replace, in ``checkpoint["optimizer_states"]``, each state tensor of a table's slice by the whole table's, and
    record the entries in :data:`GATHERED_ENTRIES`. A collective: every rank calls it with the same optimizers (their
    entries follow the same order on every rank). The live optimizer state is left as it is."""
    saved_states = checkpoint.get("optimizer_states")
    if saved_states is None:
        return
    by_shard: dict[int, tuple[str, ShardedEmbedding]] = {}
    for name, table in tables.items():
        by_shard.setdefault(id(table.shard), (name, table))
    gathered: list[list[list[Any]]] = []
    for optimizer, saved in zip(optimizers, saved_states):
        entries = []
        states = [part["state"] for part in state_parts(saved)]
        for part, key, param in _saved_entries(optimizer, saved):
            found = by_shard.get(id(param))
            if found is None or key not in states[part]:
                continue
            name, table = found
            states[part][key] = {  # a new dict: torch's state_dict hands out the optimizer's own
                field: table.full_columns(value) if isinstance(value, torch.Tensor)
                and value.shape == table.shard.shape else value
                for field, value in states[part][key].items()
            }
            entries.append([part, key, name])
        gathered.append(entries)
    checkpoint[GATHERED_ENTRIES] = gathered


def slice_optimizer_states(checkpoint: dict[str, Any], tables: dict[str, ShardedEmbedding]) -> None:
    """Keep, in the optimizer states of a checkpoint :func:`gather_optimizer_states` wrote, this rank's columns of
    each whole table's state, in place; a checkpoint without gathered entries is left as it is."""
    recorded = checkpoint.pop(GATHERED_ENTRIES, None)
    if recorded is None:
        return
    for entries, saved in zip(recorded, checkpoint.get("optimizer_states", [])):
        states = [part["state"] for part in state_parts(saved)]
        for part, key, name in entries:
            table = tables.get(name)
            if table is None or part >= len(states) or key not in states[part]:
                raise ValueError(
                    f"the checkpoint holds the optimizer state of EmbRace table {name!r} whole under entry {key!r}, "
                    f"which this run's {'optimizer lacks' if table is not None else 'EmbRace does not shard'}: "
                    "resume with SparseCommunication('embrace') over the same tables, strategy and "
                    "configure_optimizers the checkpoint was saved with"
                )
            states[part][key] = {
                field: table.own_columns(value).clone() if isinstance(value, torch.Tensor)
                and value.shape == (table.num_embeddings, table.dim) else value
                for field, value in states[part][key].items()
            }
