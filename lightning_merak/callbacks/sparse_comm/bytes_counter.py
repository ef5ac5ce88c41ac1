"""Count bytes on the wire per rank, collective by collective, by category.

Each collective is recorded with its local payload; the wire bytes use the ring
formulas of :mod:`cost_model` (what one rank sends, equal to what it receives on a
full-duplex ring). Categories separate embedding-table traffic from the dense rest so
the savings of the sparse methods can be reported on their own.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from lightning_merak.callbacks.sparse_comm.wire_cost_model import all_gather_bytes, all_reduce_bytes, all_to_all_bytes

_WIRE_FORMULAS = {
    "all_reduce": all_reduce_bytes,
    "all_gather": all_gather_bytes,
    "all_to_all": all_to_all_bytes,
    "reduce_scatter": all_to_all_bytes,
}


@dataclass
class CommLedger:
    """Running totals of wire bytes and collective calls per category (``embedding``, ``dense``)."""

    world_size: int
    wire_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, operation: str, payload_bytes: float, category: str) -> float:
        """Add one collective: ``payload_bytes`` is the local tensor (for all-gather: this rank's part)."""
        if operation not in _WIRE_FORMULAS:
            raise ValueError(f"unknown collective {operation!r}; known: {sorted(_WIRE_FORMULAS)}")
        wire = _WIRE_FORMULAS[operation](payload_bytes, self.world_size)
        self.wire_bytes[category] += wire
        self.calls[category] += 1
        return wire

    def record_received(self, received_bytes: float, category: str) -> None:
        """Add a collective whose wire bytes are known directly (e.g. gloo's sparse all-reduce)."""
        self.wire_bytes[category] += received_bytes
        self.calls[category] += 1

    def snapshot(self) -> dict[str, float]:
        return dict(self.wire_bytes)

    def reset(self) -> None:
        self.wire_bytes.clear()
        self.calls.clear()
