"""Replay a traced step: the global data-flow graph of every rank's work, and a discrete-event simulation of it (pure).

The dPRO idea, ported (spec ``beyond_card.md`` §3): each rank's main thread is a chain of
compute segments, launch points and waits, taken from its trace; every communication op is one
node on its channel (a process group's queue, or one direction of a point-to-point pair) that
starts once every participant has launched it and the channel is free. Replaying the graph
gives the step time, the critical path and the communication each rank waited for.

The op's duration in the graph is its *transfer* time only: the time from the last
participant's launch (and the channel freeing) to completion, so the wait for the slowest
peer is not counted twice (spec §5). :class:`WhatIf` changes the graph before the replay:
link bandwidth, compressed bytes, overlap off, compute ratios and recomputation.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_merak.planning.replay.trace import COMM_OPS, CommRecord, RankTrace, Span, Trace, comm_key, wire_bytes
from lightning_merak.util.values import is_finite_number

__all__ = ["COMPUTE_CATEGORIES", "CommOp", "ReplayResult", "Task", "TaskGraph", "WhatIf", "anchored", "build_graph",
           "comm_ops", "estimate_bandwidth", "estimate_fixed_cost", "graph_from_trace", "link_payload_bytes_per_s",
           "main_thread_waits", "measured_step_time", "replay", "replay_trace", "transfer_seconds"]

PRIORITY = {"FW": 0, "BW": 2, "UPDATE": 3, "comm": 100}
"""dPRO's ready-queue order among tasks ready at the same time."""
_CATEGORIES = ("FW", "BW", "UPDATE")
COMPUTE_CATEGORIES = ("FW", "BW", "UPDATE", "host")
"""The main threads' work :attr:`WhatIf.compute_ratio` scales: everything but communication."""


@dataclass
class Task:
    """A node of the graph: ``duration`` seconds on ``device`` once every task in ``deps`` has ended.

    ``wire`` is the bytes a communication task puts on each link (what-if scaling), ``exposed``
    marks a wait of a rank's main thread on communication.
    """

    name: str
    device: str
    duration: float
    rank: int
    category: str
    deps: list[int] = field(default_factory=list)
    wire: float = 0.0
    exposed: bool = False


