"""Stage-aware activation recomputation (Merak, spec 1.4).

Under 1F1B stage i holds about S - i micro-batches, so later stages have spare memory
and need less checkpointing than stage 0: the ratio shrinks with the stage index so
that each stage keeps roughly the same activation footprint as stage 0.
"""

from __future__ import annotations

import math

_FLOOR_TOLERANCE = 1e-9
"""Absorbs float error in ``n * ratio`` (0.29 * 100 is 28.999...), so exact products floor to themselves."""


def _check_ratio(ratio: float, name: str) -> None:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {ratio}")


def stage_aware_recompute_ratios(first_stage_ratio: float, num_stages: int) -> list[float]:
    """Per-stage checkpoint ratios r_i = 1 - (1 - r)(S - 1)/(S - 1 - i), clamped to [0, 1]; last stage 0.

    With a single stage there is no later stage to shift memory to, so it keeps ``first_stage_ratio``.
    """
    _check_ratio(first_stage_ratio, "first_stage_ratio")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages == 1:
        return [first_stage_ratio]
    last = num_stages - 1
    ratios = [1.0 - (1.0 - first_stage_ratio) * last / (last - stage) for stage in range(last)]
    return [min(1.0, max(0.0, ratio)) for ratio in ratios] + [0.0]


def blocks_to_recompute(num_blocks_in_stage: int, ratio: float) -> int:
    """How many leading blocks of a stage to checkpoint: floor(n * ratio)."""
    if num_blocks_in_stage < 0:
        raise ValueError(f"num_blocks_in_stage must be >= 0, got {num_blocks_in_stage}")
    _check_ratio(ratio, "ratio")
    return math.floor(num_blocks_in_stage * ratio + _FLOOR_TOLERANCE)
