"""Adapter settings that do not split at ``tensor_parallel>1`` are refused before any rank starts, all problems at once.

The check reads the meta adapter model ``merak-train`` builds before launch: each block's column and row layers
(:func:`~lightning_merak.adapters.tp_shards.block_split_layers`), checked per shard for double quantisation, the
quantisation block or INT4 group and the pooled groups
(:func:`~lightning_merak.adapters.tp_shards.adapter_shard_problems`, which the ranks' own check calls too).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_merak.adapters.meta import DeferredQuantization, attach_on_meta
from lightning_merak.adapters.quantize import shard_quantization_problem
from lightning_merak.adapters.tp_shards import block_split_layers
from lightning_merak.cli.checks import check_adapter_shards
from lightning_merak.cli.options.adapter import LoRAAdapterConfig, QAHiRAAdapterConfig, QBaRAAdapterConfig, Quantization
from lightning_merak.cli.overrides import ConfigError
from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.pipeline.recording import find_trunk

REPOSITORY = Path(__file__).resolve().parents[1]
LLAMA_TINY = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "tie_word_embeddings": False}
"""``model=llama_tiny``'s widths (two blocks: the check names each layer once, not once a block)."""
DOUBLE_QUANT = "set adapter.double_quant=false"
DOWN_320 = "splits mlp.down_proj's 320 input columns into 160, not a multiple of"


def _meta_adapter_model(option: object, **config: int) -> nn.Module:
    """The adapter model ``merak-train`` builds under merak3d before launch: the base on meta, the adapter attached."""
    with torch.device("meta"):
        base = build_causal_lm(ModelConfig(name="llama", model_type="llama", config={**LLAMA_TINY, **config}),
                               vocab_size=64)
    return attach_on_meta(option, base)


def _check(option: object, tensor_parallel: int = 2, **config: int) -> None:
    """``check_adapter_shards`` as ``merak-train`` calls it, at fixed degrees (data_parallel=1)."""
    strategy = SimpleNamespace(strategy_name="merak3d", needs_planning=False,
                               resolve_layout=lambda world_size: (1, 1, tensor_parallel))
    check_adapter_shards(strategy, SimpleNamespace(model=_meta_adapter_model(option, **config)), tensor_parallel)


def _refusal(option: object, tensor_parallel: int = 2, **config: int) -> str:
    with pytest.raises(ConfigError) as refused:
        _check(option, tensor_parallel, **config)
    return str(refused.value)


@pytest.mark.parametrize("quantization", [Quantization.nf4, Quantization.fp4])
def test_double_quantisation_and_a_row_shard_below_the_block_are_named_together(quantization):
    message = _refusal(QBaRAAdapterConfig(quantization=quantization), intermediate_size=320)
    assert message.startswith("2 problems"), message
    assert DOUBLE_QUANT in message and f"{DOWN_320} {quantization.value}'s block of 64" in message, message
    assert message.count("mlp.down_proj") == 1, message  # once, not once per block


def test_every_layer_kind_below_the_block_is_named():
    """hidden_size=96: every column layer's rows run on into the next (96 inputs), o_proj's shard holds 48 inputs."""
    message = _refusal(QBaRAAdapterConfig(double_quant=False), hidden_size=96, intermediate_size=256)
    for layer in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert f"splits {layer} by its output rows, whose 96 inputs are not a multiple of nf4's block" in message
    assert "splits self_attn.o_proj's 96 input columns into 48" in message, message
    assert DOUBLE_QUANT not in message and "mlp.down_proj" not in message, message  # 256 -> 128: whole blocks


def test_int4_groups_and_pooling_across_shards_are_named_with_their_fixes():
    message = _refusal(QBaRAAdapterConfig(quantization=Quantization.int4, group_size=128, lambda_in=128))
    assert message.startswith("4 problems"), message
    assert "self_attn.o_proj's 128 input columns into 64, not a multiple of int4's group_size=128" in message
    assert "use tensor_parallel=1 or an adapter.group_size dividing 64" in message, message
    assert "Q-BaRA: mlp.down_proj: the inputs of 384 over tensor_parallel=2 (192 a rank)" in message, message
    assert "set adapter.lambda_in to a divisor of 192" in message, message


def test_int8_pooling_across_row_shards_is_refused():
    """LLM.int8 always splits exactly; the pooled groups of the row layers do not."""
    message = _refusal(QBaRAAdapterConfig(quantization=Quantization.int8, lambda_in=128))
    assert message.startswith("2 problems") and "int8" not in message, message
    assert "Q-BaRA: self_attn.o_proj: the inputs of 128" in message and "(64 a rank)" in message, message


