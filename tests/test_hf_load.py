"""Pretrained Hugging Face checkpoints into a model's tensors (single process)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

from lightning_merak.hf import load_pretrained, pretrained_causal_lm
from lightning_merak.modules.config import ModelConfig

VOCAB = 96
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": VOCAB, "max_position_embeddings": 64}
FAMILIES = {
    "llama-tied": LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=True),
    "llama-untied": LlamaConfig(**SMALL, num_key_value_heads=4, tie_word_embeddings=False),
    "qwen2-biases": Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=False),
    "mistral-gqa": MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=None),
    "gpt2-conv1d-tied": GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                   bos_token_id=0, eos_token_id=0),
    "phi3-fused": Phi3Config(**SMALL, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}


def _save(config, directory: Path, seed: int = 0, **kwargs) -> Path:
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, **kwargs)
    return directory


def _fresh(config, seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_logits_equal_from_pretrained(tmp_path, family):
    """Parameters and persistent buffers filled in place; rotary buffers (non-persistent) left alone."""
    config = FAMILIES[family]
    directory = _save(config, tmp_path, max_shard_size="20KB" if family == "llama-untied" else "2GB")
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model = _fresh(config)
    report = load_pretrained({**dict(model.named_parameters()), **dict(model.named_buffers())}, directory)
    assert report.bytes_read > 0
    assert all("inv_freq" in name for name in report.left_alone)
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=0, atol=1e-5)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_tied_head_on_another_stage_reads_the_embedding(tmp_path):
    """Under pipeline parallelism the tied LM head is a separate tensor on the last stage: the file has
    no lm_head.weight, so it is read from the embedding's entry."""
    config = FAMILIES["llama-tied"]
    directory = _save(config, tmp_path)
    head = torch.zeros(VOCAB, 32)
    load_pretrained({"lm_head.weight": head}, directory)
    assert torch.equal(head, load_file(directory / "model.safetensors")["model.embed_tokens.weight"])


