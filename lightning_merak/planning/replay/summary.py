"""A traced run in a few lines: step time measured and replayed, the critical path, exposed communication (pure)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from lightning_merak.planning.replay.engine import measured_step_time, replay_trace
from lightning_merak.planning.replay.trace import Trace

__all__ = ["measured_exposed_comm", "summarize", "summary_numbers"]


def measured_exposed_comm(trace: Trace) -> dict[int, float]:
    """Seconds per rank and step the main thread spent blocked on communication (union of its waits)."""
    steps = max(len(trace.steps()), 1)
    result = {}
    for rank in trace.ranks:
        intervals = sorted((c.wait_start, c.wait_end) for c in rank.comms
                           if c.wait_start is not None and c.wait_end is not None)
        total, reach = 0.0, float("-inf")
        for start, end in intervals:
            if end > reach:
                total += end - max(start, reach)
                reach = end
        result[rank.rank] = total / steps
    return result


def summary_numbers(trace: Trace) -> dict[str, Any]:
    """The summary's figures: measured and replayed step time, replay error, critical path, exposed comm, bytes."""
    measured = measured_step_time(trace)
    result = replay_trace(trace)
    bytes_per_op: dict[str, int] = defaultdict(int)
    for rank in trace.ranks:
        for record in rank.comms:
            bytes_per_op[record.op] += record.nbytes
    steps = max(len(trace.steps()), 1)
    return {"ranks": trace.world_size, "steps": len(trace.steps()), "measured_step_s": measured,
            "replayed_step_s": result.step_time, "replay_error": result.step_time / measured - 1.0,
            "critical_path_s": result.critical_breakdown(), "exposed_comm_s": measured_exposed_comm(trace),
            "replayed_exposed_comm_s": result.exposed_comm(),
            "bytes_per_step": {op: total // steps for op, total in bytes_per_op.items()}}


def summarize(trace: Trace) -> str:
    """The summary printed and logged after a traced run."""
    numbers = summary_numbers(trace)
    measured, replayed = 1e3 * numbers["measured_step_s"], 1e3 * numbers["replayed_step_s"]
    lines = [f"Merak trace: {numbers['ranks']} ranks, {numbers['steps']} steps; step {measured:.1f} ms measured, "
             f"{replayed:.1f} ms replayed ({100 * numbers['replay_error']:+.1f}%)"]
    path = ", ".join(f"{category} {1e3 * seconds:.1f} ms"
                     for category, seconds in sorted(numbers["critical_path_s"].items(), key=lambda kv: -kv[1]))
    lines.append(f"  critical path per step: {path}")
    for rank, seconds in sorted(numbers["exposed_comm_s"].items()):
        replayed = numbers["replayed_exposed_comm_s"].get(rank, 0.0)
        lines.append(f"  rank {rank}: exposed communication {1e3 * seconds:.1f} ms/step measured, "
                     f"{1e3 * replayed:.1f} ms replayed")
    sent = ", ".join(f"{op} {total / 1e6:.2f} MB" for op, total in sorted(numbers["bytes_per_step"].items()))
    lines.append(f"  bytes per step (all ranks): {sent or 'none'}")
    return "\n".join(lines)
