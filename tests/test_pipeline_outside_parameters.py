"""Parameters a pipelined module's loss uses outside its network (a learned temperature, an LM head the
LightningModule holds) train as in one process, the same on every pipeline and data-parallel rank."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import assert_traces_match, merge_rank_traces, record_reference_trace, run_distributed
from lightning_merak.testing.compare import LayoutTraceRecorder
from lightning_merak.testing.data import ReplicaBatches

VOCAB, WIDTH, SEQ, BATCH, STEPS = 64, 16, 8, 8, 3
OUTSIDE = ("head.weight", "head.bias", "log_temperature")
CLIP = 0.1
"""Well below the gradients' norm, so clipping scales every step."""


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.linear(torch.tanh(self.norm(hidden)))


class _Trunk(nn.Module):
    """Embedding, blocks and final norm: hidden states out, no head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.norm(hidden)


class _HeadOutside(pl.LightningModule):
    """Holds the LM head and a learned temperature beside its network; its training_step uses both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _Trunk()
        self.head = nn.Linear(WIDTH, VOCAB)
        self.log_temperature = nn.Parameter(torch.tensor(0.3))

    def loss(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden) * self.log_temperature.exp()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        loss = self.loss(self.model(input_ids), input_ids)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _batches() -> torch.Tensor:
    return torch.randint(VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _outside(module: _HeadOutside) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in module.named_parameters() if name in OUTSIDE}


def _train_rank(rank: int, world_size: int, layout: dict, clip: bool) -> tuple:
    recorder = LayoutTraceRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder],
        gradient_clip_val=CLIP if clip else None)
    module = _HeadOutside()
    trainer.fit(module, datamodule=ReplicaBatches(_batches(), 0, STEPS))
    return recorder.losses, recorder.gradients, _outside(module)


@pytest.mark.distributed
def test_parameters_outside_the_pipelined_network_train_on_every_rank_as_in_one_process():
    module = _HeadOutside()
    expected = record_reference_trace(module.model, [(batch,) for batch in _batches()],
                                      lambda model, batch: module.loss(model(batch[0]), batch[0]),
                                      torch.optim.SGD(module.parameters(), lr=0.5))
    layout = {"pipeline_parallel": 2, "data_parallel": 2, "micro_batches": 4, "partition": "uniform"}
    results = run_distributed(_train_rank, 4, args=(layout, False), timeout_s=300)
    assert_traces_match(expected, merge_rank_traces([(losses, grads) for losses, grads, _ in results]))
    for _, _, trained in results:  # every copy stepped with the last stage's gradients
        for name, value in _outside(module).items():
            torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _clipped_reference(clip: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: losses and the outside parameters after training with the total norm clipped to ``clip``."""
    module = _HeadOutside()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    losses = []
    for batch in _batches():
        optimizer.zero_grad()
        loss = module.loss(module.model(batch), batch)
        loss.backward()
        assert float(torch.nn.utils.clip_grad_norm_(module.parameters(), clip)) > clip  # the clipping acts
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, _outside(module)


@pytest.mark.distributed
def test_clipping_by_norm_counts_the_parameters_outside_the_pipelined_network_once():
    """Every pipeline rank holds the same copy of them: the total norm counts it once, as one process does."""
    losses, trained = _clipped_reference(CLIP)
    results = run_distributed(_train_rank, 2, args=({"pipeline_parallel": 2, "micro_batches": 2}, True),
                              timeout_s=180)
    for rank_losses, _, rank_trained in results:
        assert rank_losses == pytest.approx(losses, rel=1e-5)
        for name, value in trained.items():
            torch.testing.assert_close(rank_trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
