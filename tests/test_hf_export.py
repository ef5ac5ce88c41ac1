"""``merak-export`` of Lightning checkpoint files (single process): round trip, adapters, refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from lightning_merak.hf import export_checkpoint, model_record
from lightning_merak.modules.causal_lm import CausalLMModule

VOCAB = 96
LLAMA = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=True)


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _lightning_checkpoint(model: torch.nn.Module, path: Path, record: bool = True) -> Path:
    """What Lightning writes for a DDP run: the module's state under ``model.``, plus the model record."""
    checkpoint = {"state_dict": CausalLMModule(model).state_dict()}
    if record:
        checkpoint["hf_model"] = model_record(model)
    torch.save(checkpoint, path)
    return path


def test_lightning_checkpoint_round_trip_is_bit_exact(tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LLAMA).save_pretrained(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", dtype=torch.float32)
    checkpoint = _lightning_checkpoint(model, tmp_path / "ddp.ckpt", record=False)
    with pytest.raises(ValueError, match="records no transformers config.*--config DIR"):
        export_checkpoint(checkpoint, tmp_path / "out")
    report = export_checkpoint(checkpoint, tmp_path / "out", config=tmp_path / "source", max_shard_size="30KB")
    original, exported = _stored(tmp_path / "source"), _stored(tmp_path / "out")
    assert sorted(exported) == sorted(original) and "lm_head.weight" not in exported  # tied: left out
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())
    assert report.largest_shard_bytes <= 30_000 < report.total_size
    index = (tmp_path / "out" / "model.safetensors.index.json").read_text()
    assert f'"total_size": {report.total_size}' in index
    export_checkpoint(checkpoint, tmp_path / "bf16", config=tmp_path / "source", dtype="bfloat16")
    assert all(tensor.dtype == torch.bfloat16 for tensor in _stored(tmp_path / "bf16").values())
    AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert AutoConfig.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


def test_the_exported_config_names_the_dtype_the_weights_were_trained_in(tmp_path):
    """A precision=64 run's checkpoint holds float64 weights; its config said float32."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LLAMA, dtype=torch.float32)
    model.config.dtype = torch.float32
    checkpoint = _lightning_checkpoint(model.double(), tmp_path / "fp64.ckpt")
    export_checkpoint(checkpoint, tmp_path / "out")
    assert {tensor.dtype for tensor in _stored(tmp_path / "out").values()} == {torch.float64}
    assert AutoConfig.from_pretrained(tmp_path / "out").dtype == torch.float64


def _adapted(kind: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    from lightning_merak.adapters import QBaRAConfig

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(LLAMA)
    config = (LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if kind == "lora"
              else QBaRAConfig(r=4, alpha=8.0, target_modules=["q_proj", "down_proj"]))
    model = get_peft_model(base, config)
    with torch.no_grad():  # trained adapters: both factors non-zero
        for name, param in model.named_parameters():
            if "lora_" in name or "qbara_" in name:
                param.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("kind", ["lora", "qbara"])
def test_adapters_export_merged_on_request(tmp_path, kind):
    model = _adapted(kind)
    checkpoint = _lightning_checkpoint(model, tmp_path / "adapted.ckpt")
    with pytest.raises(ValueError, match="adapter weights.*--merge-adapters"):
        export_checkpoint(checkpoint, tmp_path / "out")
    export_checkpoint(checkpoint, tmp_path / "out", merge_adapters=True)
    merged = model.merge_and_unload()
    exported = _stored(tmp_path / "out")
    for name, tensor in merged.state_dict().items():
        if name != "lm_head.weight":
            torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-6, msg=name)
    ids = torch.randint(VOCAB, (2, 8))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(reloaded(ids).logits, merged.eval()(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.distributed  # starts an interpreter
def test_help_imports_no_torch():
    code = ("import sys\nfrom lightning_merak.cli.export import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert result.returncode == 0, result.stderr
    assert "--merge-adapters" in result.stdout
