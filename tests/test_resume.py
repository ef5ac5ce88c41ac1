"""Resuming in the middle of an epoch continues the interrupted run exactly: the training loader
skips the batches already trained in the same shuffle order, and merak3d keeps the restored
learning-rate schedule when it builds its layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import DataConfig, ModelConfig, OptimConfig, Schedule
from lightning_merak.modules.data import LanguageModelingData
from lightning_merak.testing import run_distributed
from lightning_merak.testing.compare import StepLosses

MODEL = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2})


def checkpointing_trainer(max_steps: int, strategy: Any, devices: int, checkpoint_dir: str | None,
                          checkpoint_every: int | None, plugins: tuple[Any, ...] = (),
                          limit_train_batches: int | float = 1.0) -> tuple[pl.Trainer, StepLosses]:
    """A quiet CPU trainer that records each step's loss and, with ``checkpoint_every``, keeps every checkpoint."""
    losses = StepLosses()
    callbacks: list[pl.Callback] = [losses]
    if checkpoint_every is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=checkpoint_every,
                                         save_top_k=-1, filename="{step}"))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
                         enable_checkpointing=checkpoint_every is not None, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=callbacks, plugins=list(plugins), limit_train_batches=limit_train_batches)
    return trainer, losses


def _fit(max_steps: int, strategy: Any = "auto", devices: int = 1, resume_from: str | None = None,
         save_to: str | None = None, checkpoint_dir: str | None = None,
         checkpoint_every: int | None = None) -> list[float]:
    """A run of the tiny Llama on generated data (10 batches an epoch on one rank), AdamW with a warm-up, then a
    constant rate: the schedule's length follows the Trainer's, so a run stopped or extended early would change a
    decaying one, and these runs stop at different steps."""
    pl.seed_everything(0, workers=True)
    data = LanguageModelingData(DataConfig(name="synthetic", seq_len=16, batch_size=4, vocab_size=64,
                                           num_sequences=40))
    module = CausalLMModule(build_causal_lm(MODEL, 64), OptimConfig(warmup_steps=2, lr_schedule=Schedule.constant))
    trainer, losses = checkpointing_trainer(max_steps, strategy, devices, checkpoint_dir, checkpoint_every)
    trainer.fit(module, datamodule=data, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return losses.losses


def test_resuming_mid_epoch_or_at_an_epoch_end_continues_the_run(tmp_path: Path) -> None:
    straight = _fit(14)
    _fit(12, checkpoint_dir=str(tmp_path), checkpoint_every=5)
    assert _fit(14, resume_from=str(tmp_path / "step=5.ckpt")) == straight[5:], "mid-epoch"
    assert _fit(14, resume_from=str(tmp_path / "step=10.ckpt")) == straight[10:], "at the epoch's end"
    _fit(6, save_to=str(tmp_path / "stopped.ckpt"))
    assert _fit(14, resume_from=str(tmp_path / "stopped.ckpt")) == straight[6:], "after max_steps stopped it"


def _interrupted_rank(rank: int, world_size: int, strategy_name: str, directory: str) -> dict[str, list[float]]:
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    def strategy() -> Any:
        return "ddp" if strategy_name == "ddp" else Merak3DStrategy(data_parallel=world_size, timeout_s=120)

    path = str(Path(directory) / f"{strategy_name}.ckpt")
    straight = _fit(9, strategy(), world_size)
    _fit(3, strategy(), world_size, save_to=path)
    return {"straight": straight, "resumed": _fit(9, strategy(), world_size, resume_from=path)}


@pytest.mark.distributed
@pytest.mark.parametrize("strategy_name", ["ddp", "merak3d"])
def test_data_parallel_ranks_resume_mid_epoch_with_their_learning_rate_schedule(tmp_path: Path,
                                                                                strategy_name: str) -> None:
    """Each rank skips its own trained batches of the distributed sampler's order; under merak3d the
    warm-up + cosine schedule continues from the checkpoint (it restarted from step 0 before)."""
    for result in run_distributed(_interrupted_rank, 2, args=(strategy_name, str(tmp_path)), timeout_s=300):
        assert result["resumed"] == pytest.approx(result["straight"][3:], rel=1e-6)


def test_outside_a_trainer_a_restored_loader_continues_its_pass():
    data = LanguageModelingData(DataConfig(name="synthetic", seq_len=8, batch_size=2, vocab_size=32,
                                           num_sequences=24))
    data.setup("fit")
    first = data.train_dataloader()
    passes = [[batch.clone() for (batch,) in first] for _ in range(2)]
    restored = data.train_dataloader()
    restored.load_state_dict({"pass": 1, "batches": 3})
    continued = [batch for (batch,) in restored]
    assert len(continued) == len(passes[1]) - 3
    assert all(torch.equal(a, b) for a, b in zip(continued, passes[1][3:]))
    assert not torch.equal(passes[0][0], passes[1][0]), "each pass has its own order"
