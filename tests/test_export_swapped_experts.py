"""``merak-export`` of a run whose Mixtral blocks were swapped for DeepSpeed's MoE layer (``moe.experts=deepspeed``):
the router and the experts are written back as Mixtral's, and the exported model computes what the trained one
does."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers

from lightning_merak.hf import export_checkpoint, model_record
from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.plugins.moe.block_replacement import swap_sparse_moe_blocks
from lightning_merak.plugins.moe.layer import MoEOptions

VOCAB = 64
MIXTRAL = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, vocab_size=VOCAB)


def test_a_swapped_mixtral_exports_as_mixtral(tmp_path: Path) -> None:
    torch.manual_seed(0)
    original = transformers.MixtralForCausalLM(MIXTRAL)
    swapped = copy.deepcopy(original)
    swap_sparse_moe_blocks(swapped, 1, MoEOptions(), aux_loss_coef=0.0)
    ids = torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    swapped.eval()
    swapped(ids)  # the swapped experts take the original weights on their first forward
    with torch.no_grad():  # training moved every weight: the export must not write the original model back
        for param in swapped.parameters():
            param.add_(0.01 * torch.randn_like(param))
    checkpoint = tmp_path / "swapped.ckpt"
    torch.save({"state_dict": CausalLMModule(swapped).state_dict(), "hf_model": model_record(original)}, checkpoint)
    export_checkpoint(checkpoint, tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert isinstance(exported, transformers.MixtralForCausalLM)
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, swapped(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(exported(ids).logits, original.eval()(ids).logits, atol=1e-3)
