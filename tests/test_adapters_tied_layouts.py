"""Adapters at layouts the tensor-parallel split meets in odd shapes: a tied embedding / LM head pair cut apart by
the pipeline, bases that subclass ``nn.Linear`` (Falcon), fused layers a pooled adapter cannot cross."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch import nn

import tests.test_adapters_meta as adapters_meta
from lightning_merak.cli.options.adapter import LoRAAdapterConfig, QBaRAAdapterConfig, Quantization
from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.data.gradients import TiedParameter
from lightning_merak.parallel.pipeline.stage import RemovedModule
from lightning_merak.parallel.tensor.split_adapter import shared_split_problem
from lightning_merak.parallel.tensor.vocab import keep_tied_vocabulary_whole, vocabulary_modules
from lightning_merak.strategies.merak3d import build
from lightning_merak.testing import assert_traces_match, merge_rank_traces, run_distributed
from tests.test_adapters_tp import _load_counting_local_bytes
from tests.test_merak3d import VOCAB

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
QWEN2_TIED = ModelConfig(name="qwen2", model_type="qwen2", config={**SMALL, "tie_word_embeddings": True})
HEAD_LORA = "tied-head-lora"
PP2_TP2 = {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 2, "partition": "uniform"}
STEPS = 2  # the hunt's run differed from the first step on


def _qwen2_tied() -> nn.Module:
    torch.manual_seed(0)
    model = build_causal_lm(QWEN2_TIED, vocab_size=VOCAB)
    model.config.use_cache = False
    return model


def _head_lora() -> LoRAAdapterConfig:
    return LoRAAdapterConfig(r=4, quantization=Quantization.none, target_modules=["q_proj", "v_proj", "lm_head"])


@contextlib.contextmanager
def _tied_qwen2_patches() -> Iterator[None]:
    """``tests.test_adapters_meta``'s paths, on a tied Qwen2 with LoRA on its LM head."""
    with (mock.patch.object(adapters_meta, "_base", _qwen2_tied),
          mock.patch.dict(adapters_meta.OPTIONS, {HEAD_LORA: _head_lora})):
        yield


def _tied_rank(rank: int, world_size: int) -> tuple:
    with _tied_qwen2_patches(), mock.patch.object(adapters_meta._MetaAdapterModule, "load_pretrained_weights",
                                                  _load_counting_local_bytes):
        trace, _ = adapters_meta._meta_rank(rank, world_size, HEAD_LORA, PP2_TP2, last_step=STEPS)
    return trace


@pytest.mark.distributed
def test_a_tied_lm_head_with_lora_at_pp2_tp2_trains_like_one_process():
    """Stage 0 holds the embedding, stage 1 the adapted head: both keep the tied pair whole, as one process does."""
    results = run_distributed(_tied_rank, 4, timeout_s=120)
    with _tied_qwen2_patches():
        reference, _ = adapters_meta._reference(HEAD_LORA, steps=STEPS)
    assert_traces_match(reference, merge_rank_traces(results), loss_rtol=1e-6, grad_rtol=1e-5)


def test_each_stage_of_a_tied_pair_keeps_it_whole_when_one_side_carries_an_adapter():
    """The decision is taken on the whole model; the first stage's copy (embedding only) then splits nothing."""
    model = _head_lora().apply(_qwen2_tied())
    assert keep_tied_vocabulary_whole(model)
    first_stage = copy.deepcopy(model)
    first_stage.base_model.model.set_submodule("lm_head", RemovedModule("lm_head"))
    embedding, head, whole = vocabulary_modules(first_stage)
    assert (embedding, head) == (None, None)
    assert whole == ["Embedding (tied to Linear with a PEFT adapter)"]

    plain = _qwen2_tied()
    assert not keep_tied_vocabulary_whole(plain)
    plain.set_submodule("lm_head", RemovedModule("lm_head"))
    assert vocabulary_modules(plain)[:2] == ("model.embed_tokens", None)


