"""Dataclass fields that carry their own description, so an option is declared once: name, type, default, text.

``x: int = option(1, "What x does. More detail.")`` is ``field(default=1, metadata={"help": ...})``: the
description lives in the field's metadata, where code can read it. The Hydra schemas derived from an options
dataclass copy it (:func:`lightning_merak.cli.options.schema.schema_of`), ``merak-train --help`` shows each key's
first sentence and ``docs/reference/cli.md`` the whole text (:mod:`lightning_merak.cli.reference`).

Metadata rather than attribute docstrings: a docstring under a field is lost at runtime and must be parsed back
out of the source, which a class made by ``dataclasses.make_dataclass`` (the Hydra schemas) does not have.
Descriptions use Markdown's single backticks for values and names; the first sentence stands alone.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

__all__ = ["HELP", "description", "option", "summary"]

HELP = "help"
"""The metadata key of a field's description."""

_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!etc)[.!?](?=\s|$)")


def option(default: Any = dataclasses.MISSING, help: str = "", *,
           default_factory: Callable[[], Any] | Any = dataclasses.MISSING) -> Any:
    """A dataclass field with ``default`` (or ``default_factory``) and its description ``help``."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={HELP: help})


def description(item: dataclasses.Field) -> str:
    """``item``'s description (empty when it has none)."""
    return str(item.metadata.get(HELP, ""))


def summary(text: str) -> str:
    """The first sentence of a description (``merak-train --help`` shows it next to the key)."""
    end = _SENTENCE_END.search(text)
    return text if end is None else text[:end.end()]
