"""Cell formatting and the table type shared by ``benchmarks.results_table``'s area functions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


class ResultsError(Exception):
    """A results file that cannot be used; the message starts with its path."""


@dataclass
class Table:
    headers: Sequence[str]
    rows: list[Sequence[object]]
    notes: list[str] = field(default_factory=list)


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def percent(value: float | None, signed: bool = False) -> str:
    return "-" if value is None else f"{100 * value:{'+' if signed else ''}.1f}%"


def brief(error: str, limit: int = 60) -> str:
    """The first sentence of an error message, cut to ``limit`` characters."""
    first = error.split(". ")[0]
    return first if len(first) <= limit else first[: limit - 1] + "…"
