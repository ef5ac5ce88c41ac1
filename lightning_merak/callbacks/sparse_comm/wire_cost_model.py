"""Bytes-on-the-wire formulas per method and the ``auto`` selector (plain Python).

All figures are per rank and per step for one table, for ring algorithms on a
full-duplex link: an all-reduce moves ``2 (N-1)/N`` of its payload through each
rank, an all-gather ``(N-1)`` times each rank's part, an all-to-all ``(N-1)/N`` of
the payload. Time is the alpha-beta model ``messages * latency + bytes / bandwidth``.

Methods a table can take inside the DDP comm hook:

* ``dense``: all-reduce of the whole ``[V, H]`` gradient (what DDP does);
* ``s2_exact``: all-gather of packed row bitmaps, then all-reduce of the union's rows
  (a count sketch with the perfect hash "position in the union", so no collisions);
* ``s2_sketch``: bitmaps, then all-reduce of an ``r x ceil(alpha U)`` count sketch;
* ``allgather``: bitmaps, then all-gather of each rank's non-zero rows (padded to the
  largest count; the bitmaps already say which rows they are, so no indices travel).

``embrace`` (column-sharded table, all-to-all of lookups) is costed for the log; it
needs a module swap before DDP wraps the model, so ``auto`` cannot switch to it.

A sketch of ``r x ceil(alpha U)`` rows is smaller than the union's ``U`` rows only when
``r * alpha < 1`` (:func:`sketch_pays`), whatever the table size and rank count; the
defaults ``r=3, alpha=2`` would send 6x the exact payload, so the reducer then sends exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

HOOK_METHODS = ("dense", "s2_exact", "s2_sketch", "allgather")
ID_BYTES = 8


@dataclass(frozen=True)
class NetworkModel:
    """Per-rank link bandwidth and per-message latency of the data-parallel group."""

    bandwidth_bytes_per_s: float
    latency_s: float = 50e-6

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise ValueError(f"bandwidth must be finite and positive, got {self.bandwidth_bytes_per_s} bytes/s")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency must be finite and >= 0, got {self.latency_s} s")

    @classmethod
    def from_gbit(cls, gbit_per_s: float, latency_us: float = 50.0) -> NetworkModel:
        return cls(gbit_per_s * 1e9 / 8, latency_us * 1e-6)

    def seconds(self, wire_bytes: float, messages: int) -> float:
        return messages * self.latency_s + wire_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class TableTraffic:
    """What one step of one table looks like, as measured from the ranks' row bitmaps."""

    name: str
    num_rows: int
    dim: int
    element_bytes: int
    local_rows: tuple[int, ...]
    union_rows: int
    tokens_per_rank: int | None = None

    @property
    def world_size(self) -> int:
        return len(self.local_rows)

    @property
    def density(self) -> float:
        return self.union_rows / self.num_rows if self.num_rows else 0.0


@dataclass(frozen=True)
class MethodCost:
    method: str
    wire_bytes: float
    messages: int
    seconds: float


@dataclass(frozen=True)
class Decision:
    """The chosen method for one table and step, with every candidate's cost and the reason."""

    table: str
    method: str
    costs: dict[str, MethodCost] = field(default_factory=dict)
    reason: str = ""


def all_reduce_bytes(payload_bytes: float, world_size: int) -> float:
    return 2 * (world_size - 1) / world_size * payload_bytes


def all_gather_bytes(part_bytes: float, world_size: int) -> float:
    return (world_size - 1) * part_bytes


def all_to_all_bytes(payload_bytes: float, world_size: int) -> float:
    return (world_size - 1) / world_size * payload_bytes


def bitmap_bytes(num_rows: int) -> int:
    return math.ceil(num_rows / 8)


def sketch_columns(union_rows: int, column_factor: float) -> int:
    """Sketch width ``c = ceil(alpha * U)``, at least 1; identical on ranks that agree on U."""
    if not (math.isfinite(column_factor) and column_factor > 0):
        raise ValueError(f"column_factor must be finite and positive, got {column_factor}")
    return max(1, math.ceil(column_factor * union_rows))


def sketch_pays(union_rows: int, sketch_rows: int, column_factor: float) -> bool:
    """Whether a count sketch moves fewer bytes than the union's rows it stands for (``r * c < U``)."""
    return sketch_rows * sketch_columns(union_rows, column_factor) < union_rows


