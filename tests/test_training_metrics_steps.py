"""TrainingMetrics and the callbacks beside it, in one process: a skipped non-finite step logs its non-finite
gradient norm with and without clipping; every value of one optimizer step shares Lightning's step; a checkpoint
write is not training time; a DeepSpeed strategy without CUDA is refused before launch."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks import TrainingMetrics
from lightning_merak.callbacks.nonfinite import NonFiniteGuard
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig

VOCAB, SEQ, BATCH = 64, 16, 4
MODEL = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "attention_dropout": 0.0})


def _module() -> CausalLMModule:
    torch.manual_seed(0)
    model = build_causal_lm(MODEL, vocab_size=VOCAB)
    model.config.use_cache = False
    return CausalLMModule(model)


def _loader(steps: int) -> DataLoader:
    data = torch.randint(VOCAB, (steps * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(data), batch_size=BATCH)


def _rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def _steps(rows: list[dict[str, str]], key: str) -> list[int]:
    return [int(row["step"]) for row in rows if row.get(key)]


class _NaNGradientsAt(pl.Callback):
    """Fills every gradient with NaN after the backward of optimizer step ``step`` (1-based), and records the
    parameters before and after that step."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.before: dict[str, torch.Tensor] = {}
        self.after: dict[str, torch.Tensor] = {}

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step + 1 == self.step:
            self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            for param in pl_module.parameters():
                if param.grad is not None:
                    param.grad.fill_(float("nan"))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.after = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


@pytest.mark.parametrize("strategy_name,clip", [("merak3d", 1.0), ("merak3d", None), ("auto", 1.0), ("auto", None)])
def test_a_skipped_nan_step_logs_a_nan_gradient_norm_whatever_the_clipping(
        tmp_path: Path, strategy_name: str, clip: Optional[float]) -> None:
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    strategy: Any = Merak3DStrategy() if strategy_name == "merak3d" else "auto"
    logger = CSVLogger(tmp_path, name="csv")
    nan = _NaNGradientsAt(step=2)
    # the guard before the metrics: it acts first on the step, as a user's callback list may order it
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=logger,
                         log_every_n_steps=2, gradient_clip_val=clip, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[nan, NonFiniteGuard("skip"), TrainingMetrics()])
    trainer.fit(_module(), _loader(4))
    rows = _rows(logger)
    norms = [float(row["train/grad_norm"]) for row in rows if row.get("train/grad_norm")]
    assert len(norms) == 2 and math.isnan(norms[0]), norms  # optimizer step 2's, the skipped one
    assert math.isfinite(norms[1]) and norms[1] > 0
    assert _steps(rows, "train/grad_norm") == [1, 3]  # Lightning's steps of optimizer steps 2 and 4
    assert nan.after and all(torch.equal(nan.before[n], nan.after[n]) for n in nan.before)  # the step was skipped
    assert _steps(rows, "nonfinite/skipped")[0] == 1  # the guard's count starts on the same step's row


def test_every_value_of_an_optimizer_step_shares_lightnings_step(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="csv")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=logger, log_every_n_steps=2,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[TrainingMetrics(), LearningRateMonitor(logging_interval="step")])
    trainer.fit(_module(), _loader(5))
    rows = _rows(logger)
    assert _steps(rows, "train/loss") == [1, 3, 4]  # the last step's too, which Lightning leaves unwritten
    assert [int(row["step"]) for row in rows if any(key.startswith("lr-") and value for key, value in row.items())
            ] == [1, 3]
    assert _steps(rows, "perf/step_time_s") == [1, 3, 4]  # and the run's last step, which Lightning leaves out
    assert _steps(rows, "train/grad_norm") == [1, 3, 4]
    assert _steps(rows, "memory/peak_MiB/max") == [1, 3, 4]
    figures = sorted(p.name for p in (Path(logger.log_dir) / "figures").glob("*.png"))
    assert figures == ["memory_over_steps-step4.png"]


def test_intervals_after_a_resume_end_where_lightnings_do(tmp_path: Path) -> None:
    checkpoint = tmp_path / "step3.ckpt"
    first = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False)
    first.fit(_module(), _loader(8))
    first.save_checkpoint(checkpoint)
    logger = CSVLogger(tmp_path, name="csv")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=logger, log_every_n_steps=2,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[TrainingMetrics()])
    trainer.fit(_module(), _loader(8), ckpt_path=checkpoint)
    rows = _rows(logger)
    assert _steps(rows, "train/loss") == [3, 5, 7]
    assert _steps(rows, "perf/step_time_s") == [3, 5, 7]


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.layer(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _SlowSave(pl.Callback):
    """A checkpoint write that takes ``seconds`` (in the checkpoint's own hook: inside every save)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.saves = 0

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self.saves += 1
        time.sleep(self.seconds)


def test_checkpoint_writes_are_left_out_of_the_step_time(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="csv")
    slow = _SlowSave(seconds=1.0)
    saving = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=logger, log_every_n_steps=3,
                         callbacks=[TrainingMetrics(), slow, saving], enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(_Regression(), DataLoader(TensorDataset(torch.randn(24, 4), torch.randn(24, 1)), batch_size=4))
    rows = _rows(logger)
    assert slow.saves == 3  # steps 2, 4, 6: each interval of three steps holds one save
    step_times = [float(row["perf/step_time_s"]) for row in rows if row.get("perf/step_time_s")]
    assert len(step_times) == 2 and max(step_times) < 0.2, step_times  # a save would add 1 s / 3 steps
    assert "save_checkpoint" not in vars(trainer)  # the trainer is left as it was


def test_deepspeed_without_cuda_is_refused_before_launch_naming_the_fix() -> None:
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    from lightning_merak.cli.checks import check_strategy_accelerator
    from lightning_merak.cli.overrides import ConfigError

    entry = StrategyRegistry["deepspeed_stage_2"]
    deepspeed = entry["strategy"](**entry["init_params"])
    with pytest.raises(ConfigError, match=r"CUDA GPUs only.*trainer.accelerator=cpu.*strategy=merak3d.*trainer=gpu"):
        check_strategy_accelerator(deepspeed, "cpu")
    check_strategy_accelerator(deepspeed, "gpu")
    check_strategy_accelerator(DDPStrategy(), "cpu")
    if not torch.cuda.is_available():  # "auto" picks the CPU here: refused; on a CUDA machine it passes
        with pytest.raises(ConfigError, match=r"trainer.accelerator=auto"):
            check_strategy_accelerator(deepspeed, "auto")


@pytest.mark.parametrize("max_steps,every", [(2, 10), (6, 3), (7, 3)])
def test_the_last_step_s_training_values_are_written_once_whatever_the_logging_interval(
        tmp_path: Path, max_steps: int, every: int) -> None:
    """A run shorter than ``log_every_n_steps`` (or ending between intervals) still writes its last step's
    ``train/loss``; a last step Lightning logged itself is not written twice; validation's values are not repeated."""
    logger = CSVLogger(tmp_path, name="csv")
    trainer = pl.Trainer(max_steps=max_steps, log_every_n_steps=every, logger=logger, callbacks=[TrainingMetrics()],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0)
    trainer.fit(_module(), _loader(max_steps), _loader(1))
    rows = _rows(logger)
    interval_ends = [step for step in range(max_steps) if (step + 1) % every == 0]
    last = max_steps - 1
    assert _steps(rows, "train/loss") == interval_ends + ([] if last in interval_ends else [last])
    assert _steps(rows, "val/loss") == [step for step in range(max_steps) if (step + 1) % 2 == 0]
