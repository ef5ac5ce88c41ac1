"""``optim.lr_schedule``'s schedules move the learning rate exactly as transformers' ``get_scheduler`` would, and a
scheduler's saved state restores its schedule."""

from __future__ import annotations

import pytest
import torch
from transformers import get_scheduler

from lightning_merak.modules.config import OptimConfig, Schedule
from lightning_merak.modules.schedules import warmup_schedule

TRANSFORMERS_NAMES = {Schedule.cosine: "cosine_with_min_lr", Schedule.linear: "linear",
                      Schedule.constant: "constant_with_warmup"}


def _optimizer(learning_rate: float = 0.5) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=learning_rate)


def _rates(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize(("warmup", "total", "min_ratio"), [(0, 1, 0.1), (3, 17, 0.1), (5, 5, 0.0), (2, 40, 0.37),
                                                            (10, 4, 0.2)])
def test_each_schedule_moves_the_learning_rate_as_transformers_does(schedule, warmup, total, min_ratio):
    extra = {"min_lr_rate": min_ratio} if schedule is Schedule.cosine else None
    theirs = get_scheduler(TRANSFORMERS_NAMES[schedule], _optimizer(), num_warmup_steps=warmup,
                           num_training_steps=None if schedule is Schedule.constant else total,
                           scheduler_specific_kwargs=extra)
    ours = warmup_schedule(_optimizer(), schedule, warmup, total, min_ratio)
    steps = total + warmup + 3  # past the end: the rate stays at its end value
    assert _rates(ours, steps) == pytest.approx(_rates(theirs, steps), abs=1e-12)


def test_a_resumed_scheduler_continues_from_its_step_on_its_own_configuration():
    running = warmup_schedule(_optimizer(), Schedule.cosine, 4, 30, 0.25)
    _rates(running, 11)
    restored = warmup_schedule(_optimizer(), Schedule.cosine, 4, 30, 0.25)
    restored.load_state_dict(running.state_dict())
    assert _rates(restored, 25) == pytest.approx(_rates(running, 25), abs=1e-12)
    stretched = warmup_schedule(_optimizer(), Schedule.cosine, 4, 60, 0.25)  # resumed with a longer run
    stretched.load_state_dict(running.state_dict())
    assert stretched.last_epoch == running.last_epoch
    assert _rates(stretched, 2)[1] > _rates(running, 2)[1]  # its next step's rate follows the longer decay


def test_bad_schedule_settings_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="cosine schedule needs total_steps"):
        warmup_schedule(_optimizer(), Schedule.cosine, 2, None)
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        warmup_schedule(_optimizer(), Schedule.constant, -1)
    with pytest.raises(ValueError, match=r"optim.min_lr_ratio=1.5 must lie in \[0, 1\]"):
        OptimConfig(min_lr_ratio=1.5)
