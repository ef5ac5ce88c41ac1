"""Adapters on MoE models on one process: LoRA on attention and fused expert tensors under ``merak_grouped``
equals the same adapters on the eager expert loop, Q-BaRA / QA-HiRA on attention, save/load and merge,
and the refusals (expert biases, wrong shapes); pooled adapters on experts: tests/test_moe_pooled_adapters.py."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_merak.adapters import quantize_model
from lightning_merak.adapters.moe import (
    add_moe_adapters,
    expert_adapter_state_dict,
    expert_adapters,
    join_expert_factors,
    load_moe_adapter,
    merged_state_dict,
    moe_adapter_config,
    save_moe_adapter,
    slice_expert_factor,
)
from lightning_merak.plugins.moe.experts import (
    EXACT_FAMILIES,
    enable_expert_parallel,
    enable_grouped_experts,
    tiny_moe_model,
)

TOL = 1e-5


def _ids(seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(seed))


def _adapted(family: str, method: str = "lora", experts: bool = True) -> torch.nn.Module:
    """``family``'s tiny model with non-zero adapters; QA-HiRA on an INT4 base whose groups equal its pooling."""
    model = tiny_moe_model(family)
    options: dict = {"init_lora_weights": False}
    if method == "qbara":
        options = {"lambda_in": 2, "lambda_out": 2}
    elif method == "qahira":
        model = quantize_model(model, "int4", 16, False)
        options = {"lambda_in": 16, "lambda_out": 1}
    config = moe_adapter_config(model, method, r=4, alpha=8, experts=experts, **options)
    torch.manual_seed(7)
    peft_model = add_moe_adapters(model, config)
    if method != "lora":  # pooled adapters start at zero; make the update non-zero
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if param.requires_grad:
                    param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return peft_model


def _adapter_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad for name, param in model.named_parameters() if param.requires_grad}


def _compare(eager: torch.nn.Module, grouped: torch.nn.Module) -> tuple[float, float]:
    ids = _ids()
    outs = []
    for model in (eager, grouped):
        out = model(ids, labels=ids)
        out.loss.backward()
        outs.append(out.logits.detach())
    ref, ours = _adapter_grads(eager), _adapter_grads(grouped)
    assert ref.keys() == ours.keys() and ref
    assert all(g is not None and g.abs().sum() > 0 for g in ref.values())
    grad_diff = max((ours[name] - ref[name]).abs().max().item() for name in ref)
    return (outs[0] - outs[1]).abs().max().item(), grad_diff


@pytest.mark.parametrize("family", EXACT_FAMILIES)
def test_lora_on_attention_and_experts_grouped_equals_eager(family: str) -> None:
    eager = _adapted(family)
    names = [adapter.name for adapter in expert_adapters(eager)]
    assert names and all(".experts" in name for name in names)
    assert any("self_attn" in name and "lora_A" in name for name, _ in eager.named_parameters())
    grouped = copy.deepcopy(eager)
    enable_grouped_experts(grouped)
    assert grouped.config._experts_implementation == "merak_grouped"
    logit_diff, grad_diff = _compare(eager, grouped)
    assert logit_diff <= TOL and grad_diff <= TOL, (logit_diff, grad_diff)


@pytest.mark.parametrize("method", ["qbara", "qahira"])
def test_pooled_adapters_on_attention_of_grouped_moe(method: str) -> None:
    eager = _adapted("qwen3_moe", method, experts=False)
    assert not expert_adapters(eager)
    grouped = copy.deepcopy(eager)
    enable_grouped_experts(grouped)
    logit_diff, grad_diff = _compare(eager, grouped)
    assert logit_diff <= TOL and grad_diff <= TOL, (logit_diff, grad_diff)
    ids = _ids(4)
    with torch.no_grad():
        before = grouped(ids).logits
        merged, _ = merged_state_dict(grouped)
        assert (merged(ids).logits - before).abs().max().item() <= TOL


