"""Discrete-event simulation of pipeline schedules (AutoPipe step 2, spec 1.3).

Each stage runs a fixed order of forward (F), recompute (R) and backward (B) ops. An op
starts at the later of (its cross-stage dependency's end + p2p latency) and (the end of
the previous op on its stage). Backtracking whichever of the two bound each start gives
the critical path; the stage carrying most of its time is the one to relieve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SCHEDULES = ("1f1b", "gpipe")

_OpKey = tuple[int, int, str]
"""(stage, microbatch, kind) identifies an op."""


@dataclass(frozen=True)
class ScheduledOp:
    """One op placed on the timeline; ``kind`` is "F", "B" or "R" (recompute)."""

    stage: int
    microbatch: int
    kind: str
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class SimulationResult:
    """Timeline of one training iteration and where its time goes."""

    iteration_s: float
    ops: tuple[ScheduledOp, ...]
    critical_stage: int
    critical_path: tuple[ScheduledOp, ...]
    bubble_fraction: float


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")


def peak_inflight_microbatches(stage: int, num_stages: int, num_microbatches: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations a stage holds at once: min(S - s, M) under 1F1B, M under GPipe."""
    _check_schedule(schedule)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if schedule == "gpipe":
        return num_microbatches
    return min(num_stages - stage, num_microbatches)


def stage_op_order(stage: int, num_stages: int, num_microbatches: int, schedule: str) -> list[tuple[str, int]]:
    """The (kind, microbatch) compute order of one stage, without recompute ops."""
    forwards = [("F", microbatch) for microbatch in range(num_microbatches)]
    backwards = [("B", microbatch) for microbatch in range(num_microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = forwards[:warmup]
    for steady in range(num_microbatches - warmup):
        order += [forwards[warmup + steady], backwards[steady]]
    return order + backwards[num_microbatches - warmup :]


def _cross_stage_dependency(kind: str, stage: int, microbatch: int, num_stages: int) -> _OpKey | None:
    """The op on another stage this op waits for: the previous stage's F, or the next stage's B."""
    if kind == "F":
        return (stage - 1, microbatch, "F") if stage > 0 else None
    return (stage + 1, microbatch, "B") if stage < num_stages - 1 else None


def simulate_schedule(
    stage_forward_s: Sequence[float],
    stage_backward_s: Sequence[float],
    num_microbatches: int,
    schedule: str = "1f1b",
    p2p_s: float | Sequence[float] = 0.0,
    stage_recompute_s: Sequence[float] | None = None,
    recompute_ahead: bool = False,
) -> SimulationResult:
    """Simulate one iteration of ``schedule`` over stages with the given per-micro-batch op times.

    ``p2p_s`` is the time of one send between neighbouring stages: one figure for every boundary, or one per
    boundary (``p2p_s[s]`` between stages s and s + 1, both ways), where boundaries carry different tensors.

    ``stage_recompute_s[s]`` adds an R op before each backward of stage s. It waits for the
    incoming gradient like the backward does, unless ``recompute_ahead`` (spec 1.5 b), where it
    runs as soon as the stage is free and so overlaps the wait.
    """
    _check_schedule(schedule)
    num_stages = len(stage_forward_s)
    recompute_s = list(stage_recompute_s) if stage_recompute_s is not None else [0.0] * num_stages
    if num_stages < 1 or len(stage_backward_s) != num_stages or len(recompute_s) != num_stages:
        raise ValueError("stage_forward_s, stage_backward_s and stage_recompute_s need one entry per stage (>= 1)")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    links = [float(p2p_s)] * max(num_stages - 1, 0) if isinstance(p2p_s, (int, float)) else list(p2p_s)
    if len(links) != max(num_stages - 1, 0):
        raise ValueError(f"p2p_s needs one figure, or one per stage boundary ({num_stages - 1}), got {len(links)}")
    if any(cost < 0 for cost in [*links, *stage_forward_s, *stage_backward_s, *recompute_s]):
        raise ValueError("op times and p2p_s must be >= 0")

    orders = []
    for stage in range(num_stages):
        order = []
        for kind, microbatch in stage_op_order(stage, num_stages, num_microbatches, schedule):
            if kind == "B" and recompute_s[stage] > 0:
                order.append(("R", microbatch))
            order.append((kind, microbatch))
        orders.append(order)
    durations = {"F": stage_forward_s, "B": stage_backward_s, "R": recompute_s}

    placed: dict[_OpKey, ScheduledOp] = {}
    binding: dict[_OpKey, _OpKey | None] = {}
    next_position = [0] * num_stages
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for stage in range(num_stages):
            while next_position[stage] < len(orders[stage]):
                kind, microbatch = orders[stage][next_position[stage]]
                dependency_kind = "B" if kind == "R" else kind
                dependency = _cross_stage_dependency(dependency_kind, stage, microbatch, num_stages)
                if kind == "R" and recompute_ahead:
                    dependency = None
                if dependency is not None and dependency not in placed:
                    break
                previous = None
                if next_position[stage]:
                    previous_kind, previous_microbatch = orders[stage][next_position[stage] - 1]
                    previous = (stage, previous_microbatch, previous_kind)
                stage_free_s = placed[previous].end_s if previous else 0.0
                dependency_ready_s = (placed[dependency].end_s + links[min(stage, dependency[0])] if dependency
                                      else 0.0)
                start_s = max(stage_free_s, dependency_ready_s)
                key = (stage, microbatch, kind)
                placed[key] = ScheduledOp(stage, microbatch, kind, start_s, start_s + durations[kind][stage])
                binding[key] = dependency if dependency and dependency_ready_s > stage_free_s else previous
                next_position[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule!r} deadlocks; this is a bug in the op orders")

    ops = tuple(sorted(placed.values(), key=lambda op: (op.stage, op.start_s)))
    last = max(placed, key=lambda key: (placed[key].end_s, -key[0]))
    iteration_s = placed[last].end_s
    path_keys: list[_OpKey] = []
    cursor: _OpKey | None = last
    while cursor is not None:
        path_keys.append(cursor)
        cursor = binding[cursor]
    critical_path = tuple(placed[key] for key in reversed(path_keys))

    time_on_path = [0.0] * num_stages
    for op in critical_path:
        time_on_path[op.stage] += op.duration_s
    critical_stage = max(range(num_stages), key=lambda stage: (time_on_path[stage], -stage))
    busy_s = sum(op.duration_s for op in ops)
    bubble_fraction = 1.0 - busy_s / (num_stages * iteration_s) if iteration_s > 0 else 0.0
    return SimulationResult(iteration_s, ops, critical_stage, critical_path, bubble_fraction)
