"""``adapter=lora adapter.experts=true`` (#30 item 5): the Hydra option adapts an MoE model's fused routed experts
besides its attention, as ``moe_adapter_config`` does, whatever ``target_modules`` says; by default PEFT's own mapping
decides; false adapts none; Q-BaRA / QA-HiRA put one pooled adapter per expert (#53 item 3)."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf


def _config(*overrides: str):
    from lightning_merak.cli.config import register_configs

    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=["output_dir=/tmp/unused", *overrides]))


def _adapted(*overrides: str) -> torch.nn.Module:
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    config = _config("moe=prophet", "moe.experts=merak_ep", "adapter.quantization=none", *overrides)
    return config.adapter.apply(config.moe.apply(tiny_moe_model("qwen3_moe")))


def test_experts_option_adds_one_lora_per_expert() -> None:
    from lightning_merak.adapters.moe import expert_adapters

    model = _adapted("adapter=lora", "adapter.experts=true", "adapter.target_modules=[q_proj,v_proj]")
    adapters = expert_adapters(model)
    assert len(adapters) == 4  # 2 layers × (gate_up_proj, down_proj)
    assert all(int(adapter.wrapper.num_experts) == 16 for adapter in adapters)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert any(".q_proj.lora_A." in name for name in trainable)
    assert any(".experts.lora_B." in name for name in trainable)
    assert all(".lora_" in name for name in trainable)  # the base, experts included, stays frozen


def test_default_follows_peft_and_false_adapts_no_expert() -> None:
    """Default (null): PEFT maps the default targets' gate_proj/up_proj/down_proj onto the fused experts; false with
    those targets is refused naming the fix, and without them adapts attention alone."""
    from lightning_merak.adapters.moe import expert_adapters

    assert _config("adapter=lora").adapter.experts is None
    assert len(expert_adapters(_adapted("adapter=lora"))) == 4
    with pytest.raises(ValueError, match="drop those names from adapter.target_modules"):
        _adapted("adapter=lora", "adapter.experts=false")
    model = _adapted("adapter=lora", "adapter.experts=false", "adapter.target_modules=[q_proj,k_proj,v_proj,o_proj]")
    assert not expert_adapters(model)
    assert any(".q_proj.lora_A." in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("method", ["qbara", "qahira"])
def test_pooled_methods_adapt_experts(method: str) -> None:
    """true: one pooled adapter per expert on every fused weight (INT4 experts under quantization=int4); null: as the
    targets name them; false: none."""
    from lightning_merak.adapters.int4_experts import int4_expert_tensor
    from lightning_merak.adapters.moe import expert_adapters
    from lightning_merak.plugins.moe.experts import experts_modules

    quantization = "adapter.quantization=int4" if method == "qahira" else "adapter.quantization=none"
    model = _adapted(f"adapter={method}", "adapter.experts=true", "adapter.target_modules=[q_proj]",
                     "adapter.group_size=16", quantization)
    adapters = expert_adapters(model)
    assert len(adapters) == 4 and all(int(adapter.wrapper.num_experts) == 16 for adapter in adapters)
    assert all(param.requires_grad == (f"{method}_" in name) for name, param in model.named_parameters())
    quantized = [int4_expert_tensor(module, "down_proj") is not None for _, module in experts_modules(model)]
    assert all(quantized) if method == "qahira" else not any(quantized)
    only_down = _adapted(f"adapter={method}", "adapter.target_modules=[q_proj,down_proj]", "adapter.group_size=16",
                         quantization)
    assert {adapter.wrapper.parameter_name for adapter in expert_adapters(only_down)} == {"down_proj"}
    assert not expert_adapters(_adapted(f"adapter={method}", "adapter.experts=false", quantization))


def test_dropout_on_experts_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="adapter.dropout=0"):
        _adapted("adapter=lora", "adapter.experts=true", "adapter.dropout=0.1")
