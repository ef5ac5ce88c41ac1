"""Periodic checkpoints that leave the run's last step to its one final checkpoint."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["PeriodicCheckpoint"]


class PeriodicCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` every ``every_n_train_steps`` steps, except at ``max_steps``.

    A run that writes its own final checkpoint (``merak-train`` writes ``final.ckpt``) would
    otherwise save the last step twice — three times with ``save_last`` — as identical copies.
    """

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            return
        super().on_train_batch_end(trainer, *args, **kwargs)
