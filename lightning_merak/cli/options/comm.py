"""Hydra ``comm`` options: ``comm=s2``, ``comm=embrace``, ``comm=auto``, ``comm=dense``.

Each option is a :class:`CallbackOptionConfig` whose callbacks ``merak-train`` adds to
the trainer; ``dense`` adds none (DDP's own all-reduce). :func:`register` stores the
schemas under ``schema/comm/<name>`` for the YAMLs in ``conf/comm/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from lightning_merak.cli.config import CallbackOptionConfig, register_option
from lightning_merak.util.fields import option

if TYPE_CHECKING:
    import lightning.pytorch as pl


@dataclass
class DenseCommConfig(CallbackOptionConfig):
    """DDP's dense all-reduce, unchanged."""

    name: str = "dense"


@dataclass
class S2CommConfig(CallbackOptionConfig):
    """S2 reducer; ``mode: exact`` reproduces dense all-reduce, ``sketch`` is lossy and smaller."""

    name: str = "s2"
    mode: str = option(
        "exact", "`exact` reproduces dense all-reduce; `sketch` sends a count sketch (lossy) when it has fewer rows "
        "than the union of non-zero rows, i.e. when `sketch_rows` × `column_factor` < 1, and the union otherwise.")
    sketch_rows: int = option(3, "Rows of the count sketch, odd (median decode).")
    column_factor: float = option(2.0, "Sketch columns per row of the union of non-zero rows.")
    seed: int = option(0, "Hash seed, the same on every rank and stored in checkpoints.")
    min_table_rows: int = option(1024, "`nn.Embedding` modules with at least this many rows are tables.")
    bandwidth_gbit: Optional[float] = option(None, "Link bandwidth for the cost model (`null`: measured at fit "
                                             "start).")
    latency_us: float = option(50.0, "Per-message latency for the cost model, in microseconds.")

    def build_callbacks(self) -> list[pl.Callback]:
        from lightning_merak.callbacks.sparse_comm.callback import SparseCommunication  # lazy: torch, Lightning

        return [SparseCommunication(
            "s2", mode=self.mode, sketch_rows=self.sketch_rows, column_factor=self.column_factor,
            seed=self.seed, min_table_rows=self.min_table_rows, bandwidth_gbit=self.bandwidth_gbit,
            latency_us=self.latency_us,
        )]


@dataclass
class EmbraceCommConfig(CallbackOptionConfig):
    """EmbRace: tables column-sharded over the data-parallel ranks; ``priority`` sends the
    gradient rows the next batch looks up first."""

    name: str = "embrace"
    min_table_rows: int = option(1024, "`nn.Embedding` modules with at least this many rows are tables.")
    priority: bool = option(
        False, "Send first the gradient rows the next batch looks up (read one step ahead); the gradient is "
        "unchanged, only the order of communication.")

    def build_callbacks(self) -> list[pl.Callback]:
        from lightning_merak.callbacks.sparse_comm.callback import SparseCommunication  # lazy: torch, Lightning

        return [SparseCommunication("embrace", min_table_rows=self.min_table_rows, priority=self.priority)]


@dataclass
class AutoCommConfig(CallbackOptionConfig):
    """Per table and step, the cheapest exact method by the cost model; reasons are logged."""

    name: str = "auto"
    min_table_rows: int = option(1024, "`nn.Embedding` modules with at least this many rows are tables.")
    bandwidth_gbit: Optional[float] = option(None, "Link bandwidth for the cost model (`null`: measured at fit "
                                             "start).")
    latency_us: float = option(50.0, "Per-message latency for the cost model, in microseconds.")
    freeze_dense_after: int = option(
        3, "Stop exchanging bitmaps for a table chosen dense this many steps in a row.")

    def build_callbacks(self) -> list[pl.Callback]:
        from lightning_merak.callbacks.sparse_comm.callback import SparseCommunication  # lazy: torch, Lightning

        return [SparseCommunication(
            "auto", min_table_rows=self.min_table_rows, bandwidth_gbit=self.bandwidth_gbit,
            latency_us=self.latency_us, freeze_dense_after=self.freeze_dense_after,
        )]


OPTIONS: dict[str, type[CallbackOptionConfig]] = {
    "dense": DenseCommConfig,
    "s2": S2CommConfig,
    "embrace": EmbraceCommConfig,
    "auto": AutoCommConfig,
}


def register() -> None:
    """Register every ``comm`` option's schema (idempotent)."""
    for name, node in OPTIONS.items():
        register_option("comm", name, node)
