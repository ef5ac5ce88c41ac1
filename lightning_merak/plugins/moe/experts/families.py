"""Tiny models of the named MoE families, built from each family's own config class (no download).

Used by the tests and ``benchmarks.moe_families``: each config keeps what makes the family's router
and block distinct (softmax or sigmoid scores, normalised top-k, group-limited routing, routed scaling,
shared experts, DeepSeek-V3's score-correction bias) at hidden sizes a CPU runs in milliseconds.
Sizes are multiples of 16 so torch's grouped matmul can run on them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FAMILY_CONFIGS", "FAMILY_ROUTING", "ROUTINGS", "family_widths", "tiny_moe_model"]


def _common(hidden: int, layers: int, vocab: int) -> dict[str, Any]:
    return {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", {"intermediate_size": 64, "num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {"intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
                                     "num_experts_per_tok": 4, "shared_expert_intermediate_size": 64,
                                     "norm_topk_prob": False, "decoder_sparse_step": 1}),
    "qwen3_moe": ("Qwen3MoeConfig", {"intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 16,
                                     "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                                     "head_dim": 16}),
    "olmoe": ("OlmoeConfig", {"intermediate_size": 32, "num_experts": 16, "num_experts_per_tok": 8}),
    "deepseek_v2": ("DeepseekV2Config", {"intermediate_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8,
                                         "num_experts_per_tok": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                         "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                                         "routed_scaling_factor": 1.5, "num_key_value_heads": 4,
                                         "kv_lora_rank": 16, "q_lora_rank": 32,
                                         "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16}),
    "deepseek_v3": ("DeepseekV3Config", {"intermediate_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 16,
                                         "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                         "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                                         "routed_scaling_factor": 2.5, "num_key_value_heads": 4,
                                         "kv_lora_rank": 16, "q_lora_rank": 32,
                                         "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16}),
    "gpt_oss": ("GptOssConfig", {"intermediate_size": 64, "num_local_experts": 8, "num_experts_per_tok": 4,
                                 "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}),
}
"""family → (config class in ``transformers``, tiny overrides). Qwen3-MoE, OLMoE and DeepSeek-V3 route top-8.
gpt-oss keeps its biased experts, interleaved gate/up and clamped SwiGLU; its YaRN RoPE (sized for 131k
positions) becomes plain RoPE at the tiny context.

Few experts (8-16) so tests run in milliseconds; :data:`FAMILY_ROUTING` restores each family's own routing shape.
"""

FAMILY_ROUTING: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1},
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1},
    "olmoe": {"num_experts": 64, "num_experts_per_tok": 8},
    "deepseek_v2": {"n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2, "topk_method": "greedy",
                    "n_group": None, "topk_group": None, "first_k_dense_replace": 0},
    "deepseek_v3": {"n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                    "first_k_dense_replace": 0},
    "gpt_oss": {"num_local_experts": 128, "num_experts_per_tok": 4},
}
"""family → its config class's own routing shape (transformers 5.24 defaults), over :data:`FAMILY_CONFIGS`.

How many experts a token picks from, how many it picks, their grouping and which layers are sparse decide
how the expert computation batches (rows per expert), so a benchmark of expert computation keeps them and
shrinks only widths. Expert counts, top-k and groups are the class defaults, except DeepSeek-V2's top-6:
its class leaves ``num_experts_per_tok`` unset, so the top-k is DeepSeek-V2(-Lite)'s, beside the class's
64 routed and 2 shared experts and greedy, ungrouped top-k (DeepSeek-V2-Lite's routing). Which layers are
sparse: DeepSeek-V3's ``first_k_dense_replace=3`` of 61 layers (DeepSeek-V2-Lite's 1 of 27) leaves nearly
every layer sparse, so with the benchmark's 2 layers both are sparse (``first_k_dense_replace=0``) rather
than half dense. Router functions (scoring, normalisation, scaling, correction bias) stay as in
:data:`FAMILY_CONFIGS`: they decide the values, not how the work batches.
"""

ROUTINGS = ("few_experts", "family")
"""``tiny_moe_model``'s routing shapes: :data:`FAMILY_CONFIGS` as is, or with :data:`FAMILY_ROUTING` on top."""


def family_widths(family: str, hidden: int) -> dict[str, int]:
    """Every intermediate size of ``family``'s config class default, scaled to ``hidden`` (multiples of 16).

    An expert's compute per token grows with its width while the bytes its tokens travel in expert
    parallelism grow with ``hidden`` only, so the width-to-hidden ratio decides what an exchange costs
    against the work it moves: Mixtral's experts are 3.5× its hidden size, Qwen3-MoE's and DeepSeek-V3's
    0.3-0.4×. A tiny model at these proportions keeps that balance.
    """
    import transformers

    if family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILY_CONFIGS)}")
    defaults = getattr(transformers, FAMILY_CONFIGS[family][0])()
    return {key: max(16, 16 * round(value * hidden / defaults.hidden_size / 16))
            for key, value in defaults.to_dict().items() if key.endswith("intermediate_size") and value}


def tiny_moe_model(family: str, *, hidden: int = 64, layers: int = 2, vocab: int = 128, seed: int = 0,
                   experts_implementation: str | None = "eager", dtype: torch.dtype = torch.float32,
                   intermediate: int | str | None = None, routing: str = "few_experts",
                   **overrides: Any) -> torch.nn.Module:
    """A seeded tiny ``*ForCausalLM`` of ``family``; DeepSeek-V3's score-correction bias and gpt-oss' expert biases
    are made non-zero.

    ``intermediate`` sets every intermediate size of the family's config (experts, shared experts, dense
    layers) to one value, so a larger workload is the same size for every family; ``intermediate="family"``
    keeps the family's own proportions instead (:func:`family_widths`). ``routing="family"``
    routes as the family does (:data:`FAMILY_ROUTING`: 8-256 experts, top-2 to top-8); the default keeps
    the tests' few experts. ``experts_implementation=None`` leaves the choice to transformers (its default,
    what a user who never sets it runs); the default ``"eager"`` is the reference the exactness tests compare with.
    """
    import transformers

    if family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILY_CONFIGS)}")
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; choose one of {ROUTINGS}")
    class_name, extra = FAMILY_CONFIGS[family]
    if routing == "family":
        extra = {**extra, **FAMILY_ROUTING[family]}
    if intermediate == "family":
        extra = {**extra, **family_widths(family, hidden)}
    elif isinstance(intermediate, int):
        extra = {**extra, **{key: intermediate for key in extra if key.endswith("intermediate_size")}}
    elif intermediate is not None:
        raise ValueError(f"intermediate={intermediate!r}: give a size (int) or 'family'")
    config = getattr(transformers, class_name)(**{**_common(hidden, layers, vocab), **extra, **overrides})
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "gate.weight" in name or name.endswith(("router.weight", "experts.gate_up_proj", "experts.down_proj",
                                                       "experts.gate_up_proj_bias", "experts.down_proj_bias")):
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    return model
