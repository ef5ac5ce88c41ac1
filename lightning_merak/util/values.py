"""Type checks of user-given numbers that Python's own types blur: a bool is an int, NaN is a float."""

from __future__ import annotations

import math

__all__ = ["is_count", "is_finite_number"]


def is_count(value: object) -> bool:
    """Whether ``value`` is an integer: a bool is one to Python, but ``True`` as a count is a slip, not a 1."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is a number (not a bool), neither infinite nor NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
