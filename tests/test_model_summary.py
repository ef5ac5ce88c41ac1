"""ModelSummary: Lightning's table without its "0 Total Flops" line, and a language model's training FLOPs per token
at the run's sequence length in its place."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks import ModelSummary
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.planning.flops import training_flops_per_token, transformer_shape

MODEL = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2})
SUMMARY_LOG = "lightning.pytorch.callbacks.model_summary"


def _summary_lines(summary: ModelSummary, module: pl.LightningModule, caplog: pytest.LogCaptureFixture) -> list[str]:
    data = DataLoader(TensorDataset(torch.randint(64, (4, 16))), batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, callbacks=[summary], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, limit_val_batches=0)
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOG):
        trainer.fit(module, data)
    tables = [record.getMessage() for record in caplog.records if record.name == SUMMARY_LOG]
    assert len(tables) == 1, tables
    return tables[0].split("\n")


def test_a_language_model_gets_its_flops_per_token_instead_of_zero(caplog: pytest.LogCaptureFixture):
    torch.manual_seed(0)
    model = build_causal_lm(MODEL, vocab_size=64)
    lines = _summary_lines(ModelSummary(seq_len=16), CausalLMModule(model), caplog)
    expected = get_human_readable_count(int(training_flops_per_token(transformer_shape(model.config), 16)))
    assert not [line for line in lines if line.endswith("Total Flops")] and "FLOPs" not in lines[0]
    assert lines[-1].split() == [*expected.split(), "Training", "FLOPs", "per", "token", "at", "16", "tokens"]
    assert any(line.rstrip().endswith("Total params") for line in lines)


class _Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0].float()).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_model_without_a_countable_config_prints_no_flops_line(caplog: pytest.LogCaptureFixture):
    lines = _summary_lines(ModelSummary(seq_len=16), _Plain(), caplog)
    assert not [line for line in lines if "Flops" in line or "FLOPs per token" in line]
    assert lines[-1].rstrip().endswith("Modules in eval mode")


def test_a_sequence_length_below_one_is_refused():
    with pytest.raises(ValueError, match="seq_len must be at least 1"):
        ModelSummary(seq_len=0)
