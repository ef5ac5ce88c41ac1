"""Sparse communication's promises to the rest of the run: every hook after the backward sees the S2 tables'
gradients dense, whatever the callbacks' order; ``TrainingMetrics`` takes the norm of a sparse gradient; EmbRace
refuses an embedding whose class changes the lookup (Gemma's ``embed_scale``), naming it and the alternative.

Single process: Lightning's DDP with one rank runs the S2 comm hook in this process."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

from lightning_merak.callbacks import SparseCommunication, TrainingMetrics
from lightning_merak.callbacks.sparse_comm.embrace import ShardedEmbedding, shard_embeddings

VOCAB, WIDTH, SEQ, BATCH, STEPS = 64, 8, 6, 4, 2


class _TinyLM(pl.LightningModule):
    """An embedding table and a next-token head, trained with SGD (which takes sparse gradients too)."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed
        self.head = nn.Linear(WIDTH, VOCAB)
        self.training_steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.training_steps += 1
        (ids,) = batch
        logits = self.head(self.embed(ids[:, :-1]))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _GradientsSeen(pl.Callback):
    """Before the optimizer, from a place ahead of the other callbacks: whether the table is looked up sparsely,
    its gradient's layout, and every gradient's total norm (sparse ones made dense, so the reference never depends
    on the code under test)."""

    def __init__(self) -> None:
        self.sparse_lookups: list[bool] = []
        self.table_sparse: list[bool] = []
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.sparse_lookups.append(pl_module.embed.sparse)
        self.table_sparse.append(pl_module.embed.weight.grad.is_sparse)
        grads = [p.grad.to_dense() for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))))


def _module(embed: nn.Embedding | None = None) -> _TinyLM:
    torch.manual_seed(0)
    return _TinyLM(embed if embed is not None else nn.Embedding(VOCAB, WIDTH))


def _batches() -> DataLoader:
    ids = torch.randint(VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(ids), batch_size=BATCH)


def _trainer(root: Path, callbacks: list[pl.Callback], strategy: str) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, log_every_n_steps=1,
                      logger=CSVLogger(root, name="", version=""), callbacks=callbacks, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)


def _logged_grad_norms(root: Path) -> list[float]:
    with open(root / "metrics.csv") as handle:
        return [float(row["train/grad_norm"]) for row in csv.DictReader(handle) if row.get("train/grad_norm")]


@pytest.fixture
def one_rank_ddp(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Lightning's DDP on this process alone; its process group is destroyed afterwards."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("method", ["s2", "auto"])
def test_hooks_ordered_before_s2_see_dense_table_gradients_and_metrics_log_their_norm(
        one_rank_ddp: None, tmp_path: Path, method: str) -> None:
    seen = _GradientsSeen()
    module = _module()
    comm = SparseCommunication(method, min_table_rows=VOCAB, bandwidth_gbit=1.0)
    _trainer(tmp_path, [seen, TrainingMetrics(), comm], "ddp").fit(module, _batches())
    assert seen.sparse_lookups == [True] * STEPS and not module.embed.sparse  # restored at teardown
    assert seen.table_sparse == [False] * STEPS
    assert _logged_grad_norms(tmp_path) == pytest.approx(seen.norms, rel=1e-5)


def test_training_metrics_takes_the_norm_of_a_sparse_gradient(tmp_path: Path) -> None:
    seen = _GradientsSeen()
    _trainer(tmp_path, [seen, TrainingMetrics()], "auto").fit(_module(nn.Embedding(VOCAB, WIDTH, sparse=True)),
                                                               _batches())
    assert seen.table_sparse == [True] * STEPS
    norms = _logged_grad_norms(tmp_path)
    assert norms == pytest.approx(seen.norms, rel=1e-5) and all(math.isfinite(n) and n > 0 for n in norms)


def _scaled_embedding() -> Gemma2TextScaledWordEmbedding:
    return Gemma2TextScaledWordEmbedding(VOCAB, WIDTH, padding_idx=0, embed_scale=WIDTH**0.5)


def test_embrace_refuses_a_scaled_embedding_at_setup_naming_it_and_s2(one_rank_ddp: None, tmp_path: Path) -> None:
    module = _module(_scaled_embedding())
    comm = SparseCommunication("embrace", min_table_rows=VOCAB, bandwidth_gbit=1.0)
    with pytest.raises(ValueError, match=r"cannot shard embed \(transformers\.models\.gemma2\.modeling_gemma2\."
                                         r"Gemma2TextScaledWordEmbedding\).*overrides nn\.Embedding\.forward"
                                         r".*method='s2' \(merak-train: comm=s2\)"):
        _trainer(tmp_path, [comm], "ddp").fit(module, _batches())
    assert module.training_steps == 0
    assert isinstance(module.embed, Gemma2TextScaledWordEmbedding) and not comm.sharded_tables


def test_embrace_shards_an_embedding_subclass_that_keeps_the_lookup(single_rank_group: dist.ProcessGroup) -> None:
    class NamedEmbedding(nn.Embedding):
        """A subclass adding nothing to the lookup."""

    module = _module(NamedEmbedding(VOCAB, WIDTH))
    sharded = shard_embeddings(module, ["embed"], single_rank_group)
    assert isinstance(module.embed, ShardedEmbedding) and sharded == {"embed": module.embed}
    with pytest.raises(ValueError, match=r"cannot shard the embedding \(.*Gemma2TextScaledWordEmbedding\)"):
        ShardedEmbedding.from_embedding(_scaled_embedding(), single_rank_group)
