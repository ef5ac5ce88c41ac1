"""Model FLOPs per token (``planning/flops.py``) against hand counts and against the weights of real models."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from lightning_merak.planning.flops import TransformerShape, training_flops_per_token, transformer_shape

SEQ = 64


def _llama_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256)


def test_llama_matches_a_hand_count():
    # per layer, weights a token passes (rows × columns): q 128×128, k 128×64 and v 128×64 (2 kv heads of 32),
    # o 128×128, gate/up/down 128×344 each; attention: scores and weighted sum, 64 positions × 128 each
    per_layer = 128 * 128 + 128 * 64 + 128 * 64 + 128 * 128 + 3 * 128 * 344 + 2 * SEQ * 128
    multiply_adds = 4 * per_layer + 128 * 256  # four layers and the LM head
    assert multiply_adds == 823_296
    assert training_flops_per_token(transformer_shape(_llama_config()), SEQ) == 2 * 3 * multiply_adds


def test_qwen2_moe_counts_active_and_shared_experts_only():
    config = Qwen2MoeConfig(hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
                            shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=4, decoder_sparse_step=1, mlp_only_layers=[3],
                            num_attention_heads=4, num_key_value_heads=4, vocab_size=100)
    attention = 4 * 64 * 64 + 2 * SEQ * 64  # q, k, v, o (4 heads of 16, no grouping); scores and weighted sum
    moe_mlp = (64 * 8  # router
               + 2 * 3 * 64 * 32  # the two experts each token is routed to (gate, up, down)
               + 3 * 64 * 96 + 64)  # the shared expert and its one-output gate
    dense_mlp = 3 * 64 * 160  # layer 3 is in mlp_only_layers
    multiply_adds = 4 * attention + 3 * moe_mlp + dense_mlp + 64 * 100
    assert training_flops_per_token(transformer_shape(config), SEQ) == 6 * multiply_adds


def _linear_weights(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(module.weight.numel() for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and not any(part in name for part in skip))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_dense_count_is_every_linear_weight_plus_attention(family: str):
    from transformers import AutoModelForCausalLM

    config = _llama_config() if family == "llama" else GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=100)
    model = AutoModelForCausalLM.from_config(config)
    weights = _linear_weights(model)
    if family == "gpt2":  # GPT-2's projections are Conv1D, not Linear
        from transformers.pytorch_utils import Conv1D
        weights += sum(m.weight.numel() for m in model.modules() if isinstance(m, Conv1D))
    shape = transformer_shape(config)
    attention = shape.layers * 2 * SEQ * shape.heads * shape.head_dim
    assert shape.forward_flops_per_token(SEQ) == 2 * (weights + attention)


def test_mixtral_counts_top_k_of_its_experts():
    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=100)
    dense_equivalent = TransformerShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=100,
                                        intermediate=2 * 128)  # two experts' worth of one gated MLP
    router = 2 * 2 * 64 * 8
    shape = transformer_shape(config)
    assert shape.forward_flops_per_token(SEQ) == dense_equivalent.forward_flops_per_token(SEQ) + router


def test_unknown_family_names_the_counted_ones_and_the_way_out():
    with pytest.raises(ValueError, match=r"model_type='mamba'.*llama.*flops_per_token="):
        transformer_shape({"model_type": "mamba"})
    with pytest.raises(ValueError, match="seq_len"):
        transformer_shape(_llama_config()).forward_flops_per_token(0)


WINDOW = 16  # below SEQ: a windowed layer's attention is a quarter of a full one's


def _window_kwargs() -> dict[str, int]:
    return dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100, sliding_window=WINDOW)


def _attention_multiply_adds(full_layers: int, windowed_layers: int) -> int:
    # scores and weighted sum, 4 heads of 16: SEQ keys in a full layer, WINDOW in a windowed one (PaLM's convention)
    return 2 * 64 * (full_layers * SEQ + windowed_layers * WINDOW)


@pytest.mark.parametrize(("family", "windowed"), [("mistral", 6), ("gemma2", 3), ("gemma3_text", 5), ("qwen2", 2)])
def test_sliding_window_layers_attend_their_window_only(family: str, windowed: int):
    config = {"mistral": lambda: MistralConfig(**_window_kwargs()),  # every layer
              "gemma2": lambda: Gemma2Config(head_dim=16, **_window_kwargs()),  # every other layer
              "gemma3_text": lambda: Gemma3TextConfig(head_dim=16, **_window_kwargs()),  # five of each six
              "qwen2": lambda: Qwen2Config(use_sliding_window=True, max_window_layers=4, **_window_kwargs()),  # 4, 5
              }[family]()
    without_window = transformer_shape({**config.to_dict(), "sliding_window": None})
    weights = without_window.forward_flops_per_token(SEQ) - 2 * _attention_multiply_adds(6, 0)
    expected = weights + 2 * _attention_multiply_adds(6 - windowed, windowed)
    assert transformer_shape(config).forward_flops_per_token(SEQ) == expected
    assert transformer_shape(config).forward_flops_per_token(WINDOW) == without_window.forward_flops_per_token(WINDOW)


def test_a_window_switched_off_or_wider_than_the_sequence_counts_the_whole_sequence():
    llama = transformer_shape({**_window_kwargs(), "model_type": "llama"})  # Llama has no window: the key is ignored
    assert transformer_shape(Qwen2Config(**_window_kwargs())).forward_flops_per_token(SEQ) == \
        llama.forward_flops_per_token(SEQ)  # use_sliding_window=False
    assert transformer_shape(MistralConfig(**_window_kwargs())).forward_flops_per_token(WINDOW // 2) == \
        llama.forward_flops_per_token(WINDOW // 2)


def test_qwen3_moe_reads_its_experts_from_a_real_config():
    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                            head_dim=16, vocab_size=100)
    shape = transformer_shape(config)
    assert (shape.experts, shape.experts_per_token, shape.moe_layers) == (8, 2, 2)
    attention = 4 * 64 * 64 + 2 * SEQ * 64
    moe_mlp = 64 * 8 + 2 * 3 * 64 * 32  # router and the two experts a token reaches
    assert training_flops_per_token(shape, SEQ) == 6 * (2 * (attention + moe_mlp) + 64 * 100)


def test_a_counted_family_without_a_key_names_the_family_and_the_key():
    with pytest.raises(ValueError, match=r"model_type='qwen3_moe'.*'num_local_experts'.*flops_per_token="):
        transformer_shape({"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4,
                           "num_hidden_layers": 2, "vocab_size": 100})


def test_frozen_weights_cost_two_forwards_and_attention_three():
    shape = transformer_shape(_llama_config())
    attention, weights = shape.attention_flops_per_token(SEQ), shape.weight_flops_per_token()
    assert training_flops_per_token(shape, SEQ, frozen_weight_fraction=1.0) == 3 * attention + 2 * weights
    assert training_flops_per_token(shape, SEQ, frozen_weight_fraction=0.25) == 3 * attention + 2.75 * weights
    with pytest.raises(ValueError, match="frozen_weight_fraction must be between 0 and 1"):
        training_flops_per_token(shape, SEQ, frozen_weight_fraction=1.5)
