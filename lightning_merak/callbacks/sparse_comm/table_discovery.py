"""Which embedding tables :class:`~.callback.SparseCommunication` takes over, when they exist, and what it says
when there are none. Reads the module only: no collective."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_merak.parallel.pipeline.stage import tied_parameter_names


def find_tables(module: nn.Module, names: list[str] | None, min_table_rows: int) -> dict[str, nn.Embedding]:
    """The ``nn.Embedding`` modules named by ``names``, or else those with at least ``min_table_rows`` rows."""
    embeddings = {name: m for name, m in module.named_modules() if isinstance(m, nn.Embedding)}
    if names is not None:
        missing = [name for name in names if name not in embeddings]
        if missing:
            raise ValueError(
                f"tables {missing} are not nn.Embedding modules of the LightningModule; "
                f"embeddings found: {sorted(embeddings)}"
            )
        return {name: embeddings[name] for name in names}
    return {name: m for name, m in embeddings.items() if m.num_embeddings >= min_table_rows}


def builds_model_later(module: nn.Module) -> bool:
    """Whether the module has no embedding yet and overrides ``configure_model``, which Lightning calls after the
    callbacks' ``setup``: its tables are looked for once that has built them."""
    return (isinstance(module, pl.LightningModule) and is_overridden("configure_model", module)
            and not any(isinstance(m, nn.Embedding) for m in module.modules()))


def check_materialised(tables: dict[str, nn.Embedding]) -> None:
    """Refuse tables on the meta device for EmbRace: a sharded table keeps this rank's columns of the values,
    which no rank has yet (and merak3d's materialisation knows nothing of the shards)."""
    on_meta = [name for name, module in tables.items() if module.weight.is_meta]
    if on_meta:
        raise ValueError(
            f"EmbRace cannot shard {on_meta}: their weights are on the meta device (merak3d builds a model created "
            "in configure_model() or under trainer.init_module(empty_init=True) there, as merak-train does); build "
            "the model in the LightningModule's __init__, or use method='s2' (merak-train: comm=s2, or strategy=ddp)"
        )


def no_table_message(module: nn.Module, method: str, names: list[str] | None, min_table_rows: int) -> str:
    """Why nothing was replaced, with the embeddings' sizes and the override that would pick them.

    A run that asked for a sparse method and silently trains dense is easy to mistake for one
    that used it; the override is named in both spellings, as the callback cannot tell whether
    it was built in Python or by ``merak-train``'s ``comm`` option.
    """
    skipped = f"SparseCommunication({method!r}) replaces nothing, every gradient stays dense"
    sizes = {name: m.num_embeddings for name, m in module.named_modules() if isinstance(m, nn.Embedding)}
    if not sizes:
        return f"{skipped}: {type(module).__name__} has no nn.Embedding; drop it (merak-train: comm=dense)"
    listed = ", ".join(f"{name}: {rows} rows" for name, rows in sizes.items())
    if names is not None:
        return f"{skipped}: tables=[] names no table; name some of: {listed}"
    largest = max(sizes.values())
    return (
        f"{skipped}: no nn.Embedding has min_table_rows={min_table_rows} rows or more ({listed}). "
        f"To use {method!r} on them, set min_table_rows={largest} "
        f"(merak-train: comm.min_table_rows={largest})"
    )


def read_alone(module: nn.Module, embedding: nn.Embedding) -> bool:
    """Whether no module but ``embedding`` holds its weight (a tied head would)."""
    return sum(any(p is embedding.weight for p in m.parameters(recurse=False)) for m in module.modules()) == 1


def layout_table_names(pl_module: pl.LightningModule, tables: dict[str, nn.Embedding]) -> dict[str, str]:
    """Each table's weight and its tied copies, by name in ``pl_module.model`` before merak3d's layout
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
