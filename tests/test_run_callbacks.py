"""merak-train's own callbacks: step progress across epochs, and periodic checkpoints that leave the last step alone."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks import PeriodicCheckpoint, StepProgressBar
from lightning_merak.callbacks.progress import format_progress_line


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.layer(inputs), targets)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, callbacks, max_steps=6, enable_progress_bar=True):
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)  # 4 steps an epoch
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, logger=False,
                         enable_checkpointing=any(isinstance(c, PeriodicCheckpoint) for c in callbacks),
                         enable_progress_bar=enable_progress_bar, enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(_Regression(), data)
    return trainer


def test_progress_line_reads_steps_of_the_run_and_time_left():
    line = format_progress_line(20, 300, 1, {"train/loss": 3.21449, "v_num": 0}, elapsed_s=10.0, steps_done=20)
    assert line == "step 20/300 (6%) | epoch 1 | train/loss 3.214 | 2.00 steps/s | ETA 2:20"
    assert format_progress_line(7, None, 0, {}, 0.0, 0) == "step 7 | epoch 0"


def test_off_a_terminal_one_line_every_n_steps_counting_across_epochs(tmp_path, capsys):
    _fit(tmp_path, [StepProgressBar(log_every_n_steps=2, interactive=False)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 2/6 (33%)", "step 4/6 (66%)", "step 6/6 (100%)"]
    assert "epoch 1" in lines[-1] and "train/loss" in lines[-1]


def test_on_a_terminal_the_bar_counts_toward_max_steps(tmp_path):
    bar = StepProgressBar(interactive=True)
    _fit(tmp_path, [bar])
    assert bar.train_progress_bar.total == 6 and bar.train_progress_bar.n == 6


def test_the_bar_quiets_the_console_of_the_process_that_makes_it(caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        StepProgressBar()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`",
                      FutureWarning)
        warnings.warn("a warning someone can act on", UserWarning)
    assert [str(w.message) for w in caught] == ["a warning someone can act on"]
    with caplog.at_level(logging.INFO):
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info("💡 Tip: try a hosted logger")
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info("GPU available: False")
    assert [record.getMessage() for record in caplog.records] == ["GPU available: False"]


def test_periodic_checkpoint_leaves_the_last_step_to_the_final_checkpoint(tmp_path):
    checkpoint = PeriodicCheckpoint(dirpath=tmp_path / "checkpoints", filename="step={step}",
                                    auto_insert_metric_name=False, every_n_train_steps=2)
    _fit(tmp_path, [checkpoint], enable_progress_bar=False)
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["step=4.ckpt"]
