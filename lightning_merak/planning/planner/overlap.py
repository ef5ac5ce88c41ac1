"""Time of a chain of compute segments whose tensor-parallel collectives overlap with other sub-batches.

This models the overlapped tensor-parallel runtime (spec 1.6). A micro-batch is split into
``k`` sub-batches that share one compute resource and one communication channel:

* the sub-batches take turns round-robin; a sub-batch computes until it launches a collective,
  then hands the turn to the next unfinished sub-batch;
* on getting the turn back it first waits for its own collective: that wait blocks compute,
  so it is the exposed communication;
* collectives run one at a time, in launch order.

With ``k = 1`` nothing hides a collective, which is plain tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class OverlapResult:
    """Time of the whole chain for all sub-batches; ``exposed_comm_s`` is the compute resource's wait."""

    time_s: float
    exposed_comm_s: float
    comm_s_total: float

    @property
    def compute_s(self) -> float:
        return self.time_s - self.exposed_comm_s


def simulate_overlapped_chain(segments_per_subbatch: Sequence[float], comm_s: float, k: int) -> OverlapResult:
    """Discrete-event simulation of ``k`` sub-batches each running ``segments_per_subbatch`` in order.

    When ``comm_s > 0`` a collective of ``comm_s`` follows every segment but the last, and the
    sub-batch may start its next segment only once that collective is done.
    """
    if not segments_per_subbatch:
        raise ValueError("segments_per_subbatch needs at least one segment")
    if any(segment < 0 for segment in segments_per_subbatch):
        raise ValueError(f"segment times must be >= 0, got {list(segments_per_subbatch)}")
    if comm_s < 0:
        raise ValueError(f"comm_s must be >= 0, got {comm_s}")
    if k < 1:
        raise ValueError(f"k (sub-batches) must be >= 1, got {k}")

    last_segment = len(segments_per_subbatch) - 1
    next_segment = [0] * k
    collective_done_s: list[float | None] = [None] * k
    unfinished = list(range(k))
    turn = 0
    now_s = channel_free_s = exposed_s = 0.0
    while unfinished:
        subbatch = unfinished[turn]
        pending = collective_done_s[subbatch]
        if pending is not None:
            wait_s = max(0.0, pending - now_s)
            exposed_s += wait_s
            now_s += wait_s
            collective_done_s[subbatch] = None
        while True:
            segment = next_segment[subbatch]
            now_s += segments_per_subbatch[segment]
            next_segment[subbatch] = segment + 1
            if segment == last_segment:
                break
            if comm_s > 0:
                channel_free_s = max(now_s, channel_free_s) + comm_s
                collective_done_s[subbatch] = channel_free_s
                break
        if next_segment[subbatch] > last_segment:
            unfinished.pop(turn)
        else:
            turn += 1
        if unfinished:
            turn %= len(unfinished)

    comm_total_s = k * last_segment * comm_s
    return OverlapResult(time_s=now_s, exposed_comm_s=exposed_s, comm_s_total=comm_total_s)
