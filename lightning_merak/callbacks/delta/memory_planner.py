"""Block-level memory plan: which blocks keep, swap or recompute their saved activations.

Pure Python on purpose: the planner takes measured profiles (seconds and bytes) and
returns decisions, so it is unit-tested on synthetic profiles without torch or Lightning.

* **Filter** (DELTA): release blocks in order of ``saved_bytes x staleness`` until the
  simulated peak of resident saved bytes fits the budget.
* **Director**: for each released block, recompute when its forward is cheaper than the
  swap time that cannot be hidden behind neighbouring compute (``director="exposed"``),
  or DELTA's published rule ``2 x swap > forward -> recompute`` (``director="delta"``).

The simulated step follows the forward/backward events the profile recorded, so a
pipeline stage with several micro-batches in flight (1F1B, GPipe, interleaved) is planned
for the activations it really holds at once, not for one micro-batch.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from lightning_merak.callbacks.delta.options import DeltaOptions

__all__ = [
    "Action",
    "BlockDecision",
    "BlockProfile",
    "Plan",
    "PlannerSettings",
    "StepProfile",
    "calibrate_outside",
    "plan_memory",
    "simulate_timeline",
]

FORWARD, BACKWARD = "F", "B"
Event = tuple[str, int]
"""``(FORWARD | BACKWARD, block index)``: one block's forward or backward of one micro-batch."""


class Action(str, enum.Enum):
    """What happens to a block's saved activations between its forward and its backward."""

    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class BlockProfile:
    """What one block costs, measured over warm-up steps (seconds and bytes)."""

    name: str
    forward_s: float
    backward_s: float
    saved_bytes: int
    boundary_bytes: int
    stale_s: float

    def __post_init__(self) -> None:
        if self.saved_bytes < 0 or self.boundary_bytes < 0:
            raise ValueError(f"block {self.name}: byte counts must be non-negative")
        if self.boundary_bytes > self.saved_bytes:
            object.__setattr__(self, "boundary_bytes", self.saved_bytes)


@dataclass(frozen=True)
class StepProfile:
    """Per-micro-batch profiles of the managed blocks in forward order, plus saved bytes outside them.

    ``events`` is the order in which block forwards and backwards ran during one step;
    empty means a single forward through all blocks followed by the backward in reverse.
    """

    blocks: tuple[BlockProfile, ...]
    outside_bytes: int = 0
    events: tuple[Event, ...] = ()

    def __post_init__(self) -> None:
        for kind, index in self.events:
            if kind not in (FORWARD, BACKWARD) or not 0 <= index < len(self.blocks):
                raise ValueError(f"event {(kind, index)!r} names no forward/backward of the {len(self.blocks)} blocks")

    def scaled(self, factor: float) -> StepProfile:
        """Linear extrapolation to another input size (an assumption: attention is superlinear)."""
        if factor <= 0:
            raise ValueError(f"scale factor must be positive, got {factor}")
        return StepProfile(
            blocks=tuple(
                replace(
                    b,
                    forward_s=b.forward_s * factor,
                    backward_s=b.backward_s * factor,
                    saved_bytes=round(b.saved_bytes * factor),
                    boundary_bytes=round(b.boundary_bytes * factor),
                    stale_s=b.stale_s * factor,
                )
                for b in self.blocks
            ),
            outside_bytes=round(self.outside_bytes * factor),
            events=self.events,
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.blocks)

    def step_events(self) -> tuple[Event, ...]:
        """The recorded events, or the single-pass default."""
        if self.events:
            return self.events
        forward = tuple((FORWARD, i) for i in range(len(self.blocks)))
        return forward + tuple((BACKWARD, i) for i in reversed(range(len(self.blocks))))

    @staticmethod
    def median(steps: Sequence[StepProfile]) -> StepProfile:
        """Per-block median over warm-up steps, robust to one noisy step; events of the last step."""
        if not steps:
            raise ValueError("no profiled steps to summarise")
        names = steps[0].names
        if any(s.names != names for s in steps):
            raise ValueError("profiled steps saw different blocks; cannot summarise them together")

        def med(values: Sequence[float]) -> float:
            return float(statistics.median(values))

        blocks = []
        for i, name in enumerate(names):
            column = [s.blocks[i] for s in steps]
            blocks.append(
                BlockProfile(
                    name=name,
                    forward_s=med([b.forward_s for b in column]),
                    backward_s=med([b.backward_s for b in column]),
                    saved_bytes=round(med([b.saved_bytes for b in column])),
                    boundary_bytes=round(med([b.boundary_bytes for b in column])),
                    stale_s=med([b.stale_s for b in column]),
                )
            )
        return StepProfile(tuple(blocks), round(med([s.outside_bytes for s in steps])), steps[-1].events)