def scan_pays(zero_fraction: float, world_size: int, network: NetworkModel, scan_bytes_per_s: float) -> bool:
    """Whether scanning looked-up rows for all-zero ones costs less time than sending the zero ones.

    Scanning reads every row once; each zero row found saves its share of the union's
    all-reduce. Per row: ``1 / scan_bytes_per_s`` against ``zero_fraction * 2 (N-1)/N / bandwidth``.
    Only this rank's zero rows are counted, a lower bound on how much the union shrinks when
    every rank drops its own (measured, 2 ranks: 895 zero rows each shrank it by 1636 rows).
    At 10 Gbit/s and a one-thread CPU scan of 6-16 GB/s, scanning pays from 8-21% zero rows.
    """
    if scan_bytes_per_s <= 0:
        raise ValueError(f"scan speed must be positive, got {scan_bytes_per_s}")
    send_seconds_per_byte = all_reduce_bytes(1.0, world_size) / network.bandwidth_bytes_per_s
    return zero_fraction * send_seconds_per_byte >= 1.0 / scan_bytes_per_s


def method_costs(
    traffic: TableTraffic, network: NetworkModel, sketch_rows: int, column_factor: float
) -> dict[str, MethodCost]:
    """Cost of every method for ``traffic``, plus ``embrace`` when the token count is known."""
    n = traffic.world_size
    row_bytes = traffic.dim * traffic.element_bytes
    bitmap = all_gather_bytes(bitmap_bytes(traffic.num_rows), n)
    ring_steps = 2 * (n - 1)
    columns = sketch_columns(traffic.union_rows, column_factor)
    wire = {
        "dense": (all_reduce_bytes(traffic.num_rows * row_bytes, n), ring_steps),
        "s2_exact": (bitmap + all_reduce_bytes(traffic.union_rows * row_bytes, n), (n - 1) + ring_steps),
        "s2_sketch": (
            bitmap + all_reduce_bytes(sketch_rows * columns * row_bytes, n), (n - 1) + ring_steps
        ),
        "allgather": (bitmap + all_gather_bytes(max(traffic.local_rows) * row_bytes, n), 2 * (n - 1)),
    }
    if traffic.tokens_per_rank is not None:
        tokens = traffic.tokens_per_rank
        ids = all_gather_bytes(tokens * ID_BYTES, n)
        lookups = 2 * all_to_all_bytes(tokens * row_bytes, n)
        wire["embrace"] = (ids + lookups, 4 * (n - 1))
    return {
        method: MethodCost(method, wire_bytes, messages, network.seconds(wire_bytes, messages))
        for method, (wire_bytes, messages) in wire.items()
    }


def choose_method(
    traffic: TableTraffic,
    network: NetworkModel,
    sketch_rows: int,
    column_factor: float,
    candidates: tuple[str, ...] = ("dense", "s2_exact", "allgather"),
) -> Decision:
    """Fastest by modelled time of the ``candidates`` that send no more bytes than ``s2_exact``.

    Bytes are those the step sends as :class:`~.bytes_counter.CommLedger` counts them: the row
    bitmaps are exchanged before the choice, so ``dense`` pays them too. A method that wins on
    latency alone (fewer messages, more bytes) is passed over; when no candidate is that small,
    ``s2_exact`` is taken. ``s2_sketch`` is lossy, so it is a candidate only when the caller asks
    for it. Ties go to the earlier candidate. The reason lists every cost.
    """
    unknown = [method for method in candidates if method not in HOOK_METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {HOOK_METHODS}")
    costs = method_costs(traffic, network, sketch_rows, column_factor)
    limit = costs["s2_exact"].wire_bytes
    affordable = [method for method in candidates if step_bytes(method, costs, traffic) <= limit] or ["s2_exact"]
    best = min(affordable, key=lambda method: (costs[method].seconds, candidates.index(method)))
    listed = ", ".join(
        f"{method} {cost.wire_bytes / 1e6:.3g} MB/{cost.seconds * 1e3:.3g} ms" for method, cost in costs.items()
    )
    reason = (
        f"{traffic.name}: rows per rank {list(traffic.local_rows)}, union {traffic.union_rows} of "
        f"{traffic.num_rows} ({traffic.density:.1%}); modelled at "
        f"{network.bandwidth_bytes_per_s * 8 / 1e9:.3g} Gbit/s: {listed} -> {best}"
    )
    faster = [m for m in candidates if m not in affordable and costs[m].seconds < costs[best].seconds]
    if faster:
        reason += f" ({', '.join(faster)} faster by latency but sends more bytes than s2_exact)"
    if "embrace" in costs and costs["embrace"].seconds < costs[best].seconds:
        reason += " (embrace would be cheaper still; it needs method='embrace', chosen before DDP wraps)"
    return Decision(traffic.name, best, costs, reason)


def step_bytes(method: str, costs: dict[str, MethodCost], traffic: TableTraffic) -> float:
    """Wire bytes of ``method`` in a step whose row bitmaps were already exchanged to decide."""
    bitmap = all_gather_bytes(bitmap_bytes(traffic.num_rows), traffic.world_size)
    return costs[method].wire_bytes + (bitmap if method == "dense" else 0.0)
