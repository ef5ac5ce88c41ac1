"""The DeepSpeed-MoE block swap computes Mixtral's function at top-1 too, and refuses what it cannot reproduce.

Mixtral renormalises its top-1 probability to 1 while DeepSpeed's ``top1gating`` weights by the probability;
other families' ``*SparseMoeBlock`` (shared experts, ``norm_topk_prob``) are refused with the fix.
"""

import copy

import pytest
import torch

from lightning_merak.plugins.moe import MoEOptions, swap_sparse_moe_blocks
from lightning_merak.plugins.moe.block_replacement import SwappedSparseBlock
from lightning_merak.plugins.moe.experts import tiny_moe_model
from lightning_merak.plugins.moe.lancet_block import lancet_overlap
from tests.test_train import refused


def _mixtral(top_k: int, **overrides: object) -> torch.nn.Module:
    model = tiny_moe_model("mixtral", hidden=32, layers=2, num_local_experts=4, num_experts_per_tok=top_k,
                           **overrides)
    model.config.use_cache = False
    return model


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad()
    output = model(ids, labels=ids)
    output.loss.backward()
    return output.loss.detach(), output.logits.detach(), {
        name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _swapped_grads(model: torch.nn.Module, grads: dict) -> dict:
    """The swapped model's gradients under the original parameter names (router and fused expert tensors)."""
    renamed = {name: grad for name, grad in grads.items() if ".mlp." not in name}
    for name, block in model.named_modules():
        if isinstance(block, SwappedSparseBlock):
            layer = block.moe.deepspeed_moe
            renamed[f"{name}.gate.weight"] = layer.gate.wg.weight.grad
            experts = layer.experts.deepspeed_experts
            renamed[f"{name}.experts.gate_up_proj"] = torch.stack([e.gate_up.weight.grad for e in experts])
            renamed[f"{name}.experts.down_proj"] = torch.stack([e.down.weight.grad for e in experts])
    return renamed


@pytest.mark.parametrize("lancet_chunks", [None, 2])
def test_top1_swap_equals_the_mixtral_block_in_loss_logits_and_gradients(lancet_chunks: int | None) -> None:
    reference = _mixtral(1)
    swapped = copy.deepcopy(reference)
    swap_sparse_moe_blocks(swapped, 1, MoEOptions(), aux_loss_coef=0.0)
    if lancet_chunks is not None:  # block-scope Lancet: the gates come from the sub-batch path
        lancet_overlap(swapped, lancet_chunks)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    loss, logits, grads = _loss_and_grads(reference, ids)
    swapped_loss, swapped_logits, swapped_grads = _loss_and_grads(swapped, ids)
    torch.testing.assert_close(swapped_loss, loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(swapped_logits, logits, rtol=1e-5, atol=1e-5)
    swapped_grads = _swapped_grads(swapped, swapped_grads)
    assert swapped_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(swapped_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "qwen3_moe"])
def test_swap_refuses_other_families_blocks_with_the_fix_before_replacing_any(family: str) -> None:
    model = tiny_moe_model(family, hidden=32, layers=2, num_experts=4, num_experts_per_tok=2)
    before = [type(layer.mlp) for layer in model.model.layers]
    block_class = before[0].__name__
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.mlp: {block_class} cannot be swapped onto "
                                         r"DeepSpeed-MoE.*use moe\.experts=merak_ep"):
        swap_sparse_moe_blocks(model, 1, MoEOptions())
    assert [type(layer.mlp) for layer in model.model.layers] == before


def test_swap_refuses_router_jitter_it_would_drop() -> None:
    model = _mixtral(2, router_jitter_noise=0.1)
    with pytest.raises(ValueError, match=r"model\.config\.router_jitter_noise=0\.1 .*set "
                                         r"model\.config\.router_jitter_noise=0, or use moe\.experts=merak_ep"):
        swap_sparse_moe_blocks(model, 1, MoEOptions())
    assert not any(isinstance(m, SwappedSparseBlock) for m in model.modules())


def test_merak_train_refuses_a_qwen2_moe_swap_before_training(tmp_path, monkeypatch, capsys) -> None:
    code, output = refused(["model=hf", "model.model_type=qwen2_moe", "moe=deepspeed", "moe.ep_size=1",
                            "+model.config={hidden_size:32,num_hidden_layers:1,num_attention_heads:2,"
                            "num_key_value_heads:1,num_experts:4,num_experts_per_tok:2}"],
                           tmp_path, monkeypatch, capsys)
    assert code == 2
    assert "merak-train: error: model.layers.0.mlp: Qwen2MoeSparseMoeBlock cannot be swapped" in output.err
    assert "use moe.experts=merak_ep" in output.err and "Traceback" not in output.err
