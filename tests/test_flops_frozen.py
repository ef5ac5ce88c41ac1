"""Frozen weights in the FLOP count behind MFU: a LoRA model's frozen base skips its weight gradients in
TrainingMetrics and ModelSummary; a config the count cannot read gives the reason."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_merak.callbacks import ModelSummary, TrainingMetrics
from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.planning.flops import frozen_weight_fraction, training_flops_per_token, transformer_shape

SEQ = 16


def _llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                        tie_word_embeddings=tie))


def _lora(model: LlamaForCausalLM) -> torch.nn.Module:
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))


def test_a_lora_models_base_is_wholly_frozen_and_its_adapters_are_not_counted():
    assert frozen_weight_fraction(_llama()) == 0.0
    assert frozen_weight_fraction(_lora(_llama())) == 1.0


def test_frozen_layers_count_by_their_share_of_the_matmul_weights():
    model = _llama(tie=True)  # the LM head is the embedding: counted once, as a matmul weight
    model.model.layers[0].requires_grad_(False)
    layer = sum(p.numel() for p in model.model.layers[0].parameters() if p.dim() == 2)
    matmuls = 2 * layer + model.lm_head.weight.numel()
    assert frozen_weight_fraction(model) == pytest.approx(layer / matmuls)


def _trainer(callback: pl.Callback) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", max_steps=1, callbacks=[callback], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)


def _data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randint(64, (2, SEQ))), batch_size=2)


def test_training_metrics_and_the_summary_count_a_lora_models_base_without_weight_gradients():
    shape = transformer_shape(_llama().config)
    expected = 3 * shape.attention_flops_per_token(SEQ) + 2 * shape.weight_flops_per_token()
    assert expected == training_flops_per_token(shape, SEQ, frozen_weight_fraction=1.0)
    metrics, summary = TrainingMetrics(), ModelSummary(seq_len=SEQ)
    _trainer(metrics).fit(CausalLMModule(_lora(_llama())), _data())
    _trainer(summary).fit(CausalLMModule(_lora(_llama())), _data())
    assert metrics._flops_at(SEQ) == expected
    assert summary._flops_line.split()[:-7] == get_human_readable_count(int(expected)).split()


def test_a_config_missing_a_key_gives_its_reason_in_both_callbacks():
    model = _llama()
    del model.config.intermediate_size
    with pytest.warns(UserWarning, match=r"no MFU: .*model_type='llama'.*'intermediate_size'"):
        _trainer(TrainingMetrics()).fit(CausalLMModule(model), _data())
    with pytest.warns(UserWarning, match=r"no training FLOPs per token: .*'intermediate_size'"):
        _trainer(ModelSummary(seq_len=SEQ)).fit(CausalLMModule(model), _data())
