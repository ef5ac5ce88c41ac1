"""Parse a memory budget given as bytes, a fraction of device memory, or ``"auto"``.

Budgets arrive from Python (int/float) and from Hydra (always a string), so both go
through :func:`parse_budget`, which fails on bad input with a message naming the fix.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Union

__all__ = ["AUTO_FRACTION", "Budget", "BudgetLike", "parse_budget"]

BudgetLike = Union[int, float, str]

AUTO_FRACTION = 0.9
"""``"auto"`` keeps the process's peak under this fraction of device memory."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")
_HELP = (
    "give bytes as an int or a string with a unit ('512MiB', '2GiB', '1.5GB'), a fraction "
    "of device memory as a float in (0, 1] or a string ('0.5', '50%'), or 'auto'"
)


@dataclass(frozen=True)
class Budget:
    """Either an absolute number of bytes or a fraction of device memory (``auto`` is 0.9)."""

    nbytes: int | None = None
    fraction: float | None = None
    auto: bool = False

    def __str__(self) -> str:
        if self.auto:
            return f"auto ({AUTO_FRACTION:.0%} of device memory)"
        if self.fraction is not None:
            return f"{self.fraction:.0%} of device memory"
        return f"{self.nbytes / 2**20:.1f} MiB of saved activations"


def _fraction(value: float, text: object) -> Budget:
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ValueError(f"memory budget {text!r}: a fraction must lie in (0, 1]; {_HELP}")
    return Budget(fraction=value)


def parse_budget(value: BudgetLike | Budget) -> Budget:
    """Turn a user's budget into a :class:`Budget`.

    An int (or a string of digits, optionally with a unit) is bytes of saved activations;
    a float or a string with a decimal point or ``%`` is a fraction of device memory.
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool):
        raise TypeError(f"memory budget {value!r} is a bool; {_HELP}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"memory budget {value} bytes must be positive; {_HELP}")
        return Budget(nbytes=value)
    if isinstance(value, float):
        return _fraction(value, value)
    if not isinstance(value, str):
        raise TypeError(f"memory budget {value!r} has type {type(value).__name__}; {_HELP}")
    text = value.strip().lower()
    if text == "auto":
        return Budget(auto=True)
    if text.endswith("%"):
        try:
            return _fraction(float(text[:-1]) / 100.0, value)
        except ValueError as error:
            if "fraction" in str(error):
                raise
            raise ValueError(f"memory budget {value!r} is not a percentage; {_HELP}") from None
    match = _SIZE.match(text)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"memory budget {value!r} is not understood; {_HELP}")
    number, unit = match.groups()
    if unit == "" and "." in number and "e" not in number:
        return _fraction(float(number), value)
    nbytes = int(float(number) * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"memory budget {value!r} must be positive; {_HELP}")
    return Budget(nbytes=nbytes)