@pytest.mark.parametrize("quantization", [Quantization.int4, Quantization.none])
def test_qahira_group_size_the_shard_width_does_not_divide_is_refused(quantization):
    message = _refusal(QAHiRAAdapterConfig(quantization=quantization, group_size=128))
    pooled = "QA-HiRA: self_attn.o_proj: the inputs of 128 over tensor_parallel=2 (64 a rank) do not split into " \
             "whole groups of lambda_in=128; set adapter.lambda_in to a divisor of 64 (adapter.lambda_in follows " \
             "adapter.group_size unless set)"
    assert pooled in message and "QA-HiRA: mlp.down_proj" in message, message
    assert ("int4's group_size=128" in message) == (quantization is Quantization.int4), message


def test_lambda_out_across_column_shards_is_refused():
    message = _refusal(QAHiRAAdapterConfig(lambda_out=64, lambda_in=32), tensor_parallel=4)
    assert "QA-HiRA: self_attn.q_proj: the outputs of 128 over tensor_parallel=4 (32 a rank)" in message, message
    assert "set adapter.lambda_out to a divisor of 32" in message, message


@pytest.mark.parametrize("option", [
    QBaRAAdapterConfig(double_quant=False), QBaRAAdapterConfig(quantization=Quantization.fp4, double_quant=False),
    QBaRAAdapterConfig(quantization=Quantization.int4), QBaRAAdapterConfig(quantization=Quantization.int8),
    QAHiRAAdapterConfig(), QAHiRAAdapterConfig(group_size=64), LoRAAdapterConfig(double_quant=False),
    LoRAAdapterConfig(quantization=Quantization.int8),
], ids=["qbara-nf4", "qbara-fp4", "qbara-int4", "qbara-int8", "qahira", "qahira-g64", "lora-nf4", "lora-int8"])
def test_the_guides_settings_are_accepted_at_tp2(option):
    _check(option)


def test_any_setting_is_accepted_at_tp1():
    _check(QBaRAAdapterConfig(quantization=Quantization.int4, group_size=128, lambda_in=128), tensor_parallel=1)


def test_the_blocks_layers_take_the_roles_of_the_traced_split():
    model = _meta_adapter_model(QBaRAAdapterConfig(double_quant=False))
    layers = block_split_layers(find_trunk(model)[1][0], 128)
    assert [(layer.name, layer.column) for layer in layers] == [
        ("self_attn.q_proj", True), ("self_attn.k_proj", True), ("self_attn.v_proj", True),
        ("self_attn.o_proj", False), ("mlp.gate_proj", True), ("mlp.up_proj", True), ("mlp.down_proj", False)]
    assert {(layer.method, layer.lambda_in, layer.lambda_out) for layer in layers} == {("Q-BaRA", 2, 2)}


class _RowShard(nn.Module):
    """A row-parallel shard as the ranks' deferred quantisation sees it (``split_geometry``, ``quantize_shard``)."""

    def __init__(self, in_features: int, out_features: int, tensor_parallel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features // tensor_parallel))
        self.geometry = (False, in_features, out_features, tensor_parallel, True)

    def split_geometry(self) -> tuple[bool, int, int, int, bool]:
        return self.geometry

    def quantize_shard(self, quantize: object) -> None:
        raise AssertionError("quantised a shard whose blocks cross it")


def test_the_ranks_check_names_every_problem_too():
    """The ranks' check of their split layers (Python API users reach only it) names every problem, each layer once."""
    both = shard_quantization_problem("nf4", "mlp.down_proj", 320, 128, 2, column=False, double_quant=True)
    assert DOUBLE_QUANT in both and DOWN_320 in both
    part = nn.ModuleDict({"layers": nn.ModuleList(nn.ModuleDict({"mlp": nn.ModuleDict(
        {"down_proj": nn.ModuleDict({"base_layer": _RowShard(320, 128, 2)})})}) for _ in range(2))})
    with pytest.raises(ValueError) as refused:
        DeferredQuantization("nf4", double_quant=True)(part)
    message = str(refused.value)
    assert message.startswith("2 problems") and DOUBLE_QUANT in message and DOWN_320 in message, message


@pytest.mark.distributed
def test_merak_train_refuses_before_any_rank_starts(tmp_path):
    """As a process, at two ranks: status 2, every problem in the first line, and no rank began its work."""
    overrides = ["adapter=qbara", "strategy.tensor_parallel=2", "model.config.intermediate_size=320",
                 "trainer.max_steps=2", "data.num_sequences=64", f"hydra.run.dir={tmp_path}"]
    result = subprocess.run([sys.executable, "-m", "lightning_merak.cli.train", *overrides], capture_output=True,
                            text=True, timeout=120, cwd=REPOSITORY, env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
    assert result.returncode == 2, result.stderr[-3000:]
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("merak-train: error:")]
    assert error.startswith("merak-train: error: 2 problems") and DOUBLE_QUANT in error and DOWN_320 in error
    output = result.stdout + result.stderr
    for started in ("Initializing distributed", "LOCAL_RANK", "local rank", "Traceback", "GPU available"):
        assert started not in output, output[-3000:]