def test_expert_bias_and_wrong_shapes_refused() -> None:
    from peft import LoraConfig

    model = tiny_moe_model("olmoe")
    with pytest.raises(ValueError, match="not a fused expert weight"):
        add_moe_adapters(model, LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["experts.bias"]))
    rank4 = _adapted("olmoe")
    other = add_moe_adapters(tiny_moe_model("olmoe"), moe_adapter_config(tiny_moe_model("olmoe"), r=2))
    with pytest.raises(ValueError, match="another r or another model"):
        load_moe_adapter(other, expert_adapter_state_dict(rank4))


def test_adapters_before_expert_parallel_listed_and_equal() -> None:
    eager = _adapted("mixtral")
    ours = copy.deepcopy(eager)
    report = enable_expert_parallel(ours)  # no process group: one rank holding every expert
    factors = [name for name in report.expert_parameters if ".lora_" in name]
    assert factors and len(factors) == 2 * len(expert_adapters(ours))  # lora_A and lora_B per wrapper
    assert set(factors) <= {name for name, _ in ours.named_parameters()}
    logit_diff, grad_diff = _compare(eager, ours)
    assert logit_diff <= TOL and grad_diff <= TOL, (logit_diff, grad_diff)


def test_expert_factor_slices_are_peft_per_expert_factors() -> None:
    torch.manual_seed(0)
    num_experts, rank = 8, 4
    a, b = torch.randn(num_experts * rank, 32), torch.randn(48, rank * num_experts)
    halves = [range(0, 4), range(4, 8)]
    parts_a = [slice_expert_factor("A", a, part, num_experts) for part in halves]
    parts_b = [slice_expert_factor("B", b, part, num_experts) for part in halves]
    assert torch.equal(join_expert_factors("A", parts_a, rank), a)
    assert torch.equal(join_expert_factors("B", parts_b, rank), b)
    per_expert_b = b.reshape(48, rank, num_experts).permute(2, 0, 1)  # PEFT's (experts, out, rank)
    local_b = parts_b[1].reshape(48, rank, 4).permute(2, 0, 1)
    assert torch.equal(local_b, per_expert_b[4:])
    assert torch.equal(parts_a[1].reshape(4, rank, 32), a.reshape(num_experts, rank, 32)[4:])


def test_save_load_and_merge_exact(tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    eager = _adapted("deepseek_v3")
    adapted = copy.deepcopy(eager)
    enable_grouped_experts(adapted)
    save_moe_adapter(adapted, tmp_path / "adapter")
    state = expert_adapter_state_dict(adapted)
    loaded = PeftModel.from_pretrained(tiny_moe_model("deepseek_v3"), str(tmp_path / "adapter"))
    fresh = add_moe_adapters(tiny_moe_model("deepseek_v3"), adapted.peft_config["default"])
    load_moe_adapter(fresh, tmp_path / "adapter")
    for other in (loaded, fresh):
        other_state = expert_adapter_state_dict(other)
        assert other_state.keys() == state.keys()
        assert all(torch.equal(other_state[key], state[key]) for key in state)

    ids = _ids(5)
    with torch.no_grad():
        before = adapted(ids).logits
    base, merged = merged_state_dict(adapted)
    eager_base, eager_merged = merged_state_dict(eager)  # the merged unswapped model
    assert merged.keys() == eager_merged.keys()
    assert all(torch.equal(merged[key], eager_merged[key]) for key in merged)
    base.save_pretrained(tmp_path / "merged", state_dict=merged)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    reloaded = exported.state_dict()
    assert all(torch.equal(reloaded[key], merged[key]) for key in reloaded)
    with torch.no_grad():
        after, reference = exported(ids).logits, eager_base(ids).logits
    assert (after - reference).abs().max().item() <= TOL  # same weights; the exported model's expert kernel
    assert (after - before).abs().max().item() <= TOL
