"""EmbRace: embedding tables column-sharded across the data-parallel ranks.

Each rank keeps the columns ``[V, H_r]`` of a table (column sharding is balanced under
Zipf-distributed ids, row sharding is not). A lookup all-gathers the token ids, looks
up its columns for every rank's tokens and returns them with one all-to-all; backward
sends each owner its columns of the output gradient with the reverse all-to-all, and
the owner adds them into its slice. The tables are kept out of DDP, so they are never
all-reduced, and their optimizer state is sharded for free. The collectives, their
overlap with DDP, priority and ranks taking different branches are in :mod:`.embrace_exchange`.

A tied output head (a ``Linear`` whose weight *is* the table) is swapped for :class:`ShardedTiedHead`: it
all-gathers the full table for the logits and reduce-scatters the head's gradient back to the owners. The head's
gradient is dense, so this costs what a dense all-reduce of the table does; it keeps tied models correct without
editing them. Embeddings sharing one weight become one table, installed under each of their names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_merak.callbacks.sparse_comm.bytes_counter import CommLedger
from lightning_merak.callbacks.sparse_comm.embrace_exchange import (
    GATHER,
    LOOKUP,
    ExchangeTiming,
    GatherColumns,
    ShardedLookup,
    coordinator_for,
    gather_columns,
)

EMBEDDING = "embedding"


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


def join_lookups(tables: Iterable[ShardedEmbedding], loss: torch.Tensor | None = None) -> None:
    """Answer the peers' outstanding lookups of ``tables``; call it on every rank before the backward
    pass of ``loss`` (Lightning: ``on_before_backward``), or with no loss after a forward without one.

    Why: a rank whose batch did not look a table up would otherwise leave its peers waiting in
    their lookup forever. When any rank served a request it did not make in this step, every
    gradient exchange of the step waits for the end of the backward pass of ``loss``. Those peers wait
    until this call: a collective of another kind on the way to it (``self.log(sync_dist=True)`` in the
    training step) waits for them in turn, and the step hangs.
    """
    coordinators = list({id(table.coordinator): table.coordinator for table in tables}.values())
    for coordinator in coordinators:
        coordinator.join()
    for coordinator in coordinators:
        coordinator.schedule_exchange(loss)


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
        requires_grad: bool = True,
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
        self.shard = nn.Parameter(weight.detach()[:, start:stop].clone(), requires_grad=requires_grad)
        self._upcoming_ids: torch.Tensor | None = None
        self.last_exchange: ExchangeTiming | None = None
        self.coordinator = coordinator_for(process_group)
        self.key = self.coordinator.register(self)

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, process_group: dist.ProcessGroup | None = None, ledger: CommLedger | None = None
    ) -> ShardedEmbedding:
        """Shard ``embedding``; its weight is broadcast from the group's first rank first,
        because the table leaves DDP, which would otherwise do that. A frozen table (``requires_grad=False``: a
        PEFT/LoRA base) stays frozen."""
        check_shardable(embedding)
        weight = embedding.weight.detach().clone()
        dist.broadcast(weight, src=dist.get_global_rank(process_group or dist.group.WORLD, 0), group=process_group)
        return cls(weight, process_group, embedding.padding_idx, ledger, embedding.weight.requires_grad)

    def record(self, operation: str, payload_bytes: float) -> None:
        if self.ledger is not None:
            self.ledger.record(operation, payload_bytes, EMBEDDING)

    def record_all_to_all(self, input_split_sizes: list[int], element_bytes: int) -> None:
        """One all-to-all, by the elements this rank sends to each rank (its ``input_split_sizes``): the bytes it
        sends to the other ranks. A lookup sends this rank's columns of every peer's rows, its backward every
        owner's columns of this rank's rows; they differ when ranks look up different numbers of ids or own columns
        of different widths."""
        if self.ledger is None:
            return
        sent = sum(size for r, size in enumerate(input_split_sizes) if r != self.group_rank) * element_bytes
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
        requests = self.coordinator.request(self, LOOKUP, ids.numel(), upcoming.numel())
        return ShardedLookup.apply(self.shard, ids, upcoming, self, requests)

    def gathered_weight(self) -> torch.Tensor:
        """The full ``[V, H]`` table, differentiable (used by a tied head)."""
        requests = self.coordinator.request(self, GATHER, 0, 0)
        return GatherColumns.apply(self.shard, self, requests)

    def full_weight(self) -> torch.Tensor:
        """The full table as a plain tensor (a collective: every rank of the group must call it)."""
        return self.full_columns(self.shard)

    def full_columns(self, columns: torch.Tensor) -> torch.Tensor:
        """The whole ``[V, H]`` tensor of which ``columns`` is this rank's ``[V, H_r]`` slice (the weight, or an
        optimizer state of it), as a plain tensor (a collective: every rank of the group must call it)."""
        with torch.no_grad():
            self.coordinator.request(self, GATHER, 0, 0)
            return gather_columns(self, columns.detach())

    def own_columns(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's ``[V, H_r]`` columns of a whole ``[V, H]`` tensor (a view)."""
        start, stop = self.bounds[self.group_rank]
        return full[:, start:stop]

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        full_key = prefix + "weight"
        if full_key in state_dict:
            state_dict[prefix + "shard"] = self.own_columns(state_dict.pop(full_key))
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
