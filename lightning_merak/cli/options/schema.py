"""Hydra schemas derived from the dataclass that defines a component's options, so each option is declared once.

A structured config can hold only plain types: :func:`schema_of` copies an options dataclass's
fields with their defaults, turning a ``Literal`` of strings into ``str`` and any other union but
``Optional[X]`` into ``Any``; the options class itself checks the values when the component is made.
Each field keeps its metadata (its description, :mod:`lightning_merak.util.fields`) and records the
options' own annotation under :data:`DECLARED_TYPE`, which the reference shows (:mod:`lightning_merak.cli.reference`).
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, field, fields, make_dataclass
from typing import Any, Optional

__all__ = ["DECLARED_TYPE", "schema_of"]

DECLARED_TYPE = "declared_type"
"""The metadata key of a schema field's annotation in the options dataclass (``Literal["a", "b"]``, not ``str``)."""

_HYDRA_TYPES = (int, float, bool, str)


def _schema_type(annotation: Any) -> Any:
    """The type a structured config can hold for ``annotation``."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return str
    if annotation in _HYDRA_TYPES:
        return annotation
    if origin in (typing.Union, types.UnionType) and len(arguments) == 2 and type(None) in arguments:
        (inner,) = [argument for argument in arguments if argument is not type(None)]
        return Optional[inner] if inner in _HYDRA_TYPES else Any
    return Any


def schema_of(options: type, name: str, bases: tuple[type, ...] = (), **defaults: Any) -> type:
    """A structured-config dataclass with ``options``' fields (``defaults`` replacing some defaults)."""
    hints = typing.get_type_hints(options)
    return make_dataclass(name, [
        (item.name, _schema_type(hints[item.name]), field(default=defaults.get(item.name, item.default),
                                                          metadata={**item.metadata, DECLARED_TYPE: hints[item.name]}))
        for item in fields(options) if item.default is not MISSING
    ], bases=bases)
