"""PeriodicCheckpoint saves a step's checkpoint after the validation that follows the step: a run that dies during
that validation resumes from the checkpoint before and logs it, where Lightning's order (save, then validate, and a
resumed run skips the validation after its checkpoint's step) lost it."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.checkpoint import PeriodicCheckpoint


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _DieInValidation(pl.Callback):
    """Raise at the start of the validation after global step ``step``: a rank lost during it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("lost during validation")


def _fit(tmp_path: Path, name: str, *callbacks: pl.Callback, ckpt_path: Path | None = None) -> list[int]:
    """The Lightning steps at which a 6-step run (validation and a checkpoint every 2 steps) logged val/loss."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
    logger = CSVLogger(tmp_path / name, name="", version="")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, val_check_interval=2, limit_val_batches=1,
                         num_sanity_val_steps=0, logger=logger, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[PeriodicCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2,
                                                       save_top_k=-1, filename="{step}"), *callbacks])
    try:
        trainer.fit(_Regression(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4),
                    ckpt_path=ckpt_path)
    except RuntimeError as error:
        assert "lost during validation" in str(error)
    logger.experiment.save()
    with open(Path(logger.log_dir) / "metrics.csv") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("val/loss")]


def test_a_run_lost_during_a_validation_resumes_before_it_and_logs_it(tmp_path: Path) -> None:
    reference = _fit(tmp_path / "reference", "run")
    assert reference == [1, 3, 5]
    died = _fit(tmp_path, "died", _DieInValidation(step=4))
    assert died == [1]
    saved = sorted(path.name for path in (tmp_path / "checkpoints").glob("*.ckpt"))
    assert saved == ["step=2.ckpt"], "the checkpoint of step 4 is saved once its validation has run"
    resumed = _fit(tmp_path, "resumed", ckpt_path=tmp_path / "checkpoints" / "step=2.ckpt")
    assert sorted(set(died + resumed)) == reference


@pytest.mark.parametrize("val_check_interval", [2, 3])
def test_checkpoints_are_saved_at_their_steps_with_or_without_a_validation_after_them(
        tmp_path: Path, val_check_interval: int) -> None:
    data = TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=7, val_check_interval=val_check_interval,
                         limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[PeriodicCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1,
                                                       filename="{step}")])
    trainer.fit(_Regression(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    assert sorted(path.name for path in tmp_path.glob("*.ckpt")) == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
