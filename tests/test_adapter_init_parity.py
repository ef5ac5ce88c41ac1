"""Adapters built on the meta device (merak3d) start from the adapter weights the eager build (DDP) draws.

The eager build draws an adapter's weights where PEFT injects it, in the CPU generator's stream after the base
model's init (or after a pretrained load, which draws nothing); a meta build attached in that stream records where
and draws the same values when each rank materialises its part, in any order, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

from lightning_merak.adapters.meta import AFTER_MATERIALIZE, attach_on_meta
from lightning_merak.cli.options.adapter import LoRAAdapterConfig, QAHiRAAdapterConfig, QBaRAAdapterConfig, Quantization
from lightning_merak.hf import pretrained_causal_lm
from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.materialize import Materializer, init_owners, meta_device

SEED, VOCAB = 11, 64
TARGETS = ["q_proj", "v_proj", "down_proj"]
LLAMA = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False})
MIXTRAL = ModelConfig(name="mixtral", model_type="mixtral", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False})
NONE = Quantization.none
OPTIONS: dict[str, Callable[[], Any]] = {
    "lora": lambda: LoRAAdapterConfig(r=4, quantization=NONE, target_modules=TARGETS),
    "lora-embedding": lambda: LoRAAdapterConfig(r=4, quantization=NONE, target_modules=[*TARGETS, "embed_tokens"]),
    "qbara": lambda: QBaRAAdapterConfig(r=2, quantization=NONE, target_modules=TARGETS),
    "qahira-kaiming": lambda: QAHiRAAdapterConfig(r=2, quantization=NONE, group_size=16, lambda_in=16,
                                                  init="kaiming", target_modules=TARGETS),
    # quantised bases: the whole model (DDP) is quantised before its adapters draw, a meta one after materialising
    "lora-nf4": lambda: LoRAAdapterConfig(r=4, quantization=Quantization.nf4, target_modules=TARGETS),
    "lora-int8": lambda: LoRAAdapterConfig(r=4, quantization=Quantization.int8, target_modules=TARGETS),
    "qbara-nf4": lambda: QBaRAAdapterConfig(r=2, quantization=Quantization.nf4, target_modules=TARGETS),
    "qahira-int4": lambda: QAHiRAAdapterConfig(r=2, quantization=Quantization.int4, group_size=16, lambda_in=16,
                                               init="kaiming", target_modules=TARGETS),
}
EXPERT_OPTIONS: dict[str, Callable[[], Any]] = {
    "lora-experts": lambda: LoRAAdapterConfig(r=4, quantization=NONE, target_modules=["q_proj"], experts=True),
    "qbara-experts": lambda: QBaRAAdapterConfig(r=2, quantization=NONE, target_modules=["q_proj"], experts=True),
    "qahira-experts": lambda: QAHiRAAdapterConfig(r=2, quantization=NONE, group_size=16, lambda_in=16,
                                                  init="kaiming", target_modules=["q_proj"], experts=True),
}


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach() for name, param in model.named_parameters() if param.requires_grad}


def _eager(option: Any, base: Callable[[], nn.Module]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """DDP's adapter weights: the model built whole after the seed, adapted; and the generator state after."""
    torch.manual_seed(SEED)
    model = option.apply(base())
    return _trainable(model), torch.get_rng_state()


def _meta(option: Any, base: Callable[[], nn.Module],
          load: Optional[Callable[[nn.Module], None]] = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """merak3d's: built and adapted on meta after the seed, then materialised part by part (last part first,
    other draws in between) as pipeline stages materialise, and the base loaded by ``load``."""
    torch.manual_seed(SEED)
    with meta_device():
        model = attach_on_meta(option, base())
    after_build = torch.get_rng_state()
    torch.manual_seed(SEED + 1)
    materialize = Materializer(torch.device("cpu"), 0, init_owners(model)).materialize
    for name, child in reversed(list(model.base_model.model.named_children())):
        materialize(child, f"base_model.model.{name}")
    materialize(model, "")
    if load is not None:
        load(model)
    getattr(model, AFTER_MATERIALIZE)(model)  # the deferred quantisation
    return _trainable(model), after_build


def _assert_same_adapters(eager: tuple[dict[str, torch.Tensor], torch.Tensor],
                          meta: tuple[dict[str, torch.Tensor], torch.Tensor]) -> None:
    (expected, eager_state), (actual, meta_state) = eager, meta
    assert sorted(actual) == sorted(expected)
    assert any(tensor.count_nonzero() for tensor in expected.values())  # something was drawn
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
    assert torch.equal(meta_state, eager_state)  # what the program draws next does not depend on the strategy


@pytest.mark.parametrize("option_name", sorted(OPTIONS))
def test_adapters_materialised_from_meta_equal_the_eager_build_of_a_random_model(option_name):
    _assert_same_adapters(_eager(OPTIONS[option_name](), lambda: build_causal_lm(LLAMA, VOCAB)),
                          _meta(OPTIONS[option_name](), lambda: build_causal_lm(LLAMA, VOCAB)))


@pytest.mark.parametrize("option_name", sorted(EXPERT_OPTIONS))
def test_expert_adapters_materialised_from_meta_equal_the_eager_build(option_name):
    _assert_same_adapters(_eager(EXPERT_OPTIONS[option_name](), lambda: build_causal_lm(MIXTRAL, VOCAB)),
                          _meta(EXPERT_OPTIONS[option_name](), lambda: build_causal_lm(MIXTRAL, VOCAB)))


@pytest.fixture(scope="module")
def pretrained_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(SEED + 2)
    build_causal_lm(LLAMA, VOCAB).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("option_name", ["lora", "lora-nf4", "qbara", "qahira-kaiming"])
def test_adapters_materialised_from_meta_equal_the_eager_build_of_a_pretrained_model(option_name,
                                                                                     pretrained_directory):
    """``from_pretrained`` draws nothing, and neither does the meta build of the pretrained structure."""
    def load(model: nn.Module) -> None:
        weights = pretrained_causal_lm(pretrained_directory, VOCAB).state_dict()
        model.base_model.model.load_state_dict(weights, strict=False)

    eager = _eager(OPTIONS[option_name](), lambda: pretrained_causal_lm(pretrained_directory, VOCAB))
    meta = _meta(OPTIONS[option_name](), lambda: pretrained_causal_lm(pretrained_directory, VOCAB, weights=False),
                 load)
    _assert_same_adapters(eager, meta)

