"""A run restarted with ``resume`` keeps the metrics its dead attempt logged before the checkpoint it resumed from.

merak-train writes every attempt of a run into ``<output_dir>/csv``; Lightning's CSVLogger deleted the
``metrics.csv`` it found there, so a ``torchrun --max-restarts`` restart lost the first attempt's loss history.
Here one process plays both attempts with ``logger=csv``'s logger, built from merak-train's configuration.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_merak.cli.config import register_configs
from lightning_merak.cli.overrides import _compose


class _LoggedLoss(BoringModel):
    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.log("train/loss", output["loss"])
        return output


class _LogsAfterTheUpdate(pl.Callback):
    """Logs as TrainingMetrics does: at ``global_step`` after the update (its step 6 is made before step=6.ckpt)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.logger.log_metrics({"perf/updates": float(trainer.global_step)}, step=trainer.global_step)


class _DiesAtStep(pl.Callback):
    """Ends the attempt with an error once ``step`` optimizer steps are done (after a checkpoint before it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("the attempt dies")


def _csv_logger(output_dir: Path):
    """``logger=csv`` as merak-train instantiates it for a run writing to ``output_dir``."""
    register_configs()
    return instantiate(_compose(["logger=csv", f"output_dir={output_dir}"]).logger.csv)


def _attempt(output_dir: Path, max_steps: int, dies_at: int | None = None, resume: Path | None = None) -> None:
    pl.seed_everything(0)
    callbacks = [ModelCheckpoint(dirpath=output_dir / "checkpoints", filename="step={step}",
                                 auto_insert_metric_name=False, every_n_train_steps=3, save_top_k=-1)]
    callbacks += [_LogsAfterTheUpdate()] + ([_DiesAtStep(dies_at)] if dies_at is not None else [])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=_csv_logger(output_dir),
                         callbacks=callbacks, log_every_n_steps=1, limit_val_batches=0, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.logger.log_hyperparams({"attempt": "resumed" if resume else "first"})  # as merak-train's fit does
    trainer.fit(_LoggedLoss(), ckpt_path=resume)


def _losses(output_dir: Path, name: str = "train/loss") -> list[tuple[int, str]]:
    with open(output_dir / "csv" / "metrics.csv", newline="") as file:
        return sorted((int(row["step"]), row[name]) for row in csv.DictReader(file) if row.get(name))


def test_a_restart_keeps_the_loss_history_before_its_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="the attempt dies"):
        _attempt(tmp_path, max_steps=12, dies_at=8)
    first = _losses(tmp_path)
    assert [step for step, _ in first] == list(range(7))  # step 6 logged after the step=6 checkpoint
    _attempt(tmp_path, max_steps=12, resume=tmp_path / "checkpoints" / "step=6.ckpt")
    history = _losses(tmp_path)
    assert [step for step, _ in history] == list(range(12)), history  # each step once: 6 the new attempt's
    assert history[:6] == first[:6]
    assert [step for step, _ in _losses(tmp_path, "perf/updates")] == list(range(1, 13))


def test_a_run_started_afresh_in_the_same_directory_replaces_the_file(tmp_path: Path) -> None:
    _attempt(tmp_path, max_steps=4)
    _attempt(tmp_path, max_steps=2)
    assert [step for step, _ in _losses(tmp_path)] == [0, 1]


def test_a_lightning_without_the_overridden_hook_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The logger overrides a private hook of Lightning's writer; a Lightning without it gets a warning, not a
    silent loss of the earlier rows."""
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter

    from lightning_merak.cli.metrics_history import ResumableCSVLogger

    for owner in ExperimentWriter.__mro__:  # the class that defines it (Lightning's writer inherits it from Fabric's)
        if "_check_log_dir_exists" in vars(owner):
            monkeypatch.delattr(owner, "_check_log_dir_exists")
    with pytest.warns(UserWarning, match="no _check_log_dir_exists"):
        assert ResumableCSVLogger(str(tmp_path), name="csv", version="").experiment is not None