class _Stages(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.embedding = nn.Embedding(*weight.shape)
        self.embedding.weight = weight

    def original_name(self, name: str) -> str:
        return f"model.{name}"


def test_tied_copies_of_different_local_shapes_are_refused_before_any_copy_or_sum():
    """Were one stage's copy split by vocabulary and the other whole, the broadcast would copy a shard into the
    whole table: refused, naming the parameter and both shapes."""
    weight = nn.Parameter(torch.zeros(48, 32))
    stages = _Stages(weight)
    tied = [TiedParameter(object(), weight, True)]

    def other_stage_whole(sides: list, side: tuple, group: object) -> None:
        sides[:] = [side, ("last", (96, 32))]

    with (mock.patch.object(build.dist, "get_world_size", return_value=2),
          mock.patch.object(build.dist, "all_gather_object", other_stage_whole),
          mock.patch.object(build.dist, "broadcast") as broadcast,
          pytest.raises(ValueError, match=r"tied parameter model\.embedding\.weight holds local shape \[48, 32\] on "
                                          r"the first stage but \[96, 32\] on the last stage.*vocab_parallel=false")):
        build._start_tied_equal(tied, stages, SimpleNamespace(mesh=torch.arange(4).view(2, 1, 2)), 0)
    broadcast.assert_not_called()

    def alike(sides: list, side: tuple, group: object) -> None:
        sides[:] = [side, ("last", side[1])]

    with (mock.patch.object(build.dist, "get_world_size", return_value=2),
          mock.patch.object(build.dist, "all_gather_object", alike)):
        build.check_tied_shapes(tied, stages)


def _lora_layer(model_type: str, config: dict, targets: list[str], path: str) -> nn.Module:
    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(name=model_type, model_type=model_type, config=config), vocab_size=VOCAB)
    adapted = LoRAAdapterConfig(r=4, quantization=Quantization.none, target_modules=targets).apply(model)
    return adapted.base_model.model.get_submodule(path)


def test_lora_on_falcons_linear_subclass_splits_and_other_classes_are_refused_by_their_class():
    """FalconLinear computes ``x @ W.T + b`` as ``nn.Linear`` does; a subclass with its own forward is refused
    naming its class, not a quantisation it never had."""
    falcon = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.0,
                  attention_dropout=0.0)
    layer = _lora_layer("falcon", falcon, ["query_key_value"], "transformer.h.0.self_attention.query_key_value")
    assert type(layer.get_base_layer()).__name__ == "FalconLinear"
    assert shared_split_problem(layer, layer.lora_A) is None

    class ScaledLinear(nn.Linear):
        def forward(self, tensor: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(tensor)

    layer.base_layer = ScaledLinear(32, 96)
    problem = shared_split_problem(layer, layer.lora_A)
    assert "ScaledLinear, a layer class whose forward the split does not reproduce" in problem
    assert "quantised" not in problem


def test_a_pooled_adapter_crossing_a_fused_layers_rows_is_refused_naming_the_layer():
    """Q-BaRA with lambda_out=2 on Phi3's fused qkv_proj: the refusal says which layer."""
    from lightning_merak.parallel.tensor.pooled_adapters import ColumnParallelPooled

    phi3 = {**SMALL, "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    model = build_causal_lm(ModelConfig(name="phi3", model_type="phi3", config=phi3), vocab_size=VOCAB)
    adapted = QBaRAAdapterConfig(r=2, quantization=Quantization.none, target_modules=["qkv_proj"]).apply(model)
    layer = adapted.base_model.model.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert int(layer.lambda_out[next(iter(layer.lambda_out))]) == 2
    rows = [list(range(0, 64, 2)), list(range(1, 64, 2))]
    with pytest.raises(ValueError, match=r"column layer model\.layers\.0\.self_attn\.qkv_proj hold reordered"):
        ColumnParallelPooled(layer, SimpleNamespace(size=lambda: 2), None, rows)
