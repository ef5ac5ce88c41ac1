"""Training progress toward ``max_steps``, readable on a terminal and in a log file.

Lightning's bars count batches per epoch ("Epoch 1/-2" when only ``max_steps`` bounds the
run) and, written to a file, show nothing until the end. :class:`StepProgressBar` counts
optimizer steps toward the run's total across epochs; when standard output is not a
terminal it prints one plain line every ``log_every_n_steps`` steps instead of a bar.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from lightning_merak.util.console import quiet_dependency_noise, quiet_other_ranks

__all__ = ["StepProgressBar", "format_progress_line"]


def _format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_progress_line(
    step: int, total: Optional[int], epoch: int, metrics: dict[str, Any], elapsed_s: float, steps_done: int
) -> str:
    """One progress line: ``step 20/300 (7%) | epoch 0 | train/loss 3.214 | 2.10 steps/s | ETA 2:13``."""
    parts = [f"step {step}/{total} ({100 * step // total}%)" if total else f"step {step}"]
    parts.append(f"epoch {epoch}")
    for name, value in metrics.items():
        if name == "v_num":
            continue
        parts.append(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}")
    if steps_done > 0 and elapsed_s > 0:
        rate = steps_done / elapsed_s
        parts.append(f"{rate:.2f} steps/s")
        if total:
            parts.append(f"ETA {_format_seconds(max(total - step, 0) / rate)}")
    return " | ".join(parts)


class StepProgressBar(TQDMProgressBar):
    """A bar over the run's optimizer steps on a terminal; one line every N steps elsewhere.

    Args:
        log_every_n_steps: steps between two plain lines when not on a terminal.
        interactive: force the terminal (``True``) or the plain-line (``False``) behaviour;
            ``None`` asks whether standard output is a terminal.
        quiet_console: drop the dependencies' warnings and tips nobody can act on, and keep informational lines
            to rank 0 (:mod:`lightning_merak.util.console`, as ``merak-train`` does); it takes effect when the
            callback is made, before the Trainer, in every rank.
    """

    def __init__(self, log_every_n_steps: int = 10, interactive: Optional[bool] = None,
                 quiet_console: bool = True) -> None:
        if not isinstance(log_every_n_steps, int) or isinstance(log_every_n_steps, bool) or log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} must be an integer >= 1 (steps between two "
                             "plain lines)")
        if quiet_console:
            quiet_dependency_noise()
            quiet_other_ranks()
        super().__init__(refresh_rate=1, leave=False)
        self.log_every_n_steps = log_every_n_steps
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self._started_at = 0.0
        self._first_step = 0

    @staticmethod
    def total_steps(trainer: pl.Trainer) -> Optional[int]:
        """The run's optimizer steps (``max_steps``, or what ``max_epochs`` implies), ``None`` if unbounded."""
        total = trainer.estimated_stepping_batches
        return None if total is None or math.isinf(total) else int(total)

    def _quiet_bar(self) -> Tqdm:
        return Tqdm(disable=True)

    def init_sanity_tqdm(self) -> Tqdm:
        return super().init_sanity_tqdm() if self.interactive else self._quiet_bar()

    def init_train_tqdm(self) -> Tqdm:
        return super().init_train_tqdm() if self.interactive else self._quiet_bar()

    def init_validation_tqdm(self) -> Tqdm:
        return super().init_validation_tqdm() if self.interactive else self._quiet_bar()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._started_at = time.monotonic()
        self._first_step = trainer.global_step
        self.train_progress_bar.reset(total=self.total_steps(trainer))
        self.train_progress_bar.initial = trainer.global_step
        self.train_progress_bar.set_description("Training")

    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        """Keep counting steps across epochs instead of restarting the bar."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        metrics = self.get_metrics(trainer, pl_module)
        if self.interactive:
            bar = self.train_progress_bar
            if not bar.disable:
                bar.n = step
                bar.set_postfix({"epoch": trainer.current_epoch, **metrics}, refresh=False)
                bar.refresh()
            return
        total = self.total_steps(trainer)
        if self.is_enabled and (step % self.log_every_n_steps == 0 or step == total):
            line = format_progress_line(step, total, trainer.current_epoch, metrics,
                                        time.monotonic() - self._started_at, step - self._first_step)
            print(line, flush=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.interactive:
            super().on_train_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self.interactive and self.is_enabled and not trainer.sanity_checking:
            values = {name: value for name, value in self.get_metrics(trainer, pl_module).items()
                      if name.startswith("val")}
            if values:
                shown = " | ".join(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}"
                                   for name, value in values.items())
                print(f"validation at step {trainer.global_step} | {shown}", flush=True)
