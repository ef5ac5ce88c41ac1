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

    def __post_init__(self) -> None:
        """Refuse a budget built by hand that :func:`parse_budget` would refuse, before the planner divides by it."""
        given = [name for name, value in (("nbytes", self.nbytes), ("fraction", self.fraction)) if value is not None]
        if not isinstance(self.auto, bool):
            raise ValueError(f"Budget(auto={self.auto!r}) must be True or False")
        if len(given) + self.auto != 1:
            raise ValueError(f"{self!r} must set exactly one of nbytes, fraction or auto=True; {_HELP}")
        if self.nbytes is not None and (not isinstance(self.nbytes, int) or isinstance(self.nbytes, bool)
                                        or self.nbytes <= 0):
            raise ValueError(f"Budget(nbytes={self.nbytes!r}) must be a positive integer of bytes; {_HELP}")
        if self.fraction is not None and (not isinstance(self.fraction, (int, float)) or isinstance(self.fraction, bool)
                                          or not 0.0 < self.fraction <= 1.0):
            raise ValueError(f"Budget(fraction={self.fraction!r}) must lie in (0, 1]; {_HELP}")

    def __str__(self) -> str:
        if self.auto:
            return f"auto ({AUTO_FRACTION:.0%} of device memory)"
        if self.fraction is not None:
            return f"{self.fraction:.0%} of device memory"
        return f"{self.nbytes / 2**20:.1f} MiB of saved activations"


def _fraction(value: float, text: object) -> Budget:
    if not 0.0 < value <= 1.0:
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
    size = float(number) * _UNITS[unit]
    if not math.isfinite(size):
        raise ValueError(f"memory budget {value!r} is too large to be a number of bytes; {_HELP}")
    nbytes = int(size)
    if nbytes <= 0:
        raise ValueError(f"memory budget {value!r} must be positive; {_HELP}")
    return Budget(nbytes=nbytes)
