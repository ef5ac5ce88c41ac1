"""What a callback declares to a parallel strategy, so the strategy needs neither its class nor its module.

A callback that cannot run under some layout says so with an attribute the strategy reads before the first
batch; the strategy refuses the run with the callback's own reason.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

__all__ = ["RefusesFullSharding", "full_sharding_refusal"]


@runtime_checkable
class RefusesFullSharding(Protocol):
    """A callback that cannot run with ``data_parallel_sharding="full"`` (FSDP2 owns the parameters' storage)."""

    fully_sharded_refusal: str
    """Why, in a clause: "it resizes storage that FSDP2's parameters own"."""


def full_sharding_refusal(callback: Any) -> Optional[str]:
    """``callback``'s reason it cannot run with fully sharded data parallelism, or ``None``."""
    return callback.fully_sharded_refusal if isinstance(callback, RefusesFullSharding) else None