@dataclass(frozen=True)
class PlannerSettings:
    """Budget and machine costs the plan is made for.

    ``swap_write_bytes_per_s``/``swap_read_bytes_per_s`` are the measured copy-out and
    copy-in bandwidths of the swap tier; ``swap_capacity_bytes`` is how much that tier may
    hold (pinned pool or disk); ``prefetch_depth`` bounds the overlap windows.
    """

    budget_bytes: int
    swap_write_bytes_per_s: float
    swap_read_bytes_per_s: float
    swap_capacity_bytes: int
    director: str = DeltaOptions.director
    prefetch_depth: int = DeltaOptions.prefetch_depth
    min_block_fraction: float = 0.01
    overrides: Mapping[str, Action] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.director not in ("exposed", "delta"):
            raise ValueError(f"director must be 'exposed' or 'delta', got {self.director!r}")
        if self.swap_write_bytes_per_s <= 0 or self.swap_read_bytes_per_s <= 0:
            raise ValueError("swap bandwidths must be positive (bytes per second)")
        if self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be at least 1, got {self.prefetch_depth}")


@dataclass(frozen=True)
class BlockDecision:
    """The action for one block and the numbers behind it (seconds and bytes)."""

    name: str
    action: Action
    saved_bytes: int
    released_bytes: int
    forward_s: float
    swap_s: float
    exposed_swap_s: float
    reason: str


@dataclass(frozen=True)
class Plan:
    """Decisions in forward order and the simulated peak of resident saved bytes."""

    decisions: tuple[BlockDecision, ...]
    budget_bytes: int
    unmanaged_peak_bytes: int
    predicted_peak_bytes: int
    min_peak_bytes: int

    @property
    def fits(self) -> bool:
        return self.predicted_peak_bytes <= self.budget_bytes

    def action(self, name: str) -> Action:
        for decision in self.decisions:
            if decision.name == name:
                return decision.action
        raise KeyError(f"no decision for block {name!r}")

    @property
    def actions(self) -> dict[str, Action]:
        return {d.name: d.action for d in self.decisions}

    def table(self) -> str:
        """Human-readable per-block decisions, for logs."""
        mib = 2**20
        rows = [
            f"{'block':<40} {'action':<9} {'saved MiB':>9} {'freed MiB':>9} "
            f"{'fwd ms':>8} {'swap ms':>8} {'exposed ms':>10}  reason"
        ]
        for d in self.decisions:
            rows.append(
                f"{d.name:<40} {d.action.value:<9} {d.saved_bytes / mib:>9.2f} "
                f"{d.released_bytes / mib:>9.2f} {d.forward_s * 1e3:>8.2f} {d.swap_s * 1e3:>8.2f} "
                f"{d.exposed_swap_s * 1e3:>10.2f}  {d.reason}"
            )
        rows.append(
            f"peak saved bytes: unmanaged {self.unmanaged_peak_bytes / mib:.2f} MiB -> planned "
            f"{self.predicted_peak_bytes / mib:.2f} MiB (budget {self.budget_bytes / mib:.2f} MiB, "
            f"lowest reachable {self.min_peak_bytes / mib:.2f} MiB)"
        )
        return "\n".join(rows)


def _resident_after_forward(block: BlockProfile, action: Action) -> int:
    if action is Action.KEEP:
        return block.saved_bytes
    if action is Action.RECOMPUTE:
        return block.boundary_bytes
    return 0


def simulate_timeline(profile: StepProfile, actions: Mapping[str, Action]) -> list[tuple[str, int]]:
    """Resident saved bytes after each forward/backward event of one step, as (label, bytes).

    Model: saved bytes outside the blocks are resident throughout; during a block's forward
    its saved tensors are all resident at once (a swap copies them out as they are made);
    at its backward, recompute re-materialises ``saved - boundary`` and swap brings back
    ``saved``; after its backward everything of that micro-batch's block is freed. Events
    follow ``profile.step_events()``, so micro-batches in flight add up.
    """
    resident = profile.outside_bytes
    points: list[tuple[str, int]] = [("start", resident)]
    for kind, index in profile.step_events():
        block = profile.blocks[index]
        action = actions.get(block.name, Action.KEEP)
        if kind == FORWARD:
            if action is not Action.RECOMPUTE:
                points.append((f"fwd {block.name}", resident + block.saved_bytes))
            resident += _resident_after_forward(block, action)
            points.append((f"fwd {block.name} done", resident))
            continue
        if action is Action.RECOMPUTE:
            peak = resident + block.saved_bytes - block.boundary_bytes
        elif action is Action.SWAP:
            peak = resident + block.saved_bytes
        else:
            peak = resident
        points.append((f"bwd {block.name}", peak))
        resident -= _resident_after_forward(block, action)
        points.append((f"bwd {block.name} done", resident))
    return points


def calibrate_outside(profile: StepProfile, actions: Mapping[str, Action], measured_peak_bytes: int) -> StepProfile:
    """``profile`` with ``outside_bytes`` set so that its simulated peak equals a measured one.

    Saved tensors outside the blocks (embeddings, the LM head, the loss of each micro-batch)
    come and go; the constant the model needs is whatever the measured peak of resident
    saved bytes holds beyond the blocks' own simulated peak under the same ``actions``.
    """
    blocks_only = replace(profile, outside_bytes=0)
    outside = max(0, measured_peak_bytes - _peak(blocks_only, actions))
    return replace(profile, outside_bytes=outside)


