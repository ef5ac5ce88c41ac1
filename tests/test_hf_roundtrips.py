"""Pretrained directories that do not hold the model their ``config.json`` builds: ``merak-train model=hf
model.path=DIR`` refuses them before launch, under merak3d (whose ranks would read them only after launch) and under
DDP (whose ``from_pretrained`` would initialise what is missing at random and train it, with a logged warning).

Each refusal runs merak-train's command line in this process with ``Trainer.fit`` replaced by a failure
(:func:`tests.test_train.refused`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from .test_train import refused

VOCAB = 64
SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 64, "head_dim": 8}
LAYOUTS = {"merak3d-pp2": ["strategy.pipeline_parallel=2"], "ddp": ["strategy=ddp", "trainer.devices=1"]}


def _save(directory: Path, model_type: str, max_shard_size: str = "5GB", **values: object) -> Path:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SIZES, **values})
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def _refusal(directory: Path, layout: str, tmp_path: Path, monkeypatch, capsys) -> str:
    overrides = ["model=hf", f"model.path={directory}", f"data.vocab_size={VOCAB}", "data.seq_len=16",
                 "data.batch_size=4", "data.num_sequences=64", *LAYOUTS[layout]]
    code, output = refused(overrides, tmp_path / "run", monkeypatch, capsys)
    assert code == 2, output.out + output.err
    assert "Traceback" not in output.err
    return output.err


@pytest.mark.parametrize("layout", LAYOUTS)
def test_weights_of_another_architecture_are_refused_before_launch(tmp_path, monkeypatch, capsys, layout):
    """Qwen3's weights (with q_norm and k_norm) under a Llama config.json of the same sizes."""
    directory = _save(tmp_path / "model", "qwen3", tie_word_embeddings=True)
    llama = AutoConfig.for_model("llama", **SIZES, tie_word_embeddings=True)
    (directory / "config.json").write_text(json.dumps({**llama.to_dict(), "model_type": "llama"}))
    error = _refusal(directory, layout, tmp_path, monkeypatch, capsys)
    assert f"merak-train: error: model.path={directory}" in error
    assert "model.layers.0.self_attn.q_norm.weight" in error and "LlamaForCausalLM" in error


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_tensor_missing_from_the_weights_is_refused_before_launch(tmp_path, monkeypatch, capsys, layout):
    directory = _save(tmp_path / "model", "olmo2", tie_word_embeddings=False)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    error = _refusal(directory, layout, tmp_path, monkeypatch, capsys)
    assert f"merak-train: error: model.path={directory}" in error
    assert "missing" in error and "model.layers.1.mlp.down_proj.weight" in error


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_shard_missing_from_a_sharded_checkpoint_is_refused_naming_it(tmp_path, monkeypatch, capsys, layout):
    directory = _save(tmp_path / "model", "phi3", max_shard_size="20KB", pad_token_id=0, tie_word_embeddings=False)
    shards = sorted(directory.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    error = _refusal(directory, layout, tmp_path, monkeypatch, capsys)
    assert f"merak-train: error: model.path={directory}" in error
    assert shards[1].name in error and "model.safetensors.index.json" in error


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_weights_file_that_is_no_safetensors_file_is_refused_naming_it(tmp_path, monkeypatch, capsys, layout):
    directory = _save(tmp_path / "model", "qwen3", tie_word_embeddings=True)
    (directory / "model.safetensors").write_bytes(b"")  # a download cut short
    error = _refusal(directory, layout, tmp_path, monkeypatch, capsys)
    assert f"{directory / 'model.safetensors'} is not a readable safetensors file" in error


def test_weights_of_other_sizes_are_refused_before_launch(tmp_path, monkeypatch, capsys):
    """A config.json whose intermediate_size is not the weights': refused before the ranks start, naming a tensor."""
    directory = _save(tmp_path / "model", "qwen3", tie_word_embeddings=True)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    error = _refusal(directory, "merak3d-pp2", tmp_path, monkeypatch, capsys)
    assert "model.layers.0.mlp.gate_proj.weight: file (64, 32), model (48, 32)" in error
