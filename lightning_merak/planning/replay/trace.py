"""What the profiler records on each rank, and the whole run's trace with ranks' clocks aligned (pure).

Every rank records, on its own ``time.perf_counter`` clock, the spans of its main thread
(a step, its forward, backward and optimizer work, blocks and pipeline stages nested inside)
and one :class:`CommRecord` per collective or point-to-point op. A :class:`Trace` holds every
rank's record plus each rank's clock offset to rank 0 (estimated by round trips,
:func:`offset_from_round_trips`); :meth:`Trace.aligned` puts every time on rank 0's clock.

Collectives are matched across ranks by (group, per-group sequence number), point-to-point
ops by (sender, receiver, tag, per-pair sequence number): :func:`comm_key`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["COLLECTIVE_OPS", "COMM_OPS", "CommRecord", "P2P_OPS", "RankTrace", "Span", "Trace", "assign_depths",
           "comm_key", "offset_from_round_trips", "wire_bytes"]

COLLECTIVE_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                  "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "barrier")
"""The collectives the profiler records, by their ``torch.distributed`` names."""
P2P_OPS = ("isend", "irecv", "send", "recv")
"""The point-to-point ops the profiler records."""
COMM_OPS = COLLECTIVE_OPS + P2P_OPS + ("ddp_all_reduce",)
"""Every op name a :class:`CommRecord` may carry (DDP's bucket all-reduces are ``ddp_all_reduce``)."""


@dataclass
class Span:
    """A range of a rank's work: ``category`` is step, FW, BW or UPDATE (blocks and stages are FW or BW), or WAIT.

    ``thread`` is ``"main"``, or ``"sub-batch <i>"`` for a block that sub-batch ``i`` of a ``tp_overlap`` region ran
    on its own thread, and for that thread's waits for its turn (WAIT spans named ``turn``): the sub-batches take
    turns, so their blocks' spans overlap each other, and a block's own work is its span less its thread's waits.
    """

    name: str
    category: str
    start: float
    end: float
    step: int
    depth: int = 0
    thread: str = "main"

    def is_block(self, category: str = "FW") -> bool:
        """Whether this is a model block's forward (``FW``) or backward (``BW``) span, named ``block <index>``."""
        return self.category == category and self.name.startswith("block ")


@dataclass
class CommRecord:
    """One collective (``kind="collective"``) or one side of a point-to-point op (``"send"``/``"recv"``).

    ``launch`` is when the op was issued, ``complete`` when the backend reported it done (its
    future), ``wait_start``/``wait_end`` when the main thread blocked on it (equal to the call for
    a blocking op). Any of the last three may be missing where the backend or caller gives none.
    """

    op: str
    kind: str
    group: tuple[int, ...]
    seq: int
    nbytes: int
    launch: float
    step: int
    complete: Optional[float] = None
    wait_start: Optional[float] = None
    wait_end: Optional[float] = None
    peer: Optional[int] = None
    tag: int = 0
    blocking: bool = False
    stream: str = "main"

    @property
    def done(self) -> Optional[float]:
        """The earliest time the op is known to have completed."""
        times = [t for t in (self.complete, self.wait_end) if t is not None]
        return min(times) if times else None


def comm_key(rank: int, record: CommRecord) -> tuple:
    """The key under which the same op is found on every rank that takes part in it."""
    if record.kind == "collective":
        return ("collective", record.group, record.seq)
    src, dst = (rank, record.peer) if record.kind == "send" else (record.peer, rank)
    return ("p2p", src, dst, record.tag, record.seq)


def wire_bytes(op: str, nbytes: int, group_size: int) -> float:
    """Bytes each rank sends over its link for ``op`` on ``nbytes`` of its own data (ring algorithms).

    all-reduce sends 2(n−1)/n of the buffer, gathers, scatters and all-to-all (n−1)/n of the
    gathered or scattered buffer, point-to-point ops and broadcasts the buffer once.
    """
    n = max(group_size, 1)
    if n == 1 and op not in ("send", "recv"):
        return 0.0
    if op in ("all_reduce", "ddp_all_reduce"):
        return 2.0 * (n - 1) / n * nbytes
    if op in ("all_gather", "all_gather_into_tensor", "all_gather_single"):
        return (n - 1) * float(nbytes)
    if op in ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single"):
        return (n - 1) / n * nbytes
    return float(nbytes)


@dataclass
class RankTrace:
    """One rank's record: its spans and communication ops, on its own clock."""

    rank: int
    spans: list[Span] = field(default_factory=list)
    comms: list[CommRecord] = field(default_factory=list)

    def shifted(self, offset: float) -> "RankTrace":
        """The same record with ``offset`` added to every time."""
        def move(value: Optional[float]) -> Optional[float]:
            return None if value is None else value + offset
        spans = [replace(s, start=s.start + offset, end=s.end + offset) for s in self.spans]
        comms = [replace(c, launch=c.launch + offset, complete=move(c.complete), wait_start=move(c.wait_start),
                         wait_end=move(c.wait_end)) for c in self.comms]
        return RankTrace(self.rank, spans, comms)

    def step_spans(self) -> list[Span]:
        return sorted((s for s in self.spans if s.category == "step"), key=lambda s: s.start)

    def block_names(self) -> set[str]:
        """The model blocks whose forward this rank recorded (``block <index>``)."""
        return {s.name for s in self.spans if s.is_block()}


@dataclass
class Trace:
    """Every rank's record of the same steps; ``offsets[r]`` is added to rank r's times to get rank 0's clock."""

    ranks: list[RankTrace]
    offsets: list[float]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def aligned(self) -> "Trace":
        """Every time on rank 0's clock, with the earliest event at 0."""
        shifted = [rank.shifted(offset) for rank, offset in zip(self.ranks, self.offsets)]
        times = [s.start for r in shifted for s in r.spans] + [c.launch for r in shifted for c in r.comms]
        origin = min(times) if times else 0.0
        return Trace([r.shifted(-origin) for r in shifted], [0.0] * len(shifted), dict(self.meta))

    def block_names(self) -> set[str]:
        """The model blocks whose forward any rank recorded."""
        return set().union(*(rank.block_names() for rank in self.ranks))

    def steps(self) -> list[int]:
        """The step numbers every rank recorded."""
        per_rank = [{s.step for s in r.step_spans()} for r in self.ranks]
        return sorted(set.intersection(*per_rank)) if per_rank else []

    def step_times(self) -> dict[int, float]:
        """Measured step time (first start to last end over ranks, on aligned clocks) per step."""
        aligned = self.aligned()
        result = {}
        for step in self.steps():
            spans = [s for r in aligned.ranks for s in r.step_spans() if s.step == step]
            result[step] = max(s.end for s in spans) - min(s.start for s in spans)
        return result

    def to_dict(self) -> dict[str, Any]:
        return {"offsets": self.offsets, "meta": self.meta, "ranks": [
            {"rank": r.rank, "spans": [asdict(s) for s in r.spans], "comms": [asdict(c) for c in r.comms]}
            for r in self.ranks]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trace":
        ranks = []
        for item in data["ranks"]:
            comms = [CommRecord(**{**c, "group": tuple(c["group"])}) for c in item["comms"]]
            ranks.append(RankTrace(item["rank"], [Span(**s) for s in item["spans"]], comms))
        return cls(ranks, list(data["offsets"]), dict(data.get("meta", {})))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_dict(json.loads(Path(path).read_text()))


def assign_depths(spans: list[Span]) -> None:
    """Set each span's depth to the number of spans around it (spans that end first nest inside)."""
    stack: list[Span] = []
    for span in sorted(spans, key=lambda s: (s.start, -s.end)):
        while stack and stack[-1].end <= span.start:
            stack.pop()
        span.depth = len(stack)
        stack.append(span)


def offset_from_round_trips(samples: Sequence[tuple[float, float, float, float]]) -> float:
    """The offset to add to a peer's clock to read rank 0's, from NTP-style round trips.

    Each sample is (t0 sent by rank 0, t1 received by the peer, t2 replied by the peer, t3
    received by rank 0); the sample with the shortest round trip bounds the error best.
    """
    if not samples:
        raise ValueError("offset_from_round_trips needs at least one round trip")
    t0, t1, t2, t3 = min(samples, key=lambda s: (s[3] - s[0]) - (s[2] - s[1]))
    return ((t0 - t1) + (t3 - t2)) / 2.0
