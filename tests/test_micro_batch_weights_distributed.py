"""A user's own loss at pipeline_parallel=2 with a micro-batch whose labels are all -100, against one process.

The loss of such a micro-batch, replayed from ``training_step`` or given by ``loss_from_outputs``, is NaN (a mean
over no label); it made the whole step's loss and gradients NaN where one process gives a number. It now weighs 0
and the others are re-normalised.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import TrainingTrace, assert_traces_match, merge_rank_traces, run_distributed
from lightning_merak.testing.compare import LayoutTraceRecorder, record_reference_trace

pytestmark = pytest.mark.distributed

BATCH, STEPS, LENGTH, VOCAB = 4, 2, 12, 64
UNSCORED = (1, 4, 5, 6)
"""Samples whose labels are all -100: one micro-batch of the first step, three of the second (one sample each)."""


def _smoothed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), label_smoothing=0.1)


class _SmoothedLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, use_cache=False))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = _smoothed_loss(self.model(batch["input_ids"]).logits, batch["labels"])
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _SmoothedLMWithLossFromOutputs(_SmoothedLM):
    """The same loss, given to merak3d as ``loss_from_outputs`` (scored per micro-batch on the last stage)."""

    def loss_from_outputs(self, outputs, batch: dict) -> torch.Tensor:
        return _smoothed_loss(outputs.logits, batch["labels"])

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.loss_from_outputs(self.model(batch["input_ids"]), batch)
        self.log("train/loss", loss)
        return loss


MODULES = {"replayed_training_step": _SmoothedLM, "loss_from_outputs": _SmoothedLMWithLossFromOutputs}


def _samples() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(VOCAB, (BATCH * STEPS, LENGTH), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[list(UNSCORED)] = -100
    return [{"input_ids": ids[index], "labels": labels[index]} for index in range(len(ids))]


def _train_rank(rank: int, world_size: int, module: str) -> tuple[list[float], list[dict]]:
    recorder = LayoutTraceRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, max_steps=STEPS, logger=False, enable_checkpointing=False,
        strategy=Merak3DStrategy(pipeline_parallel=2, micro_batches=BATCH, timeout_s=120),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(MODULES[module](), train_dataloaders=DataLoader(_samples(), batch_size=BATCH))
    return recorder.losses, recorder.gradients


def _reference() -> TrainingTrace:
    """One process on each whole batch: the mean over its scored labels (equal per sample that scores any)."""
    module = _SmoothedLM()
    module.log = lambda *args, **kwargs: None
    return record_reference_trace(module.model, DataLoader(_samples(), batch_size=BATCH),
                                  lambda model, batch: module.training_step(batch, 0),
                                  torch.optim.SGD(module.parameters(), lr=0.5))


@pytest.mark.parametrize("module", list(MODULES))
def test_micro_batches_without_labels_leave_the_step_as_one_process_computes_it(module: str) -> None:
    candidate = merge_rank_traces(run_distributed(_train_rank, 2, args=(module,), timeout_s=300))
    assert all(math.isfinite(loss) for loss in candidate.losses), candidate.losses
    assert_traces_match(_reference(), candidate)
