"""The learning-rate schedules of ``optim.lr_schedule``: a linear warm-up, then cosine, linear or constant.

Each factor is the one ``transformers.get_scheduler`` computes for ``cosine_with_min_lr``, ``linear`` and
``constant_with_warmup`` (tests/test_schedules.py compares them step by step). They are written here because
importing ``transformers.optimization`` imports PEFT and bitsandbytes with it: 1.75 s in every rank of every run
on two CPU cores, after the ranks have met, where nothing else overlaps it.
"""

from __future__ import annotations

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from lightning_merak.modules.config import Schedule

__all__ = ["warmup_factor", "warmup_schedule"]


def warmup_factor(step: int, schedule: str, warmup_steps: int, total_steps: int | None, min_lr_ratio: float) -> float:
    """The multiple of the peak learning rate at optimizer step ``step``."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if schedule == Schedule.constant.value:
        return 1.0
    assert total_steps is not None, f"the {schedule} schedule needs total_steps"
    decay_steps = max(1, total_steps - warmup_steps)
    if schedule == Schedule.linear.value:
        return max(0.0, (total_steps - step) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / decay_steps))
    return max(0.0, cosine * (1.0 - min_lr_ratio) + min_lr_ratio)


def warmup_schedule(optimizer: Optimizer, schedule: Schedule, warmup_steps: int, total_steps: int | None = None,
                    min_lr_ratio: float = 0.0) -> LambdaLR:
    """``schedule`` after ``warmup_steps`` of linear warm-up from 0, ending at ``total_steps`` (not needed for
    ``constant``): cosine to ``min_lr_ratio`` of the peak, linear to 0, or constant."""
    if warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps={warmup_steps} must be at least 0")
    if schedule is not Schedule.constant and (total_steps is None or total_steps < 1):
        raise ValueError(f"the {schedule.value} schedule needs total_steps of at least 1, got {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio={min_lr_ratio} must lie in [0, 1]")
    # A partial, as transformers' schedules are: a scheduler's saved state keeps its step, and a resumed run
    # follows the schedule its own configuration gives (a longer max_steps stretches the decay).
    factor = partial(warmup_factor, schedule=schedule.value, warmup_steps=warmup_steps,
                     total_steps=None if schedule is Schedule.constant else total_steps,
                     min_lr_ratio=min_lr_ratio if schedule is Schedule.cosine else 0.0)
    return LambdaLR(optimizer, factor)
