"""TrainingMetrics' ``train/grad_norm`` under Lightning's DDP with EmbRace, whose ranks each hold other columns of
the embedding tables: the norm counts every rank's columns once, as one process training the global batch sees it
(and as EmbRace's clipping, active here, computes it)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_merak.callbacks import SparseCommunication, TrainingMetrics
from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.testing import NormBeforeClipping, run_distributed
from lightning_merak.testing.causal_lm import FixedOptimizerModule

VOCAB, SEQ, BATCH, STEPS, RANKS, CLIP = 512, 16, 4, 3, 2, 0.5
MODEL = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False})



def _module() -> FixedOptimizerModule:
    torch.manual_seed(0)
    model = build_causal_lm(MODEL, vocab_size=VOCAB)
    model.config.use_cache = False
    return FixedOptimizerModule(model, "sgd", lr=0.5)


def _data() -> TensorDataset:
    return TensorDataset(torch.randint(VOCAB, (STEPS * BATCH * RANKS, SEQ), generator=torch.Generator().manual_seed(1)))


def _trainer(callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", max_steps=STEPS, log_every_n_steps=1, gradient_clip_val=CLIP,
                      callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


def _embrace_ddp(rank: int, world_size: int, log_root: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    trainer = _trainer([TrainingMetrics(), SparseCommunication("embrace", min_table_rows=256, bandwidth_gbit=10.0)],
                       devices=world_size, strategy=DDPStrategy(process_group_backend="gloo"),
                       logger=CSVLogger(log_root, name="", version=""), use_distributed_sampler=False)
    data = _data()
    trainer.fit(_module(), DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, world_size, rank,
                                                                                         shuffle=False)))


@pytest.mark.distributed
def test_embrace_under_ddp_logs_the_norm_of_the_whole_tables(tmp_path: Path) -> None:
    run_distributed(_embrace_ddp, RANKS, args=(str(tmp_path),), timeout_s=240)
    with open(tmp_path / "metrics.csv") as handle:
        logged = [float(row["train/grad_norm"]) for row in csv.DictReader(handle) if row.get("train/grad_norm")]

    reference = NormBeforeClipping()  # one process, the replicas' batches together, the tables whole
    _trainer([reference], devices=1, logger=False).fit(_module(), DataLoader(_data(), batch_size=BATCH * RANKS))
    assert len(logged) == STEPS and max(reference.norms) > CLIP  # the clipping acts, after the norm is taken
    assert logged == pytest.approx(reference.norms, rel=1e-4)
