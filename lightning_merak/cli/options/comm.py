"""Hydra ``comm`` options: ``comm=s2``, ``comm=embrace``, ``comm=auto``, ``comm=dense``.

Each option is a :class:`CallbackOptionConfig` whose callbacks ``merak-train`` adds to
the trainer; ``dense`` adds none (DDP's own all-reduce). :func:`register` stores the
schemas under ``schema/comm/<name>`` for the YAMLs in ``conf/comm/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from lightning_merak.cli.config import CallbackOptionConfig, register_option

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
    mode: str = "exact"
    sketch_rows: int = 3
    column_factor: float = 2.0
    seed: int = 0
    min_table_rows: int = 1024
    bandwidth_gbit: Optional[float] = None
    latency_us: float = 50.0

    def build_callbacks(self) -> list[pl.Callback]:
        from lightning_merak.callbacks.sparse_comm.callback import SparseCommunication

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
    min_table_rows: int = 1024
    priority: bool = False

    def build_callbacks(self) -> list[pl.Callback]:
        from lightning_merak.callbacks.sparse_comm.callback import SparseCommunication

        return [SparseCommunication("embrace", min_table_rows=self.min_table_rows, priority=self.priority)]


@dataclass
class AutoCommConfig(CallbackOptionConfig):
    """Per table and step, the cheapest exact method by the cost model; reasons are logged."""

    name: str = "auto"
    min_table_rows: int = 1024
    bandwidth_gbit: Optional[float] = None
    latency_us: float = 50.0
    freeze_dense_after: int = 3

    def build_callbacks(self) -> list[pl.Callback]:
        from lightning_merak.callbacks.sparse_comm.callback import SparseCommunication

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
