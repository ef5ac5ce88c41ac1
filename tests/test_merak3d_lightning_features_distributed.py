"""Lightning's own features under merak3d at tp=2, pp=2 and cp=2, against one process: a callback's change to the
optimizer before the first batch (lr 0: the weights stay), values logged in a replayed pipelined step (before the
network call; a max), a sum synced over the ranks and ``all_gather`` (each sample counted once, not once per tp, pp
or cp rank).
The pure parts: ``tests/test_merak3d_lightning_features.py``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed

pytestmark = pytest.mark.distributed

VOCAB, SEQUENCE, STEPS = 64, 8, 3
LLAMA = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False})
LAYOUTS = {"tp2": {"tensor_parallel": 2}, "pp2": {"pipeline_parallel": 2, "micro_batches": 2, "partition": "uniform"},
           "cp2": {"data_parallel": 1, "context_parallel": 2}}


class _Logging(pl.LightningModule):
    """Its loss from the logits in training_step (replayed per micro-batch at pp > 1), logging around the call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = build_causal_lm(LLAMA, vocab_size=VOCAB)
        self.model.config.use_cache = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        self.log("rows", float(ids.shape[0]))  # before the network call: the whole batch's
        logits = self.model(input_ids=ids).logits
        self.log("max_logit", logits.detach().max(), reduce_fx="max")
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        ids = batch[0]
        self.model(input_ids=ids)
        self.log("tokens", float(ids.numel()), reduce_fx="sum", sync_dist=True)
        self.log("gathered", float(self.all_gather(ids).numel() // SEQUENCE))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _FreezeAndRecord(pl.Callback):
    """Sets every learning rate to 0 before the first batch (the build follows); records what each step logged."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.steps.append({name: round(float(value), 5) for name, value in trainer.callback_metrics.items()})


def _ids(samples: int) -> TensorDataset:
    return TensorDataset(torch.randint(VOCAB, (samples, SEQUENCE), generator=torch.Generator().manual_seed(1)))


def _run(strategy: Any, devices: int) -> tuple[list[dict[str, float]], dict[str, float]]:
    record = _FreezeAndRecord()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                         callbacks=[record], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0,
                         use_distributed_sampler=False)
    module = _Logging()
    trainer.fit(module, DataLoader(_ids(4), batch_size=4))  # one batch an epoch, the same each step
    validated = trainer.validate(module, DataLoader(_ids(8), batch_size=4), verbose=False)[0]
    return record.steps, {name: round(value, 5) for name, value in validated.items()}


def _rank(rank: int, world_size: int, layout_name: str) -> tuple[list[dict[str, float]], dict[str, float]]:
    return _run(Merak3DStrategy(**LAYOUTS[layout_name], timeout_s=60), world_size)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_lightning_features_match_one_process(layout_name: str) -> None:
    expected_steps, expected_validated = _run("auto", 1)
    assert len({step["loss"] for step in expected_steps}) == 1  # lr 0: the weights stay
    for steps, validated in run_distributed(_rank, 2, args=(layout_name,), timeout_s=300):
        assert len(steps) == STEPS
        for step, expected in zip(steps, expected_steps):
            assert step == pytest.approx(expected, rel=1e-4)
        assert validated == pytest.approx(expected_validated, rel=1e-4)
