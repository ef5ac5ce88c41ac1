"""Q-BaRA / QA-HiRA used as a PEFT user uses LoRA: ``modules_to_save`` and SEQ_CLS heads, GPT-2's ``Conv1D``
layers, ``target_modules="all-linear"`` on an INT4 base, and the CLI's QA-HiRA pooling errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.utils import ModulesToSaveWrapper
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
from transformers.pytorch_utils import Conv1D

from lightning_merak.adapters import QAHiRAConfig, QBaRAConfig, QuantLinearInt4, quantize_model
from lightning_merak.cli.options.adapter import QAHiRAAdapterConfig, Quantization
from lightning_merak.hf import export_checkpoint, model_record
from lightning_merak.hf.export import export_adapter
from lightning_merak.modules.causal_lm import CausalLMModule

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
            pad_token_id=0)
CONFIGS = [
    lambda **kwargs: QBaRAConfig(r=4, lambda_in=2, lambda_out=2, **kwargs),
    lambda **kwargs: QAHiRAConfig(lambda_in=32, lambda_out=1, **kwargs),
]


def ids() -> torch.Tensor:
    return torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def randomize_trainable(model: torch.nn.Module, seed: int = 1) -> None:
    """Give every trainable tensor (zero-initialised adapters, the saved head) a value the checks can see."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)


def classifier(head_seed: int) -> LlamaForSequenceClassification:
    """The same body with a freshly drawn ``score`` head, as ``from_pretrained`` on a base checkpoint gives."""
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(num_labels=3, **TINY)).eval()
    torch.manual_seed(head_seed)
    torch.nn.init.normal_(model.score.weight, std=0.02)
    return model


@pytest.mark.parametrize("make_config", CONFIGS, ids=["qbara", "qahira"])
def test_seq_cls_head_is_trained_saved_and_restored(tmp_path, make_config) -> None:
    model = get_peft_model(classifier(head_seed=10), make_config(task_type="SEQ_CLS", target_modules=["q_proj"]))
    assert isinstance(model.base_model.model.score, ModulesToSaveWrapper)
    assert any(p.requires_grad for name, p in model.named_parameters() if "score" in name)
    randomize_trainable(model)
    with torch.no_grad():
        expected = model(input_ids=ids()).logits
    model.save_pretrained(tmp_path)
    assert any("score" in key for key in load_file(tmp_path / "adapter_model.safetensors"))
    reloaded = PeftModel.from_pretrained(classifier(head_seed=11), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids()).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("make_config", CONFIGS, ids=["qbara", "qahira"])
def test_modules_to_save_lm_head_round_trips_and_merges(tmp_path, make_config) -> None:
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY)).eval(),
                           make_config(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    randomize_trainable(model)
    with torch.no_grad():
        expected = model(input_ids=ids()).logits
    model.save_pretrained(tmp_path)
    torch.manual_seed(0)
    reloaded = PeftModel.from_pretrained(LlamaForCausalLM(LlamaConfig(**TINY)).eval(), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids()).logits, expected, rtol=0, atol=0)
        merged = reloaded.merge_and_unload()
        assert (merged(input_ids=ids()).logits - expected).abs().max() <= 1e-5 * expected.abs().max()


def lightning_checkpoint(model: torch.nn.Module, tmp_path: Path) -> Path:
    """The Lightning ``.ckpt`` a one-process run writes for ``model``."""
    checkpoint = tmp_path / "adapted.ckpt"
    torch.save({"state_dict": CausalLMModule(model).state_dict(), "hf_model": model_record(model)}, checkpoint)
    return checkpoint