class TaskGraph:
    """Tasks in insertion order; a task's dependencies must be added before it."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []

    def add(self, task: Task) -> int:
        if any(d >= len(self.tasks) for d in task.deps):
            raise ValueError(f"task {task.name!r} depends on a task not added yet")
        self.tasks.append(task)
        return len(self.tasks) - 1


@dataclass
class ReplayResult:
    """Start and end time per task, and the critical path (task indices, first to last)."""

    graph: TaskGraph
    start: list[float]
    end: list[float]
    critical_path: list[int]
    steps: int = 1

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0) - min(self.start, default=0.0)

    @property
    def step_time(self) -> float:
        return self.makespan / max(self.steps, 1)

    def exposed_comm(self) -> dict[int, float]:
        """Seconds per rank (per step) its main thread waited for communication."""
        result: dict[int, float] = defaultdict(float)
        for index, task in enumerate(self.graph.tasks):
            if task.exposed:
                waited = self.end[index] - max([self.end[d] for d in task.deps[:1]] or [self.start[index]])
                result[task.rank] += max(waited, 0.0) / max(self.steps, 1)
        return dict(result)

    def critical_breakdown(self) -> dict[str, float]:
        """Seconds per category on the critical path, per step."""
        result: dict[str, float] = defaultdict(float)
        for index in self.critical_path:
            task = self.graph.tasks[index]
            result[task.category] += (self.end[index] - self.start[index]) / max(self.steps, 1)
        return dict(result)


def replay(graph: TaskGraph, steps: int = 1) -> ReplayResult:
    """Simulate ``graph``: a task starts at max(its dependencies' ends, its device's last end).

    Ready tasks are taken by (ready time, dPRO priority); a device runs them in that order, one at
    a time. A task whose device is empty runs in parallel with everything.
    """
    tasks = graph.tasks
    indegree = [len(t.deps) for t in tasks]
    children: list[list[int]] = [[] for _ in tasks]
    for index, task in enumerate(tasks):
        for dep in task.deps:
            children[dep].append(index)
    start, end = [0.0] * len(tasks), [0.0] * len(tasks)
    bound_by: list[Optional[int]] = [None] * len(tasks)
    device_free: dict[str, tuple[float, Optional[int]]] = {}
    ready = [(0.0, PRIORITY.get(t.category, 1), i) for i, t in enumerate(tasks) if not t.deps]
    heapq.heapify(ready)
    done = 0
    while ready:
        ready_at, _, index = heapq.heappop(ready)
        task = tasks[index]
        free_at, previous = device_free.get(task.device, (0.0, None)) if task.device else (0.0, None)
        start[index] = max(ready_at, free_at)
        if task.deps:
            latest = max(task.deps, key=lambda d: end[d])
            bound_by[index] = previous if free_at > end[latest] else latest
        elif free_at > ready_at:
            bound_by[index] = previous
        end[index] = start[index] + task.duration
        if task.device:
            device_free[task.device] = (end[index], index)
        done += 1
        for child in children[index]:
            indegree[child] -= 1
            if indegree[child] == 0:
                at = max(end[d] for d in tasks[child].deps)
                heapq.heappush(ready, (at, PRIORITY.get(tasks[child].category, 1), child))
    if done != len(tasks):
        raise ValueError("the task graph has a cycle: a rank waits for an op that depends on its own later work")
    path: list[int] = []
    cursor: Optional[int] = max(range(len(tasks)), key=lambda i: end[i]) if tasks else None
    while cursor is not None:
        path.append(cursor)
        cursor = bound_by[cursor]
    return ReplayResult(graph, start, end, path[::-1], steps)


@dataclass(frozen=True)
class WhatIf:
    """Changes to a traced run, applied while its graph is built.

    ``bandwidth_ratio``: new link bandwidth / traced one. What scales is each transfer's measured time
    beyond the fixed cost of an op (the median transfer of ops under 4 KiB), which needs nothing but the
    trace. Where the traced link's payload rate is known, ``link_bytes_per_s``
    (:func:`link_payload_bytes_per_s`), a transfer's ``wire bytes / link_bytes_per_s`` scales instead, and what
    it took beyond that (fixed costs) or short of it stays: a rate shaper (a token bucket, as tc's tbf or a cloud
    NIC's limiter) lets a burst through at once after an idle spell, which saves the same time at any rate, so a
    trace's transfers can beat their bytes at the rate.
    ``comm_bytes_ratio``: bytes sent per op name / traced (compression). ``overlap=False``:
    every asynchronous collective is waited for right after its launch (receives posted early stay as
    they were: waiting at once would deadlock the pipeline). ``compute_ratio``: duration
    factor per category (FW, BW, UPDATE, host). ``recompute_fraction``: extra backward time as a
    fraction of each rank's forward time (1.0 turns full recomputation on, −1.0 off).
    """

    bandwidth_ratio: float = 1.0
    link_bytes_per_s: Optional[float] = None
    comm_bytes_ratio: tuple[tuple[str, float], ...] = ()
    overlap: bool = True
    compute_ratio: tuple[tuple[str, float], ...] = ()
    recompute_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not is_finite_number(self.bandwidth_ratio) or self.bandwidth_ratio <= 0:
            raise ValueError(f"bandwidth_ratio must be positive and finite, got {self.bandwidth_ratio!r}")
        if self.link_bytes_per_s is not None and (not is_finite_number(self.link_bytes_per_s)
                                                  or self.link_bytes_per_s <= 0):
            raise ValueError(f"link_bytes_per_s must be positive and finite (or None: scale the traced "
                             f"transfers), got {self.link_bytes_per_s!r}")
        _check_ratios("comm_bytes_ratio", self.comm_bytes_ratio, COMM_OPS)
        _check_ratios("compute_ratio", self.compute_ratio, COMPUTE_CATEGORIES)
        if not is_finite_number(self.recompute_fraction) or not -1.0 <= self.recompute_fraction <= 1.0:
            raise ValueError(f"recompute_fraction must lie in [-1, 1] (1 turns full recomputation on, -1 off), "
                             f"got {self.recompute_fraction!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be True or False, got {self.overlap!r}")


def _check_ratios(field_name: str, pairs: object, known: tuple[str, ...]) -> None:
    """Refuse a :class:`WhatIf` ratio table that is not (name, finite factor >= 0) pairs over ``known`` names."""
    if not isinstance(pairs, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
        raise ValueError(f"{field_name} must be a tuple of (name, factor) pairs, got {pairs!r}")
    for name, factor in pairs:
        if name not in known:
            raise ValueError(f"{field_name} names {name!r}, which is not one of {', '.join(known)}")
        if not is_finite_number(factor) or factor < 0:
            raise ValueError(f"{field_name} gives {name!r} the factor {factor!r}; use a finite number >= 0")


TCP_IP_HEADER_BYTES = 52
"""IPv4 (20) and TCP (20, and 12 of the timestamp option) header bytes in every packet."""


def link_payload_bytes_per_s(line_bits_per_s: float, mtu: int = 1500, frame_overhead: int = 14) -> float:
    """The bytes per second TCP carries over a link of ``line_bits_per_s``: each ``mtu``-byte IP packet holds
    ``mtu - 52`` bytes of payload (IPv4 and TCP headers with timestamps, Linux's default) and takes
    ``mtu + frame_overhead`` bytes of the rate (14, the Ethernet header, as a shaper such as tc's tbf counts frames;
    38 on a physical Ethernet wire, with preamble, gap and checksum)."""
    if line_bits_per_s <= 0:
        raise ValueError(f"line_bits_per_s must be positive, got {line_bits_per_s}")
    if mtu <= TCP_IP_HEADER_BYTES or frame_overhead < 0:
        raise ValueError(f"mtu must exceed the {TCP_IP_HEADER_BYTES} header bytes and frame_overhead be >= 0, "
                         f"got mtu={mtu}, frame_overhead={frame_overhead}")
    return line_bits_per_s / 8 * (mtu - TCP_IP_HEADER_BYTES) / (mtu + frame_overhead)


SMALL_OP_BYTES = 4096
"""Ops under this many wire bytes cost their fixed time only."""


def estimate_fixed_cost(ops: dict[tuple, "CommOp"]) -> float:
    """The fixed time of an op: the median transfer time of ops under :data:`SMALL_OP_BYTES` (0 without any)."""
    small = sorted(op.duration for op in ops.values() if op.wire < SMALL_OP_BYTES)
    return small[len(small) // 2] if small else 0.0


def estimate_bandwidth(trace: Trace, min_wire_bytes: float = 32768.0) -> Optional[float]:
    """Effective link bytes/s from the trace: wire bytes over transfer time beyond the fixed cost, over large ops."""
    ops = comm_ops(trace.aligned())
    fixed = estimate_fixed_cost(ops)
    large = [op for op in ops.values() if op.wire >= min_wire_bytes]
    seconds = transfer_seconds(large, fixed)
    return sum(op.wire for op in large) / seconds if large and seconds > 0 else None


def transfer_seconds(large: list[CommOp], fixed: float) -> float:
    """The large ops' time beyond the fixed cost; where none is slower than it (a link faster than the trace
    resolves), their whole time, which bounds the rate from below instead of leaving it unknown."""
    beyond = sum(max(op.duration - fixed, 0.0) for op in large)
    return beyond if beyond > 0 else sum(op.duration for op in large)


@dataclass
class CommOp:
    """One op on every rank that takes part (``participants``, rank -> its record where traced).

    ``duration`` is its transfer time, ``done`` when it completed (traced ops; :func:`_completion`), ``wire`` its
    bytes per link.
    """

    key: tuple
    op: str
    channel: str
    wire: float
    duration: float
    done: float
    participants: dict[int, Optional[CommRecord]]


def comm_ops(trace: Trace) -> dict[tuple, CommOp]:
    """Every op of an aligned trace once, with its transfer time (last launch, or channel free, to completion)."""
    grouped: dict[tuple, dict[int, CommRecord]] = defaultdict(dict)
    for rank in trace.ranks:
        for record in rank.comms:
            grouped[comm_key(rank.rank, record)][rank.rank] = record
    ops: dict[tuple, CommOp] = {}
    channel_done: dict[str, float] = {}
    for key, records in sorted(grouped.items(), key=lambda item: max(r.launch for r in item[1].values())):
        any_record = next(iter(records.values()))
        channel = (f"link{any_record.group}" if key[0] == "collective" else f"p2p{key[1]}->{key[2]}")
        ready = max(max(r.launch for r in records.values()), channel_done.get(channel, float("-inf")))
        receivers = [r for r in records.values() if r.kind != "send"] or list(records.values())
        done = _completion(receivers, ready)
        channel_done[channel] = max(done, ready)
        nbytes = max(r.nbytes for r in records.values())
        group_size = len(any_record.group) if key[0] == "collective" else 2
        ops[key] = CommOp(key, any_record.op, channel, wire_bytes(any_record.op, nbytes, group_size),
                           max(done - ready, 0.0), max(done, ready), records)
    return ops


def _completion(receivers: list[CommRecord], ready: float) -> float:
    """When an op that could start at ``ready`` completed, from its receiving side's records.

    A backend's completion time, or the end of a wait that began by ``ready``, tells it. A wait that began later (a
    receive posted early, gloo's point-to-point ops having no completion future) only says the op was done by its
    end: the receiver's own work before it is no transfer, so the transfer is bounded by the wait itself.
    """
    known = [r.done for r in receivers if r.done is not None
             and (r.complete is not None or r.wait_start is None or r.wait_start <= ready)]
    if known:
        return min(known)
    waited = [ready + r.wait_end - r.wait_start for r in receivers if r.wait_start is not None
              and r.wait_end is not None]
    return min(waited, default=ready)


def _innermost(spans: list[Span], time: float) -> str:
    """The FW/BW/UPDATE category of the deepest span around ``time`` ("host" outside them)."""
    best, depth = "host", -1
    for span in spans:
        if span.category in _CATEGORIES and span.start <= time < span.end and span.depth > depth:
            best, depth = span.category, span.depth
    return best


def main_thread_waits(rank_spans: list[Span], records: list[tuple[tuple, CommRecord]], overlap: bool) -> list[list]:
    """Merged [wait_start, wait_end, keys] intervals of one rank's main thread.

    With ``overlap=False`` an asynchronous op is waited for at its launch, and the wait it had
    becomes an interval without ops: time the thread no longer spends.

    DDP's buckets, whose reducer waits for them inside ``backward`` (not from Python), are waited for
    at the end of the innermost FW/BW/UPDATE span they were launched in, from their last launch. Other
    ops nobody waited for (sends whose works were dropped) hold up no one.
    """
    intervals: list[list] = []
    implicit: dict[int, list[tuple[tuple, CommRecord]]] = defaultdict(list)
    for key, record in records:
        if record.blocking:
            intervals.append([record.launch, record.wait_end if record.wait_end is not None else record.launch, [key]])
        elif not overlap and record.kind == "collective":
            intervals.append([record.launch, record.launch, [key]])
            if record.wait_start is not None and record.wait_end is not None:
                intervals.append([record.wait_start, record.wait_end, []])  # the wait it had: no longer there
        elif record.wait_start is not None and record.wait_end is not None:
            intervals.append([record.wait_start, record.wait_end, [key]])
        elif record.stream == "ddp":
            enclosing = [i for i, s in enumerate(rank_spans) if s.category in _CATEGORIES + ("step",)
                         and s.start <= record.launch < s.end]
            if enclosing:
                implicit[max(enclosing, key=lambda i: rank_spans[i].depth)].append((key, record))
    for span_index, members in implicit.items():
        last_launch = max(r.launch for _, r in members)
        intervals.append([last_launch, rank_spans[span_index].end, [k for k, _ in members]])
    intervals.sort(key=lambda w: w[0])
    merged: list[list] = []
    for interval in intervals:
        if merged and interval[0] < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], interval[1])
            merged[-1][2] += interval[2]
        else:
            merged.append(list(interval))
    return merged


def graph_from_trace(trace: Trace, what_if: WhatIf = WhatIf()) -> tuple[TaskGraph, int]:
    """The global data-flow graph of every recorded step of ``trace``, changed by ``what_if``; and the step count."""
    aligned = trace.aligned()
    steps = aligned.steps()
    if not steps:
        raise ValueError("the trace holds no step that every rank recorded; record at least one whole step")
    first, last = steps[0], steps[-1]
    plans = []
    for rank in aligned.ranks:
        begin = [s.start for s in rank.step_spans() if s.step == first][0]
        finish = [s.end for s in rank.step_spans() if s.step == last][0]
        spans = [s for s in rank.spans if first <= s.step <= last]
        comms = [c for c in rank.comms if begin <= c.launch <= finish]
        plans.append(_RankPlan(rank.rank, begin, finish, spans, comms))
    window = Trace([RankTrace(p.rank, p.spans, p.comms) for p in plans], [0.0] * len(plans))
    ops = comm_ops(window)
    fixed = estimate_fixed_cost(ops)
    origin = min(p.begin for p in plans)
    pieces = {p.rank: _chain_pieces(p, origin, what_if.overlap, ops) for p in plans}
    scale = {p.rank: _compute_scale(p, what_if) for p in plans}
    return build_graph(pieces, ops, scale, fixed, what_if), last - first + 1


@dataclass
class _RankPlan:
    rank: int
    begin: float
    finish: float
    spans: list[Span]
    comms: list[CommRecord]


def _compute_scale(plan: _RankPlan, what_if: WhatIf) -> dict[str, float]:
    """Duration factor per category on one rank: ``compute_ratio``, and recomputation's extra backward."""
    scale = {**{category: 1.0 for category in COMPUTE_CATEGORIES}, **dict(what_if.compute_ratio)}
    if what_if.recompute_fraction:
        # A pipeline's training step holds its backward chunks too: there the chunks tell forward from backward.
        chunks = [s for s in plan.spans if s.name.startswith("stage ")]
        totals = {}
        for category in ("FW", "BW"):
            depths = [s.depth for s in plan.spans if s.category == category]
            totals[category] = sum(s.end - s.start for s in chunks or plan.spans if s.category == category
                                   and (chunks or s.depth == min(depths, default=0)))
        if totals["BW"] > 0:
            scale["BW"] *= max(1.0 + what_if.recompute_fraction * totals["FW"] / totals["BW"], 0.0)
    return scale


def build_graph(pieces: dict[int, list[tuple[str, Any]]], ops: dict[tuple, CommOp],
                scale: dict[int, dict[str, float]], fixed_s: float, what_if: WhatIf) -> TaskGraph:
    """Every rank's chain (``pieces``: ("compute", (category, s)), ("launch", key), ("wait", (keys, blocking keys,
    tail))) and the ``ops`` between them, added in dependency order; ``scale`` is rank -> category -> factor.

    A rank's chain advances until it waits for an op not every participant has launched yet;
    the other ranks advance meanwhile, as the ranks themselves did.
    """
    graph = TaskGraph()
    cursors = {rank: 0 for rank in pieces}
    last: dict[int, int] = {}
    arrived: dict[tuple, dict[int, int]] = defaultdict(dict)
    comm_task: dict[tuple, int] = {}

    def arrive(key: tuple, rank: int) -> None:
        if key in ops and rank not in arrived[key]:
            arrived[key][rank] = last[rank]
            if len(arrived[key]) == len(ops[key].participants):
                comm_task[key] = _comm_task(graph, ops[key], list(arrived[key].values()), fixed_s, what_if)

    progress = True
    while progress:
        progress = False
        for rank, items in pieces.items():
            while cursors[rank] < len(items):
                kind, payload = items[cursors[rank]]
                deps = [last[rank]] if rank in last else []
                if kind == "compute":
                    category, seconds = payload
                    last[rank] = graph.add(Task(f"r{rank} {category}", f"r{rank}/main",
                                                seconds * scale[rank].get(category, 1.0), rank, category, deps))
                elif kind == "launch":
                    arrive(payload, rank)
                else:
                    keys, blocking, tail = payload
                    for key in blocking:
                        arrive(key, rank)
                    if any(k in ops and k not in comm_task for k in keys):
                        break
                    last[rank] = graph.add(Task(f"r{rank} wait", f"r{rank}/main", tail, rank, "wait",
                                                deps + [comm_task[k] for k in keys if k in ops], exposed=True))
                cursors[rank] += 1
                progress = True
    stuck = sorted(rank for rank, items in pieces.items() if cursors[rank] < len(items))
    if stuck:
        raise ValueError(f"ranks {stuck} wait for ops that not every participant launched; is the trace complete?")
    return graph


def _comm_task(graph: TaskGraph, op: CommOp, deps: list[int], fixed_s: float, what_if: WhatIf) -> int:
    """The op's transfer, its link-bound share scaled by the what-if bandwidth and compression (:class:`WhatIf`)."""
    ratio = dict(what_if.comm_bytes_ratio).get(op.op, 1.0)
    if what_if.link_bytes_per_s:
        on_wire = op.wire / what_if.link_bytes_per_s
    else:
        on_wire = max(op.duration - fixed_s, 0.0) if op.wire >= SMALL_OP_BYTES else 0.0
    duration = op.duration - on_wire + on_wire * ratio / what_if.bandwidth_ratio
    return graph.add(Task(op.op, op.channel, max(duration, 0.0), min(op.participants), "comm", sorted(set(deps)),
                          wire=op.wire * ratio))


def _chain_pieces(plan: _RankPlan, origin: float, overlap: bool, ops: dict[tuple, CommOp]) -> list[tuple[str, Any]]:
    """A rank's main thread as ("compute", (category, s)), ("launch", key), ("wait", (keys, blocking keys, tail)).

    A wait's tail is the time it went on after its ops completed (waking up, the backend's own
    work after the transfer): replayed as it was measured.
    """
    records = [(comm_key(plan.rank, c), c) for c in plan.comms]
    waits = main_thread_waits(plan.spans, records, overlap)
    blocking = {key for key, record in records if record.blocking}
    sends = {key for key, record in records if record.kind == "send"}
    launches = sorted((r.launch, key) for key, r in records if not r.blocking)
    items: list[tuple[str, Any]] = [("compute", ("host", plan.begin - origin))]
    cursor = plan.begin
    points = [(t, 0, key) for t, key in launches] + [(w[0], 1, w) for w in waits]
    points.sort(key=lambda p: (p[0], p[1]))
    for time, is_wait, payload in points:
        time = max(time, cursor)
        items.extend(_compute_pieces(plan.spans, cursor, time))
        if is_wait:
            # A send's work completes once the data left, not when the receiver has it: waiting for a send
            # is replayed as the time it took, waiting for anything else as its op's transfer plus the tail.
            keys = [k for k in payload[2] if k not in sends]
            done = max((ops[k].done for k in keys if k in ops), default=payload[0])
            tail = max(payload[1] - max(payload[0], done), 0.0) if payload[2] else 0.0
            items.append(("wait", (keys, [k for k in keys if k in blocking], tail)))
            cursor = max(payload[1], time)
        else:
            items.append(("launch", payload))
            cursor = time
    items.extend(_compute_pieces(plan.spans, cursor, max(plan.finish, cursor)))
    return items


def _compute_pieces(spans: list[Span], begin: float, end: float) -> list[tuple[str, object]]:
    """Compute from ``begin`` to ``end`` cut where the FW/BW/UPDATE category changes."""
    if end <= begin:
        return []
    cuts = sorted({begin, end} | {t for s in spans if s.category in _CATEGORIES for t in (s.start, s.end)
                                  if begin < t < end})
    pieces: list[tuple[str, object]] = []
    for a, b in zip(cuts, cuts[1:]):
        category = _innermost(spans, (a + b) / 2.0)
        if pieces and pieces[-1][1][0] == category:
            pieces[-1] = ("compute", (category, pieces[-1][1][1] + b - a))
        else:
            pieces.append(("compute", (category, b - a)))
    return pieces


def replay_trace(trace: Trace, what_if: WhatIf = WhatIf()) -> ReplayResult:
    """Build ``trace``'s graph under ``what_if`` and replay it; ``step_time`` is per recorded step."""
    graph, steps = graph_from_trace(trace, what_if)
    return replay(graph, steps)


def anchored(trace: Trace, step_s: Optional[float], what_if: WhatIf = WhatIf(),
             tolerance: float = 1e-4) -> WhatIf:
    """``what_if`` with its compute (:data:`COMPUTE_CATEGORIES`) also scaled by the factor under which the
    unmodified replay of ``trace`` takes ``step_s`` per step (e.g. the run's untraced steps,
    :func:`~lightning_merak.planning.replay.calibration.untraced_step_time`).

    The few traced steps run slower or faster than the run's steady ones (the profiler's cost, a shared machine's
    spells), and that difference is time on the CPU: multiplying the whole predicted step by the ratio instead also
    stretches the communication, most of the step in a what-if on a slower link. ``step_s=None`` (what
    ``untraced_step_time`` gives for a trace with too few untraced steps) is refused with what to anchor on instead.
    """
    if step_s is None:
        raise ValueError("step_s is None: untraced_step_time(trace) gives None where the trace holds too few untraced "
                         "steps; record more (MerakTraceProfiler(untraced_steps=8)) or anchor on "
                         "measured_step_time(trace)")
    if not is_finite_number(step_s) or step_s <= 0:
        raise ValueError(f"step_s must be positive and finite (seconds), got {step_s!r}")
    if not is_finite_number(tolerance) or not 0 < tolerance < 1:
        raise ValueError(f"tolerance must lie in (0, 1), got {tolerance!r}")

    def replayed(factor: float) -> float:
        return replay_trace(trace, WhatIf(compute_ratio=tuple((c, factor) for c in COMPUTE_CATEGORIES))).step_time

    communication_only = replayed(0.0)
    if step_s < communication_only * (1.0 - tolerance):
        raise ValueError(f"the trace's communication alone replays to {1e3 * communication_only:.2f} ms per step, "
                         f"more than step_s={1e3 * step_s:.2f} ms: no compute scale reaches it; anchor on a step "
                         "time of the traced run itself")
    low, high = 0.0, 1.0
    error = replayed(high) - step_s
    while error < 0:
        low, high = high, 2.0 * high
        if high > 1e6:
            raise ValueError(f"the replay does not reach step_s={step_s} s at any compute scale; is the trace empty?")
        error = replayed(high) - step_s
    factor = high
    for _ in range(100):
        if abs(error) <= tolerance * step_s:
            break
        low, high = (factor, high) if error < 0 else (low, factor)
        factor = 0.5 * (low + high)
        error = replayed(factor) - step_s
    ratios = dict(what_if.compute_ratio)
    scaled = {c: factor * ratios.pop(c, 1.0) for c in COMPUTE_CATEGORIES}
    return dataclasses.replace(what_if, compute_ratio=tuple({**ratios, **scaled}.items()))


def measured_step_time(trace: Trace) -> float:
    """First recorded step's earliest start to last recorded step's latest end, per step (aligned clocks)."""
    aligned = trace.aligned()
    steps = aligned.steps()
    starts = [s.start for r in aligned.ranks for s in r.step_spans() if s.step == steps[0]]
    ends = [s.end for r in aligned.ranks for s in r.step_spans() if s.step == steps[-1]]
    return (max(ends) - min(starts)) / len(steps)
