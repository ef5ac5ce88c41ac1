"""A user's own LightningModule and LightningDataModule, as ``merak-train module._target_=... data._target_=...``
makes them (tests/test_cli_open.py). Importable by every rank: the ranks run from the repository root.

The module is not the project's CausalLMModule: an ordinary LightningModule whose ``training_step`` calls a
transformers model with ``labels``, from which merak3d infers the loss at ``pipeline_parallel=2``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class UserLanguageModel(pl.LightningModule):
    """A tiny Llama trained with plain SGD: next-token cross-entropy on blocks of token ids."""

    def __init__(self, vocab_size: int, hidden_size: int = 32, layers: int = 2, learning_rate: float = 0.05) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, LlamaConfig

        self.save_hyperparameters()
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                             tie_word_embeddings=False, use_cache=False)
        self.model = AutoModelForCausalLM.from_config(config)
        self.learning_rate = learning_rate

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        loss = self.model(input_ids=input_ids, labels=input_ids).loss
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.learning_rate)


class InlineLossLanguageModel(UserLanguageModel):
    """The same model, its loss computed in ``training_step`` from the logits (merak3d reads it from the step)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        logits = self.model(input_ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1))
        self.log("train/loss", loss, sync_dist=True)
        return loss


class UserTokenData(pl.LightningDataModule):
    """Random token ids from a seeded generator; ``vocab_size`` is what a built-in model would size itself by."""

    def __init__(self, vocab_size: int = 64, seq_len: int = 16, batch_size: int = 4, samples: int = 64) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.samples = samples

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, self.vocab_size, (self.samples, self.seq_len),
                               generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens), batch_size=self.batch_size)


class NotAModule:
    """Refused as ``module._target_``: not a LightningModule."""


class BareModule(pl.LightningModule):
    """A module that is its own network (its layers are its children, its ``forward`` calls them): refused at
    ``pipeline_parallel=2``, which splits a network the module holds as an attribute."""

    def __init__(self, vocab_size: int = 64, hidden_size: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, hidden_size)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden_size, hidden_size) for _ in range(layers))
        self.head = torch.nn.Linear(hidden_size, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = torch.relu(block(hidden))
        return self.head(hidden)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        logits = self(input_ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)
