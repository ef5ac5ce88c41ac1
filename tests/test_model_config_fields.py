"""``model.config`` fields the family's config does not declare: a misspelt one is refused naming the field meant
(transformers would keep it unread and build the family's default), another is kept with a warning."""

from __future__ import annotations

import pytest
import torch

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}


def _config(**fields: object) -> ModelConfig:
    return ModelConfig(name="test", model_type="llama", config={**SMALL, **fields})


def test_a_misspelt_field_is_refused_naming_the_field_meant():
    with pytest.raises(ValueError, match=r"model.config.num_hiden_layers is not a field of LlamaConfig .*did you "
                                         r"mean model.config.num_hidden_layers\?"):
        with torch.device("meta"):
            build_causal_lm(_config(num_hiden_layers=1), vocab_size=64)


def test_declared_fields_and_fields_transformers_takes_in_build_without_a_word(recwarn: pytest.WarningsRecorder):
    with torch.device("meta"):
        model = build_causal_lm(_config(num_hidden_layers=1, attn_implementation="eager", torch_dtype="float32"),
                                vocab_size=64)
    assert model.config.num_hidden_layers == 1
    assert not [warning for warning in recwarn if "not declared" in str(warning.message)]


def test_another_undeclared_field_is_kept_with_a_warning():
    with pytest.warns(UserWarning, match="model.config.my_flag: not declared by LlamaConfig"):
        with torch.device("meta"):
            model = build_causal_lm(_config(num_hidden_layers=1, my_flag=3), vocab_size=64)
    assert model.config.my_flag == 3

