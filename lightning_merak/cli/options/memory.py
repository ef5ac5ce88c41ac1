"""Hydra option ``memory=delta``: the :class:`DeltaMemory` callback from a structured config.

The budget is a string (Hydra structured configs cannot hold a union of int, float and
str): ``"auto"``, a fraction ``"0.5"``/``"50%"``, or bytes ``"2GiB"``/``"1073741824"``.
It is parsed when the option object is created and again in ``build_callbacks``, so a
bad value fails with a message naming the accepted forms before training starts. Every other
field, its default and its check come from :class:`~lightning_merak.callbacks.delta.options.DeltaOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from lightning_merak.callbacks.delta.budget import parse_budget
from lightning_merak.callbacks.delta.options import DeltaOptions
from lightning_merak.cli.config import CallbackOptionConfig, register_option
from lightning_merak.util.fields import option

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DeltaMemoryConfig", "register"]


@dataclass
class _Budget(CallbackOptionConfig):
    name: str = "delta"
    budget: str = option(
        "auto", "Bytes of saved activations (`2GiB`, `1073741824`), a fraction of the device's memory for the "
        "whole process (`0.5`, `50%`), or `auto` (90%).")


@dataclass
class DeltaMemoryConfig(DeltaOptions, _Budget):
    """``memory=delta memory.budget=...``: the budget, then every field of
    :class:`~lightning_merak.callbacks.delta.options.DeltaOptions` (defaults and checks live there)."""

    def __post_init__(self) -> None:
        parse_budget(str(self.budget))

    def build_callbacks(self) -> list[pl.Callback]:
        from lightning_merak.callbacks.delta.callback import DeltaMemory  # lazy: torch, Lightning

        settings = {item.name: getattr(self, item.name) for item in fields(DeltaOptions)}
        return [DeltaMemory(budget=parse_budget(str(self.budget)), **settings)]


def register() -> None:
    """Register ``memory=delta``'s schema (called by the project's config setup)."""
    register_option("memory", "delta", DeltaMemoryConfig)
