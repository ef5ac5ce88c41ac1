"""The step a logger gives an optimizer step: Lightning's own, so that every value and figure of one step
lands on one row.

Lightning logs what ``self.log`` records (the loss, the learning rate) at the number of optimizer steps taken
*before* the one under way (``fit_loop.epoch_loop._batches_that_stepped``, which it counts up after
``on_train_batch_end``): the first step is logged at 0. It writes those values every ``log_every_n_steps``, when
``(step + 1) % log_every_n_steps == 0``. A callback writing to the loggers itself uses the same number and test.
"""

from __future__ import annotations

import lightning.pytorch as pl

__all__ = ["logged_step", "logs_at"]


def logged_step(trainer: pl.Trainer, *, after_update: bool) -> int:
    """The step Lightning's loggers give the optimizer step under way (``after_update=False``: called before it
    updates, as in ``on_before_optimizer_step``) or just taken (``after_update=True``: ``on_train_batch_end``).

    Lightning keeps this count in a private attribute; where it has none, the optimizer steps taken before this
    one stand for it (the same count with one optimizer)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    counted = getattr(loop, "_batches_that_stepped", None)
    if isinstance(counted, int) and not isinstance(counted, bool):
        return counted
    return max(trainer.global_step - 1, 0) if after_update else trainer.global_step


def logs_at(step: int, every_n_steps: int) -> bool:
    """Whether an interval of ``every_n_steps`` ends at logged ``step``, as Lightning decides (0: never)."""
    return every_n_steps > 0 and (step + 1) % every_n_steps == 0
