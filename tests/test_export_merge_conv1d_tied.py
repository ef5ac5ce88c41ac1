"""``merak-export --merge-adapters`` of LoRA on GPT-2's ``Conv1D`` layers and on tied weights, and the refusal
of LoRA on a ``Conv1D`` at ``tensor_parallel>1``.

A ``Conv1D`` stores its weight ``(in, out)``: PEFT merges it with ``fan_in_fan_out``, so the export must merge on
a ``Conv1D`` too. An adapter on one of tied weights (``embed_tokens`` with ``tie_word_embeddings``) changes that
weight only in the trained model: the export writes its partner (``lm_head``) unmerged and the config untied.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, Lfm2Config, Qwen2Config

from lightning_merak.hf import export_checkpoint, model_record
from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.parallel.tensor.adapters import check_adapter_split

VOCAB = 128
GPT2 = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0)
QWEN2_TIED = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=True)


def _adapted(config: object, targets: list[str], rank: int = 4) -> torch.nn.Module:
    """A tiny model of ``config`` with LoRA on ``targets``, both factors non-zero (as after training)."""
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)
    return model.eval()


def _export_merged(model: torch.nn.Module, tmp_path: Path) -> Path:
    """The Lightning ``.ckpt`` a DDP run writes for ``model``, exported with the adapters merged."""
    checkpoint = tmp_path / "adapted.ckpt"
    torch.save({"state_dict": CausalLMModule(model).state_dict(), "hf_model": model_record(model)}, checkpoint)
    export_checkpoint(checkpoint, tmp_path / "out", merge_adapters=True)
    return tmp_path / "out"


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("target", ["c_attn", "attn.c_proj", "c_fc"])
def test_lora_on_gpt2_conv1d_exports_as_peft_merges_it(tmp_path: Path, target: str) -> None:
    model = _adapted(GPT2, [target])
    expected = _logits(model)
    out = _export_merged(model, tmp_path)
    exported = load_file(out / "model.safetensors")
    merged = model.merge_and_unload().state_dict()
    for name in [name for name in merged if f"{target}.weight" in name]:  # (in, out), as Conv1D stores it
        torch.testing.assert_close(exported[name], merged[name], rtol=0, atol=1e-6, msg=name)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(reloaded), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("targets", [["embed_tokens", "q_proj"], ["lm_head"]])
def test_lora_on_a_tied_weight_exports_its_partner_unmerged_and_untied(tmp_path: Path, targets: list[str]) -> None:
    model = _adapted(QWEN2_TIED, targets)
    embedding = model.get_input_embeddings()
    base_embedding = getattr(embedding, "base_layer", embedding).weight.detach().clone()  # the head's too
    expected = _logits(model)
    out = _export_merged(model, tmp_path)
    assert AutoConfig.from_pretrained(out).tie_word_embeddings is False
    exported = load_file(out / "model.safetensors")
    adapted, partner = ("model.embed_tokens.weight", "lm_head.weight") if "lm_head" not in targets else (
        "lm_head.weight", "model.embed_tokens.weight")
    assert torch.equal(exported[partner], base_embedding)
    assert not torch.allclose(exported[adapted], base_embedding)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.lm_head.weight.data_ptr() != reloaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(_logits(reloaded), expected, rtol=0, atol=1e-5)


def test_lora_on_a_layer_the_merge_does_not_rebuild_is_refused_before_writing(tmp_path: Path) -> None:
    lfm2 = Lfm2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, layer_types=["conv", "full_attention"])
    model = _adapted(lfm2, ["conv.conv", "q_proj"], rank=32)  # LFM2's depthwise short convolution, an nn.Conv1d
    with pytest.raises(ValueError, match=r"model\.layers\.0\.conv\.conv is a Conv1d.*--adapter-only"):
        _export_merged(model, tmp_path)
    assert not (tmp_path / "out").exists()


def test_tensor_parallel_refusal_of_lora_on_conv1d_names_its_own_fix() -> None:
    with pytest.raises(ValueError, match="tensor_parallel=2") as refusal:
        check_adapter_split(_adapted(GPT2, ["c_attn"]), 2)
    message = str(refusal.value)
    assert "transformers Conv1D" in message and "adapter.target_modules" in message
    assert "use tensor_parallel=1" in message and "attach_on_meta" not in message


def test_two_adapters_on_different_layers_export_merged_as_both_apply(tmp_path: Path) -> None:
    """Each layer's merge rebuilds the adapters it holds only: a config naming another adapter's layer (``o_proj``
    for the adapter on ``q_proj``) was passed whole, and PEFT refused the name that matched nothing."""
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(QWEN2_TIED), LoraConfig(r=4, lora_alpha=8,
                                                                                    target_modules=["q_proj"]), "a")
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"]))
    model.base_model.set_adapter(["a", "b"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)
    model.eval()
    expected = _logits(model)
    reloaded = AutoModelForCausalLM.from_pretrained(_export_merged(model, tmp_path), dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(reloaded), expected, rtol=0, atol=1e-5)
