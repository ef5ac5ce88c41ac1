"""Users' own networks trained by merak3d on two ranks equal one process: transformers heads other than causal LMs
scored with their own loss at ``pipeline_parallel=2``, a vision model whose batches ``split_batch`` reads and whose
step calls it by keyword, and a planned layout for blocks tensor parallelism cannot split."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from transformers import BertForMaskedLM, BertForSequenceClassification, BertForTokenClassification

from lightning_merak.strategies import Merak3DStrategy
from lightning_merak.testing import run_distributed
from tests.test_any_module_planner import SEQ, VOCAB, _bert, _Regressor, _vit

pytestmark = pytest.mark.distributed

STEPS, BATCH = 3, 8


class _Sequence(pl.LightningModule):
    """A transformers classifier scored by its own loss: the network called with ``labels``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _bert(BertForSequenceClassification, num_labels=3).train()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.net(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _Token(_Sequence):
    def __init__(self) -> None:
        super().__init__()
        self.net = _bert(BertForTokenClassification, num_labels=3).train()


class _Masked(_Sequence):
    """A masked LM: its decoder's weight is tied to the embedding (first and last stage), its bias to the head's
    (both on the last stage: one parameter there, no tie across stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _bert(BertForMaskedLM).train()


class _Image(_Sequence):
    """A vision model: batches read by ``split_batch``, the network called by keyword, the loss inline."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _vit().train()

    def split_batch(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["pixel_values"], batch["labels"]

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self.net(pixel_values=batch["pixel_values"]).logits, batch["labels"])
        self.log("train_loss", loss)
        return loss


class _Regression(_Sequence):
    """A hand-written network of blocks with one linear layer each, which tensor parallelism cannot split."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net: nn.Module = _Regressor()

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        features, targets = batch
        loss = F.mse_loss(self.net(features), targets)
        self.log("train_loss", loss)
        return loss


def _samples(kind: str) -> list:
    generator = torch.Generator().manual_seed(5)
    count = STEPS * BATCH
    if kind == "image":
        pixels = torch.randn(count, 3, 8, 8, generator=generator)
        labels = torch.randint(3, (count,), generator=generator)
        return [{"pixel_values": pixels[i], "labels": labels[i]} for i in range(count)]
    if kind == "regression":
        features = torch.randn(count, 4, generator=generator)
        return [(features[i], features[i, :1] * 2 - features[i, 1:2]) for i in range(count)]
    ids = torch.randint(VOCAB, (count, SEQ), generator=generator)
    if kind == "sequence":
        labels = torch.randint(3, (count,), generator=generator)
    elif kind == "masked":
        labels = torch.where(torch.rand(count, SEQ, generator=generator) < 0.5, ids, -100)
    else:  # per-token labels, some ignored, and every first micro-batch's rows ignored whole (it scores nothing)
        labels = torch.randint(3, (count, SEQ), generator=generator)
        labels[torch.rand(count, SEQ, generator=generator) < 0.4] = -100
        labels.view(STEPS, BATCH, SEQ)[:, :BATCH // 2] = -100
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(count)]


MODULES = {"sequence": _Sequence, "token": _Token, "masked": _Masked, "image": _Image, "regression": _Regression}


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _fit(rank: int, world_size: int, kind: str, layout: dict | None) -> list[float]:
    """``MODULES[kind]``'s per-step losses, every rank reading the whole batch (one process where ``layout`` is
    None)."""
    torch.manual_seed(0)
    module = MODULES[kind]()
    recorder = _Losses()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        use_distributed_sampler=False, callbacks=[recorder],
        **({} if layout is None else {"strategy": Merak3DStrategy(**layout, timeout_s=120)}))
    trainer.fit(module, DataLoader(_samples(kind), batch_size=BATCH, shuffle=False))
    return recorder.losses


@pytest.mark.parametrize("kind, layout", [
    ("sequence", {"pipeline_parallel": 2, "micro_batches": 2}),
    ("token", {"pipeline_parallel": 2, "micro_batches": 2}),
    ("masked", {"pipeline_parallel": 2, "micro_batches": 2}),
    ("image", {"pipeline_parallel": 2, "micro_batches": 2}),
    ("regression", {"pipeline_parallel": "auto", "data_parallel": 1, "micro_batches": 2}),
])
def test_pipelined_user_network_trains_as_one_process(kind: str, layout: dict):
    reference = _fit(0, 1, kind, None)
    assert len(reference) == STEPS
    for losses in run_distributed(_fit, 2, args=(kind, layout), timeout_s=180):
        assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6)
