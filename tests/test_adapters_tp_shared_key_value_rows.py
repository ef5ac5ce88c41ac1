"""A pooled adapter whose output groups would cross key/value rows several tensor-parallel ranks share, refused
before launch from the config (the split refuses it too, but only once the block's rows are probed, after launch)."""

from __future__ import annotations

import pytest
import torch

from lightning_merak.adapters.meta import attach_on_meta
from lightning_merak.cli.options.adapter import QAHiRAAdapterConfig, QBaRAAdapterConfig, Quantization
from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.tensor.adapters import check_adapter_split
from lightning_merak.strategies.merak3d import Merak3DStrategy

VOCAB = 96
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]


def _adapted(option, key_value_heads: int) -> torch.nn.Module:
    config = ModelConfig(name="qwen2", model_type="qwen2", config={
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": key_value_heads, "tie_word_embeddings": False})
    with torch.device("meta"):
        return attach_on_meta(option, build_causal_lm(config, vocab_size=VOCAB))


def test_lambda_out_over_key_value_heads_several_ranks_share_is_refused_before_launch():
    """One key/value head at tensor_parallel=2: both ranks hold k_proj's and v_proj's rows, which Q-BaRA's groups
    of lambda_out=2 would cross; refused by the strategy's model check, the split's message. Two heads, or
    lambda_out=1, split."""
    qbara = _adapted(QBaRAAdapterConfig(r=2, quantization=Quantization.none, target_modules=TARGETS), 1)
    expected = ("tensor_parallel=2: Q-BaRA: the ranks of the column layer model.layers.0.self_attn.k_proj hold "
                "reordered or shared rows (fused projections, shared key/value heads), which groups of lambda_out=2 "
                "would cross; use lambda_out=1 for it, or use tensor_parallel=1 (pipeline_parallel / data_parallel "
                "split adapter models)")
    with pytest.raises(ValueError) as refused:
        Merak3DStrategy(tensor_parallel=2)._arguments.check_model(qbara, 1, 2)
    assert str(refused.value) == expected
    check_adapter_split(_adapted(QBaRAAdapterConfig(r=2, quantization=Quantization.none, target_modules=TARGETS), 2),
                        2)
    check_adapter_split(_adapted(QAHiRAAdapterConfig(r=2, quantization=Quantization.none, group_size=32, lambda_in=32,
                                                     lambda_out=1, target_modules=TARGETS), 1), 2)
    check_adapter_split(qbara, 1)
