"""Q-BaRA / QA-HiRA on fused expert tensors (#53 item 3), one process: the per-expert update is the Linear layer's
pooled path; the adapted model equals one whose expert weights carry that update, under the eager loop and
``merak_grouped``; save/load into an unsharded ``PeftModel``; exact merges into float and INT4 experts; refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_merak.adapters import QAHiRAConfig, expand_outputs, pool_inputs, quantize_model
from lightning_merak.adapters.int4_experts import int4_expert_tensor, quantize_experts_int4
from lightning_merak.adapters.moe import (
    add_moe_adapters,
    expert_adapter_state_dict,
    expert_adapters,
    load_moe_adapter,
    moe_adapter_config,
    save_moe_adapter,
)
from lightning_merak.plugins.moe.experts import enable_grouped_experts, experts_modules, tiny_moe_model

TOL = 1e-5
OPTIONS = {"qbara": {"lambda_in": 2, "lambda_out": 2}, "qahira": {"lambda_in": 16, "lambda_out": 2}}


def _ids(seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(seed))


def _adapted(family: str, method: str, int4: bool = False, attention: bool = True) -> torch.nn.Module:
    """``family``'s tiny model with non-zero pooled adapters on attention and experts (INT4 experts, G=16)."""
    model = tiny_moe_model(family)
    if int4:
        quantize_model(model, "int4", 16, experts=True)
    peft_model = add_moe_adapters(model, moe_adapter_config(model, method, r=4, alpha=8, attention=attention,
                                                            **OPTIONS[method]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if param.requires_grad:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return peft_model


def _plain(name: str) -> str:
    """A module's name in the unwrapped model."""
    return name.replace("base_model.model.", "").replace(".base_layer", "")


def _activation_path_delta(wrapper: torch.nn.Module) -> torch.Tensor:
    """Every expert's update as the Linear layer computes it on activations, ``s * E_out(M_e P_in(x))``, applied to
    the identity (so ``[E, out, in]``), independent of the weight-tiling code."""
    adapter = "default"
    eye = torch.eye(wrapper.in_features)
    pooled = pool_inputs(eye, wrapper.lambda_in[adapter])  # [in, in/λ]
    per_expert = pooled @ wrapper.pooled_matrix(adapter).float().transpose(-2, -1)  # [E, in, out/λ]
    return (wrapper.scaling[adapter] * expand_outputs(per_expert, wrapper.lambda_out[adapter])).transpose(-2, -1)


@pytest.mark.parametrize("method", ["qbara", "qahira"])
def test_expert_update_is_the_linear_pooled_path(method: str) -> None:
    model = _adapted("mixtral", method)
    adapters = expert_adapters(model)
    assert len(adapters) == 4 and {a.wrapper.parameter_name for a in adapters} == {"gate_up_proj", "down_proj"}
    for adapter in adapters:
        delta = adapter.wrapper.get_delta_weight("default")
        assert (delta - _activation_path_delta(adapter.wrapper)).abs().max().item() <= 1e-6
    if method == "qbara":  # LoRA-r's parameter count per expert: rank λ·r on pooled sizes
        wrapper = adapters[0].wrapper
        lora = 4 * (wrapper.in_features + wrapper.out_features) * wrapper.num_experts
        assert sum(p.numel() for p in (wrapper.qbara_A["default"], wrapper.qbara_B["default"])) == lora


def _reference(family: str, adapted: torch.nn.Module, int4: bool) -> torch.nn.Module:
    """A plain model whose expert weights are the adapted model's (dequantized) ones plus the activation-path update."""
    reference = tiny_moe_model(family)
    if int4:
        quantize_model(reference, "int4", 16, experts=True)
    ours = {_plain(name): module for name, module in experts_modules(adapted)}
    with torch.no_grad():
        for name, module in experts_modules(reference):
            for tensor in ("gate_up_proj", "down_proj"):
                wrapper = next(a.wrapper for a in expert_adapters(adapted) if a.wrapper.parameter_name == tensor
                               and _plain(a.name) == name)
                delta = _activation_path_delta(wrapper)
                if getattr(module, "is_transposed", False):
                    delta = delta.transpose(-2, -1)
                weight = getattr(ours[name], tensor) + delta
                if int4:
                    torch.nn.utils.parametrize.remove_parametrizations(module, tensor, leave_parametrized=False)
                setattr(module, tensor, torch.nn.Parameter(weight))
    return reference


@pytest.mark.parametrize(("family", "method", "int4"), [("mixtral", "qbara", False), ("gpt_oss", "qahira", False),
                                                        ("qwen3_moe", "qahira", True)])
def test_adapted_experts_equal_weights_with_update_eager_and_grouped(family: str, method: str, int4: bool) -> None:
    eager = _adapted(family, method, int4, attention=False)
    grouped = copy.deepcopy(eager)
    enable_grouped_experts(grouped)
    ids = _ids()
    outs, grads = [], []
    for model in (eager, grouped):
        out = model(ids, labels=ids)
        out.loss.backward()
        outs.append(out.logits.detach())
        grads.append({name: p.grad for name, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(g.abs().sum() > 0 for g in grads[0].values())
    assert max((grads[0][k] - grads[1][k]).abs().max().item() for k in grads[0]) <= TOL
    assert (outs[0] - outs[1]).abs().max().item() <= TOL
    with torch.no_grad():
        reference = _reference(family, eager, int4)(ids).logits
    assert (outs[0] - reference).abs().max().item() <= TOL


@pytest.mark.parametrize("method", ["qbara", "qahira"])
def test_save_load_into_unsharded_model_and_merge_exact(method: str, tmp_path) -> None:
    from peft import PeftModel

    adapted = _adapted("deepseek_v3", method)
    save_moe_adapter(adapted, tmp_path / "adapter")
    state = expert_adapter_state_dict(adapted)
    assert any(".experts." in key and f"{method}_" in key for key in state)
    loaded = PeftModel.from_pretrained(tiny_moe_model("deepseek_v3"), str(tmp_path / "adapter"))
    fresh = add_moe_adapters(tiny_moe_model("deepseek_v3"), adapted.peft_config["default"])
    load_moe_adapter(fresh, tmp_path / "adapter")
    ids = _ids(5)
    with torch.no_grad():
        before = adapted(ids).logits
        for other in (loaded, fresh):
            other_state = expert_adapter_state_dict(other)
            assert other_state.keys() == state.keys() and all(torch.equal(other_state[k], state[k]) for k in state)
            assert torch.equal(other(ids).logits, before)
        merged = adapted.merge_and_unload()
        assert not expert_adapters(merged)
        assert (merged(ids).logits - before).abs().max().item() <= TOL


def test_qahira_merge_into_int4_experts_shifts_zeros_only() -> None:
    adapted = _adapted("mixtral", "qahira", int4=True)
    stored = {(name, tensor): (module.parametrizations[tensor].original.clone(),
                               int4_expert_tensor(module, tensor).scales.clone(),
                               int4_expert_tensor(module, tensor).zeros.clone())
              for name, module in experts_modules(adapted) for tensor in ("gate_up_proj", "down_proj")}
    ids = _ids(6)
    with torch.no_grad():
        before = adapted(ids).logits
        merged = adapted.merge_and_unload()
        after = merged(ids).logits
    assert (after - before).abs().max().item() <= TOL
    for (name, tensor), (codes, scales, zeros) in stored.items():
        module = merged.get_submodule(_plain(name))
        assert torch.equal(module.parametrizations[tensor].original, codes)
        assert torch.equal(int4_expert_tensor(module, tensor).scales, scales)
        assert not torch.equal(int4_expert_tensor(module, tensor).zeros, zeros)


def test_int4_experts_quantize_per_expert_rows_in_groups() -> None:
    model = tiny_moe_model("gpt_oss")  # [E, in, out] layout
    float_weights = {name: module.down_proj.detach().clone() for name, module in experts_modules(model)}
    names = quantize_experts_int4(model, 16)
    assert len(names) == 4 and not quantize_experts_int4(model, 16)  # quantized once
    for name, module in experts_modules(model):
        error = (module.down_proj - float_weights[name]).abs()
        steps = int4_expert_tensor(module, "down_proj").scales.max()
        assert module.down_proj.shape == float_weights[name].shape and error.max() <= steps / 2 + 1e-6


def test_refusals_name_the_fix() -> None:
    with pytest.raises(ValueError, match="not divisible by lambda_in=3. Pick lambda_in dividing 64"):
        _adapted_with("qbara", lambda_in=3, lambda_out=2)
    with pytest.raises(ValueError, match="Set lambda_in=16"):
        _adapted_with("qahira", int4=True, lambda_in=8, lambda_out=1)
    with pytest.raises(ValueError, match="dropout=0.1 with target_parameters.*Set dropout=0"):
        QAHiRAConfig(target_parameters=["experts.down_proj"], dropout=0.1)
    with pytest.raises(ValueError, match="bitsandbytes quantizes Linear layers only"):
        quantize_model(tiny_moe_model("mixtral"), "nf4", experts=True)
    qbara_int4 = _adapted_with("qbara", int4=True, lambda_in=2, lambda_out=2)
    with pytest.raises(ValueError, match="cannot merge exactly into INT4 experts.*lambda_in a multiple of 16"):
        qbara_int4.merge_and_unload()


def _adapted_with(method: str, int4: bool = False, **options: int) -> torch.nn.Module:
    model = tiny_moe_model("mixtral")
    if int4:
        quantize_model(model, "none" if method == "qbara" else "int4", 16)
        quantize_experts_int4(model, 16)
    return add_moe_adapters(model, moe_adapter_config(model, method, r=4, attention=False, **options))
