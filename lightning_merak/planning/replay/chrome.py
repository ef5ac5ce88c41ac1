"""Chrome/Perfetto trace of a recorded or replayed run: one process per rank, one track per thread or channel.

Open the file at https://ui.perfetto.dev or ``chrome://tracing`` (TensorBoard's trace viewer reads
it too). A rank's main thread shows its steps, forward, backward and optimizer work, blocks and
pipeline chunks nested, and the waits for communication; each communication channel (a process
group, or a point-to-point direction) shows every op in flight from launch to completion, with
its bytes; flow arrows join the same op on every rank that took part.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_merak.planning.replay.engine import ReplayResult
from lightning_merak.planning.replay.trace import Trace, comm_key

__all__ = ["chrome_trace", "replayed_chrome_trace", "write_chrome_trace"]


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _lane(record: Any) -> str:
    if record.kind == "collective":
        return f"comm group {list(record.group)}"
    return f"p2p {record.kind} {record.peer}"


def chrome_trace(trace: Trace) -> dict[str, Any]:
    """``trace`` (ranks' clocks aligned) as Chrome trace events, collectives linked across ranks by flows."""
    aligned = trace.aligned()
    events: list[dict[str, Any]] = []
    participants: dict[tuple, list[tuple[int, str, float]]] = {}
    for rank in aligned.ranks:
        pid = rank.rank
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {pid}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for span in sorted(rank.spans, key=lambda s: (s.start, s.depth)):
            events.append({"ph": "X", "name": span.name, "cat": span.category, "pid": pid, "tid": span.thread,
                           "ts": _us(span.start), "dur": _us(span.end - span.start), "args": {"step": span.step}})
        for record in rank.comms:
            lane = _lane(record)
            done = record.done if record.done is not None else record.launch
            args = {"bytes": record.nbytes, "group": list(record.group), "seq": record.seq, "step": record.step}
            if record.peer is not None:
                args["peer"] = record.peer
            events.append({"ph": "X", "name": record.op, "cat": "comm", "pid": pid, "tid": lane,
                           "ts": _us(record.launch), "dur": _us(max(done - record.launch, 0.0)), "args": args})
            if record.wait_start is not None and record.wait_end is not None:
                events.append({"ph": "X", "name": f"wait {record.op}", "cat": "wait", "pid": pid, "tid": "main",
                               "ts": _us(record.wait_start), "dur": _us(record.wait_end - record.wait_start),
                               "args": args})
            participants.setdefault(comm_key(rank.rank, record), []).append(
                (record.kind != "send", record.launch, pid, lane))
    for flow_id, members in enumerate(m for m in participants.values() if len(m) > 1):
        members.sort()  # a send's arrow points at its receive; a collective's runs from its first launch
        for index, (_, launch, pid, lane) in enumerate(members):
            phase = "s" if index == 0 else ("f" if index == len(members) - 1 else "t")
            event = {"ph": phase, "name": "collective", "cat": "flow", "id": flow_id, "pid": pid, "tid": lane,
                     "ts": _us(launch)}
            if phase == "f":
                event["bp"] = "e"
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(trace.meta)}


def replayed_chrome_trace(result: ReplayResult, label: str = "replayed") -> dict[str, Any]:
    """A replay's tasks as Chrome trace events: one process per rank, one track per device."""
    events: list[dict[str, Any]] = []
    critical = set(result.critical_path)
    for index, task in enumerate(result.graph.tasks):
        if result.end[index] <= result.start[index]:
            continue
        events.append({"ph": "X", "name": task.name, "cat": "critical" if index in critical else task.category,
                       "pid": f"{label} rank {task.rank}", "tid": task.device, "ts": _us(result.start[index]),
                       "dur": _us(result.end[index] - result.start[index])})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(events: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(events))
    return path
