"""A meta-built MoE model whose experts run torch's ``grouped_mm`` traces for pipeline stages like the real one."""

from __future__ import annotations

import torch

VOCAB = 64


def test_a_meta_moe_model_with_grouped_mm_experts_traces_like_the_real_one():
    """transformers' ``grouped_mm`` experts in fp32: torch's meta kernel takes bf16 only, the CPU kernel fp32 too."""
    from transformers import AutoModelForCausalLM

    from lightning_merak.parallel.pipeline.trace import trace_model
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    real = tiny_moe_model("mixtral", hidden=64, vocab=VOCAB, experts_implementation="grouped_mm", use_cache=False)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(real.config)
    assert meta.config._experts_implementation == "grouped_mm"
    ids = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = trace_model(real, ids, profile=True, profile_repeats=1)
    traced = trace_model(meta, ids, profile=True, profile_repeats=1)
    assert all(p.is_meta for p in meta.parameters())
    assert (traced.num_blocks, traced.block_output_index) == (expected.num_blocks, expected.block_output_index)
    assert [c.param_bytes for c in traced.costs] == [c.param_bytes for c in expected.costs]
    assert traced.sample_hidden.shape == expected.sample_hidden.shape
