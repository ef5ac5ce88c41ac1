"""interleaved_zero_bubble on a module whose loss merak3d reads by replaying its own ``training_step``.

The zero-bubble schedule splits each micro-batch's backward into an input-gradient pass and a weight-gradient pass;
after the first it detaches the last stage's loss in place, which torch refuses for a view (the replayed step's
scalar loss reshaped, or a loss a ``training_step`` indexes out of a tensor).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import (
    TrainingTrace,
    assert_traces_match,
    layout_gradients,
    merge_rank_traces,
    run_distributed,
)
from lightning_merak.testing.compare import record_reference_trace
from tests.test_dropin_module import _Residual

VOCAB, SEQ, HIDDEN, STEPS, BATCH, LR = 32, 8, 16, 2, 8, 0.5
LAYOUT = {"data_parallel": 1, "pipeline_parallel": 2, "micro_batches": 4, "schedule": "interleaved_zero_bubble",
          "virtual_stages": 2, "partition": "uniform"}


class _Net(nn.Module):
    """A hand-written network (no transformers ``labels`` loss): embedding, four blocks (one per stage), head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(_Residual(HIDDEN) for _ in range(4))
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.norm(hidden))


def _loss(net: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class _ReplayedModule(pl.LightningModule):
    """Its loss comes from its own ``training_step``: merak3d replays it per micro-batch on the last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _Net()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = _loss(self.net, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class _Recorder(pl.Callback):
    def __init__(self) -> None:
        self.trace = TrainingTrace()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.trace.append(float(trainer.callback_metrics["train_loss"]),
                          layout_gradients(trainer.strategy, pl_module.net))


def _batches() -> torch.Tensor:
    return torch.randint(VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _train_rank(rank: int, world_size: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    recorder = _Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**LAYOUT, timeout_s=30), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(_ReplayedModule(), DataLoader(_batches(), batch_size=BATCH, shuffle=False))
    return recorder.trace.losses, recorder.trace.gradients


def _one_process() -> TrainingTrace:
    """The same steps unsplit: each batch's loss (the mean of its equal micro-batches') and its gradients."""
    net = _Net()
    return record_reference_trace(net, _batches().split(BATCH), _loss, torch.optim.SGD(net.parameters(), lr=LR))


@pytest.mark.distributed
def test_interleaved_zero_bubble_trains_a_replayed_training_step_as_one_process():
    """Two ranks, two stages each (0, 2 and 1, 3): every step's loss and every gradient as unsplit."""
    trace = merge_rank_traces(run_distributed(_train_rank, 2, timeout_s=60))
    reference = _one_process()
    assert set(trace.gradients[0]) == set(reference.gradients[0])
    assert_traces_match(reference, trace, loss_rtol=1e-5, grad_rtol=1e-4)