def test_lightning_and_peft_names_and_dtype_conversion(tmp_path):
    config = FAMILIES["qwen2-biases"]
    directory = _save(config, tmp_path)
    stored = load_file(directory / "model.safetensors")
    weight = torch.zeros(32, 32, dtype=torch.bfloat16)
    load_pretrained({"model.model.layers.0.self_attn.q_proj.weight": weight}, directory)
    assert torch.equal(weight, stored["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16))
    base, adapter = torch.zeros(32, 32), torch.full((4, 32), 7.0)
    report = load_pretrained({"base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight": base,
                              "base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight": adapter},
                             directory)
    assert torch.equal(base, stored["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(adapter, torch.full((4, 32), 7.0)) and len(report.left_alone) == 1


@dataclass(frozen=True)
class _RowsAndTranspose:
    """A layout change as the tensor-parallel split records one: rows regrouped (some held twice), maybe transposed."""

    rows: tuple[int, ...]
    transposed: bool = False

    def from_original(self, full: torch.Tensor) -> torch.Tensor:
        full = full.t() if self.transposed and full.ndim == 2 else full
        return full[torch.tensor(self.rows)]

    def to_original(self, full: torch.Tensor) -> torch.Tensor:
        first = {row: index for index, row in reversed(list(enumerate(self.rows)))}
        full = full[torch.tensor([first[row] for row in sorted(first)], device="cpu").to(full.device)]
        return full.t() if self.transposed and full.ndim == 2 else full


def test_layout_changed_tensors_read_the_rows_they_need(tmp_path):
    """GPT-2's fused c_attn (Conv1D, stored transposed) regrouped per rank with one row held twice."""
    directory = _save(FAMILIES["gpt2-conv1d-tied"], tmp_path)
    stored = load_file(directory / "model.safetensors")["transformer.h.0.attn.c_attn.weight"]  # (32, 96)
    rank_rows = [tuple(range(part * 32 + rank * 16, part * 32 + rank * 16 + 16)) for rank in range(2)
                 for part in range(3)]
    rows = sum(rank_rows[:3], ()) + (64,) + sum(rank_rows[3:], ()) + (80,)  # each rank also holds a v row
    change = _RowsAndTranspose(rows, transposed=True)
    target = torch.zeros(len(rows), 32)
    load_pretrained({"transformer.h.0.attn.c_attn.weight": target}, directory,
                    {"transformer.h.0.attn.c_attn.weight": change})
    assert torch.equal(target, change.from_original(stored))
    bias = torch.zeros(len(rows))
    load_pretrained({"transformer.h.0.attn.c_attn.bias": bias}, directory,
                    {"transformer.h.0.attn.c_attn.bias": _RowsAndTranspose(rows)})
    assert torch.equal(bias, load_file(directory / "model.safetensors")["transformer.h.0.attn.c_attn.bias"][
        torch.tensor(rows)])


def test_padded_vocabulary_rows_are_zero(tmp_path):
    directory = _save(FAMILIES["llama-untied"], tmp_path)
    head = torch.full((VOCAB + 2, 32), 3.0)
    load_pretrained({"lm_head.weight": head}, directory)
    assert torch.equal(head[:VOCAB], load_file(directory / "model.safetensors")["lm_head.weight"])
    assert not head[VOCAB:].any()


def test_mismatches_are_refused_before_any_read(tmp_path):
    config = FAMILIES["llama-untied"]
    directory = _save(config, tmp_path / "model")
    model = _fresh(config)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    wrong = {**dict(model.named_parameters()), "model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 16)}
    with pytest.raises(ValueError, match=r"q_proj.weight: file \(32, 32\), model \(32, 16\)"):
        load_pretrained(wrong, directory)
    with pytest.raises(ValueError, match="has no tensors named.*not_a_weight"):
        load_pretrained({**dict(model.named_parameters()), "not_a_weight": torch.zeros(1)}, directory)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    tensors = load_file(directory / "model.safetensors")
    tensors["model.extra.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]; unexpected \['model.extra.weight'\]"):
        load_pretrained(dict(model.named_parameters()), directory)


def test_a_family_transformers_converts_is_refused_by_name(tmp_path):
    from transformers import MixtralConfig

    config = MixtralConfig(**{**SMALL, "num_hidden_layers": 1}, num_key_value_heads=2, num_local_experts=2)
    directory = _save(config, tmp_path)
    with pytest.raises(NotImplementedError, match="model type 'mixtral'"):
        load_pretrained(dict(_fresh(config).named_parameters()), directory)


def test_model_path_option_and_ddp_load(tmp_path):
    directory = _save(FAMILIES["mistral-gqa"], tmp_path)
    option = ModelConfig(name="hf", path=str(directory))
    assert option.model_type == "mistral"
    with pytest.raises(ValueError, match="model.model_type='llama' but"):
        ModelConfig(name="hf", model_type="llama", path=str(directory))
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig(name="hf", path=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=f"embeds {VOCAB}.*data.vocab_size<={VOCAB}"):
        pretrained_causal_lm(directory, data_vocab_size=VOCAB + 1)
    with torch.device("meta"):  # merak3d: the structure only; ranks load their shards
        assert pretrained_causal_lm(directory, VOCAB, weights=False).lm_head.weight.is_meta
    model = pretrained_causal_lm(directory, data_vocab_size=VOCAB).eval()
    assert json.loads((directory / "config.json").read_text())["model_type"] == model.config.model_type
    torch.testing.assert_close(_logits(model), _logits(AutoModelForCausalLM.from_pretrained(directory).eval()))


def test_model_hf_path_composes_with_hydra(tmp_path):
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from lightning_merak.cli.config import register_configs

    directory = _save(FAMILIES["llama-untied"], tmp_path)
    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        config = OmegaConf.to_object(compose(config_name="config", overrides=[
            "model=hf", f"model.path={directory}", "output_dir=/tmp/unused"]))
        assert config.model.model_type == "llama" and config.model.path == str(directory)
        with pytest.raises(ValueError, match="model.model_type is required"):
            OmegaConf.to_object(compose(config_name="config", overrides=["model=hf", "output_dir=/tmp/unused"]))