def test_adapter_only_export_writes_modules_to_save(tmp_path) -> None:
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    base_state = {key: value.clone() for key, value in base.state_dict().items()}
    model = get_peft_model(base, CONFIGS[0](target_modules=["q_proj"], modules_to_save=["lm_head"]))
    randomize_trainable(model)
    with torch.no_grad():
        expected = model(input_ids=ids()).logits
    export_adapter(lightning_checkpoint(model, tmp_path), tmp_path / "adapter")
    fresh = LlamaForCausalLM(LlamaConfig(**TINY))
    fresh.load_state_dict(base_state)
    reloaded = PeftModel.from_pretrained(fresh.eval(), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids()).logits, expected, rtol=0, atol=0)


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)).eval()


@pytest.mark.parametrize("make_config", CONFIGS, ids=["qbara", "qahira"])
def test_gpt2_conv1d_forward_equals_linear_and_merges_exactly(make_config) -> None:
    model = get_peft_model(tiny_gpt2(), make_config(target_modules=["c_attn", "c_fc", "c_proj"]))
    randomize_trainable(model)
    layer = model.base_model.model.transformer.h[0].mlp.c_fc
    conv = layer.get_base_layer()
    assert isinstance(conv, Conv1D) and (layer.in_features, layer.out_features) == (64, 256)
    x = torch.randn(3, 5, 64)
    linear = torch.nn.Linear(64, 256)  # what the Conv1D computes, as nn.Linear: weight (out, in)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.T)
        linear.bias.copy_(conv.bias)
        expected = linear(x) + x @ layer.get_delta_weight("default").T
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-6)
        adapted = model(input_ids=ids()).logits
        merged = model.merge_and_unload()
        assert isinstance(merged.transformer.h[0].mlp.c_fc, Conv1D)
        assert (merged(input_ids=ids()).logits - adapted).abs().max() <= 1e-5 * adapted.abs().max()


def test_all_linear_on_an_int4_base_adapts_its_int4_layers_but_not_the_head() -> None:
    torch.manual_seed(0)
    model = quantize_model(LlamaForCausalLM(LlamaConfig(**TINY)), "int4", group_size=32)
    adapted = get_peft_model(model, QAHiRAConfig(lambda_in=32, lambda_out=1, target_modules="all-linear"))
    wrapped = {name for name, module in adapted.named_modules() if hasattr(module, "qahira_H")}
    int4 = {name.removesuffix(".base_layer") for name, module in adapted.named_modules()
            if isinstance(module, QuantLinearInt4)}
    assert wrapped == int4 and len(wrapped) == 14
    assert not any("lm_head" in name for name in wrapped)


def test_qahira_group_size_not_dividing_a_layer_names_group_size() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "hidden_size": 96}))
    option = QAHiRAAdapterConfig(group_size=48, quantization=Quantization.none)
    with pytest.raises(ValueError, match=r"adapter.group_size=48 does not divide the 128 inputs of "
                                         r"model.layers.0.mlp.down_proj.*lambda_in follows adapter.group_size"):
        option.apply(model)


def test_merged_export_of_a_pooled_adapter_on_gpt2_conv1d_computes_the_adapted_model(tmp_path) -> None:
    model = get_peft_model(tiny_gpt2(), CONFIGS[0](target_modules=["c_attn", "c_fc", "c_proj"]))
    randomize_trainable(model)
    with torch.no_grad():
        expected = model(input_ids=ids()).logits
    export_checkpoint(lightning_checkpoint(model, tmp_path), tmp_path / "out", merge_adapters=True)
    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (exported(input_ids=ids()).logits - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_merged_export_writes_the_trained_copy_of_modules_to_save(tmp_path) -> None:
    """``--merge-adapters`` writes a ``modules_to_save`` module's trained copy, not the frozen original beside it."""
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY)).eval(),
                           CONFIGS[0](target_modules=["q_proj"], modules_to_save=["lm_head"]))
    randomize_trainable(model)
    with torch.no_grad():
        expected = model(input_ids=ids()).logits
    export_checkpoint(lightning_checkpoint(model, tmp_path), tmp_path / "merged", merge_adapters=True)
    exported = LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids()).logits, expected, rtol=0, atol=1e-5)
