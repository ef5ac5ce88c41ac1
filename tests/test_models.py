import pytest
import torch

from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig, OptimConfig

TINY = {
    "llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4},
    "mistral": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2},
}


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_builds_from_config_and_learns(model_type):
    model = build_causal_lm(ModelConfig(name=model_type, model_type=model_type, config=TINY[model_type]), vocab_size=50)
    module = CausalLMModule(model, OptimConfig(learning_rate=1e-2, warmup_steps=1))
    batch = (torch.randint(50, (4, 12)),)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = module.compute_loss(batch)
    for _ in range(15):
        optimizer.zero_grad()
        loss = module.compute_loss(batch)
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first.item()
    assert model.get_input_embeddings().num_embeddings == 50


def test_unknown_model_type_names_the_fix():
    with pytest.raises(ValueError, match="not a transformers model type"):
        build_causal_lm(ModelConfig(name="x", model_type="llamaa"), vocab_size=10)


def test_model_without_causal_head_is_refused():
    with pytest.raises(ValueError, match="no causal-LM head"):
        build_causal_lm(ModelConfig(name="x", model_type="vit"), vocab_size=10)


def test_a_padding_id_outside_the_data_vocabulary_is_dropped_by_default_and_refused_when_given():
    small = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    defaulted = build_causal_lm(ModelConfig(name="x", model_type="phi3", config=small), vocab_size=64)
    assert defaulted.get_input_embeddings().padding_idx is None  # phi3's default 32000 names no token here
    assert defaulted.config.pad_token_id is None
    with pytest.raises(ValueError, match="model.config sets pad_token_id=64, outside the data's vocabulary of 64 "
                                         "tokens; set model.config.pad_token_id=null"):
        build_causal_lm(ModelConfig(name="x", model_type="llama", config={**small, "pad_token_id": 64}), vocab_size=64)
    model = build_causal_lm(ModelConfig(name="x", model_type="phi3", config={**small, "pad_token_id": None}),
                            vocab_size=64)
    assert model.get_input_embeddings().padding_idx is None
