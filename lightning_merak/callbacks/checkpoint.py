"""Periodic checkpoints that leave the run's last step to its one final checkpoint."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["PeriodicCheckpoint"]


class PeriodicCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` every ``every_n_train_steps`` steps, except at ``max_steps``, saved after the validation
    that follows its step.

    A run that writes its own final checkpoint (``merak-train`` writes ``final.ckpt``) would
    otherwise save the last step twice — three times with ``save_last`` — as identical copies.
    Lightning saves a step's checkpoint before the validation after it, and a run resumed from such a checkpoint
    skips that validation: a run that died during it, or was resumed from it, never logs it.
    """

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            return
        if self._saves_this_step(trainer) and _validation_follows(trainer) \
                and not self._should_save_on_train_epoch_end(trainer):
            self._defer_save_until_validation = True  # ModelCheckpoint.on_validation_end saves it
            return
        super().on_train_batch_end(trainer, *args, **kwargs)

    def _saves_this_step(self, trainer: pl.Trainer) -> bool:
        """Whether the step count calls for a checkpoint at this step."""
        return (self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
                and not self._should_skip_saving_checkpoint(trainer) and hasattr(self, "_defer_save_until_validation"))


def _validation_follows(trainer: pl.Trainer) -> bool:
    """Whether Lightning runs a validation right after this training batch (its loop's own decision; False where
    this Lightning release keeps it elsewhere, and the checkpoint is saved before the validation, as Lightning does)."""
    loop = trainer.fit_loop.epoch_loop
    should_validate = getattr(loop, "_should_check_val_fx", None)  # private: checked, not assumed
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if should_validate is None or fetcher is None or getattr(loop, "_skip_next_val", False):
        return False
    return bool(should_validate(fetcher))