def _peak(profile: StepProfile, actions: Mapping[str, Action]) -> int:
    return max(b for _, b in simulate_timeline(profile, actions))


def _windows(profile: StepProfile, index: int, depth: int) -> tuple[float, float]:
    """Compute time that can hide the copy-out and the copy-in of block ``index``."""
    following = profile.blocks[index + 1 : index + 1 + depth]
    return sum(b.forward_s for b in following), sum(b.backward_s for b in following)


def _direct(
    profile: StepProfile, index: int, settings: PlannerSettings, swap_room: int
) -> BlockDecision:
    block = profile.blocks[index]
    write_s = block.saved_bytes / settings.swap_write_bytes_per_s
    read_s = block.saved_bytes / settings.swap_read_bytes_per_s
    win_out, win_in = _windows(profile, index, settings.prefetch_depth)
    exposed = max(0.0, write_s - win_out) + max(0.0, read_s - win_in)
    recompute_s = block.forward_s
    if block.saved_bytes > swap_room:
        action, reason = Action.RECOMPUTE, "swap tier full"
    elif settings.director == "delta":
        if write_s + read_s > recompute_s:
            action, reason = Action.RECOMPUTE, "delta: 2x swap > forward"
        else:
            action, reason = Action.SWAP, "delta: 2x swap <= forward"
    elif recompute_s < exposed:
        action, reason = Action.RECOMPUTE, "forward < exposed swap"
    else:
        action, reason = Action.SWAP, "exposed swap <= forward"
    return _decision(block, action, write_s + read_s, exposed, reason)


def _decision(
    block: BlockProfile, action: Action, swap_s: float, exposed_s: float, reason: str
) -> BlockDecision:
    return BlockDecision(
        name=block.name,
        action=action,
        saved_bytes=block.saved_bytes,
        released_bytes=block.saved_bytes - _resident_after_forward(block, action),
        forward_s=block.forward_s,
        swap_s=swap_s,
        exposed_swap_s=exposed_s,
        reason=reason,
    )


def plan_memory(profile: StepProfile, settings: PlannerSettings) -> Plan:
    """Release blocks (largest x stalest first) until the simulated peak fits the budget."""
    unknown = sorted(set(settings.overrides) - set(profile.names))
    if unknown:
        raise ValueError(f"overrides name blocks that are not managed: {unknown}; managed: {list(profile.names)}")
    by_name = {b.name: i for i, b in enumerate(profile.blocks)}
    decisions: dict[str, BlockDecision] = {}
    swapped = 0
    for name, action in settings.overrides.items():
        block = profile.blocks[by_name[name]]
        decisions[name] = _decision(block, Action(action), 0.0, 0.0, "user override")
        if Action(action) is Action.SWAP:
            swapped += block.saved_bytes

    mean_saved = statistics.fmean(b.saved_bytes for b in profile.blocks) if profile.blocks else 0.0
    tiny = settings.min_block_fraction * mean_saved
    candidates = sorted(
        (i for i, b in enumerate(profile.blocks) if b.name not in decisions and b.saved_bytes > tiny),
        key=lambda i: (-profile.blocks[i].saved_bytes * profile.blocks[i].stale_s, i),
    )
    all_keep = {b.name: Action.KEEP for b in profile.blocks}
    unmanaged_peak = _peak(profile, all_keep)

    def actions() -> dict[str, Action]:
        return {**all_keep, **{n: d.action for n, d in decisions.items()}}

    for i in candidates:
        if _peak(profile, actions()) <= settings.budget_bytes:
            break
        decision = _direct(profile, i, settings, settings.swap_capacity_bytes - swapped)
        decisions[decision.name] = decision
        if decision.action is Action.SWAP:
            swapped += decision.saved_bytes

    for block in profile.blocks:
        if block.name not in decisions:
            reason = "below size threshold" if block.saved_bytes <= tiny else "fits budget"
            decisions[block.name] = _decision(block, Action.KEEP, 0.0, 0.0, reason)

    releasable = [b.name for b in profile.blocks if b.saved_bytes > tiny and b.name not in settings.overrides]
    fixed = {n: Action(a) for n, a in settings.overrides.items()}
    lowest = min(
        _peak(profile, {**all_keep, **{n: action for n in releasable}, **fixed})
        for action in (Action.SWAP, Action.RECOMPUTE)
    )
    return Plan(
        decisions=tuple(decisions[b.name] for b in profile.blocks),
        budget_bytes=settings.budget_bytes,
        unmanaged_peak_bytes=unmanaged_peak,
        predicted_peak_bytes=_peak(profile, actions()),
        min_peak_bytes=lowest,
    )
