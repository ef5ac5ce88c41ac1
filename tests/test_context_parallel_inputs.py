"""What a context-parallel model accepts from its caller, on one rank: the masks it runs exactly as transformers (or
refuses before any work), ``use_cache`` and ``generate``, ``CausalLMModule``'s router aux loss metric, and a
planned context-parallel degree no sequence or head count allows, refused with the reason (before launch where the
other degrees are fixed)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.parallel.context.model import install_context_parallel, segment_ids, trace_as_context_parallel
from lightning_merak.planning.planner import ContextAttention
from lightning_merak.planning.planner import Layout as PlannedLayout
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.strategies.merak3d.planning import dropped_context_layouts

VOCAB, BATCH, SEQ = 64, 2, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa", use_cache=False)


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**COMMON))


def _tokens() -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(model: torch.nn.Module, **inputs: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(**inputs).loss
    loss.backward()
    return float(loss), {name: param.grad.clone() for name, param in model.named_parameters()}


def _assert_as_one_process(inputs: dict[str, torch.Tensor], group) -> None:
    expected_loss, expected_grads = _loss_and_grads(_llama(), **inputs)
    model = _llama()
    install_context_parallel(model, group)
    loss, grads = _loss_and_grads(model, **inputs)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-5, msg=name)


# Masks ------------------------------------------------------------------------------------------------------------

def test_packed_positions_with_an_attention_mask_stay_one_sequence_as_in_transformers(single_rank_group) -> None:
    """transformers separates packed documents only without an attention_mask (masking_utils)."""
    tokens = _tokens()
    positions = torch.cat([torch.arange(6), torch.arange(SEQ - 6)])[None].expand(BATCH, SEQ)
    _assert_as_one_process({"input_ids": tokens, "labels": tokens, "position_ids": positions,
                            "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}, single_rank_group)


def test_padding_between_real_tokens_is_refused_before_any_work(single_rank_group) -> None:
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 5:8] = 0
    with pytest.raises(ValueError, match=r"row 1 has padding between real tokens \(positions \[5, 6, 7\]\)"):
        segment_ids(mask, None, BATCH, SEQ)
    model = _llama()
    install_context_parallel(model, single_rank_group)
    called = []
    model.model.register_forward_pre_hook(lambda *_: called.append(True))
    with pytest.raises(ValueError, match="leading or trailing padding only"):
        model(input_ids=_tokens(), attention_mask=mask, labels=_tokens())
    assert not called
    mask[1, 5:8], mask[0, :3], mask[1, -4:] = 1, 0, 0  # leading and trailing padding: supported
    assert segment_ids(mask, None, BATCH, SEQ)[:, [0, 3, SEQ - 1]].tolist() == [[0, 1, 1], [0, 0, 1]]


# use_cache and generation ------------------------------------------------------------------------------------------

def test_a_caller_passing_use_cache_false_trains_as_one_process(single_rank_group) -> None:
    tokens = _tokens()
    _assert_as_one_process({"input_ids": tokens, "labels": tokens, "use_cache": False}, single_rank_group)


def test_a_key_value_cache_while_training_is_refused_with_the_fix(single_rank_group) -> None:
    model = _llama()
    install_context_parallel(model, single_rank_group)
    with pytest.raises(ValueError, match=r"use_cache=False .*model\.eval\(\)"):
        model(input_ids=_tokens(), labels=_tokens(), use_cache=True)


def test_generate_after_installing_context_parallelism_is_the_models_own(single_rank_group) -> None:
    prompt = _tokens()[:, :7]  # 7 tokens: no split would take them
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # a left-padded prompt: transformers' own masks apply
    reference = _llama().eval()
    model = _llama()
    trace_as_context_parallel(model)  # merak3d traces first: the model's own attention is still remembered
    install_context_parallel(model, single_rank_group)
    model.eval()
    for use_cache in (True, False):
        options = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=use_cache)
        assert torch.equal(model.generate(prompt, **options), reference.generate(prompt, **options))
    assert model.config._attn_implementation == "merak_context_parallel"  # and back for training
    tokens = _tokens()
    with torch.no_grad():  # a cached forward outside generate, in eval mode: the model's own, unsplit
        cached = model(input_ids=tokens, labels=tokens, use_cache=True)
        expected = reference(input_ids=tokens, labels=tokens, use_cache=True)
    torch.testing.assert_close(cached.loss, expected.loss)
    assert cached.past_key_values is not None


# The router aux loss metric ---------------------------------------------------------------------------------------

def test_causal_lm_module_keeps_the_router_aux_loss_it_logs_under_context_parallelism(single_rank_group) -> None:
    def mixtral() -> MixtralForCausalLM:
        torch.manual_seed(0)
        return MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                                router_aux_loss_coef=0.5, **COMMON))

    tokens = _tokens()
    reference = CausalLMModule(mixtral())
    expected_loss = reference.compute_loss(tokens)
    module = CausalLMModule(mixtral())
    install_context_parallel(module.model, single_rank_group)
    loss = module.compute_loss(tokens)
    assert reference._router_aux_loss is not None and module._router_aux_loss is not None
    torch.testing.assert_close(module._router_aux_loss, reference._router_aux_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)


# A planned degree nothing can run ---------------------------------------------------------------------------------

def test_the_planner_names_why_it_dropped_the_context_layouts_the_fixed_degrees_leave() -> None:
    one_head = ContextAttention(sequence_length=30, hidden_size=32, heads=4, key_value_heads=1, head_dim=8,
                                element_bytes=4)
    assert one_head.methods(2, 1) == ()
    assert one_head.method_problem(2, 1, "ring") == ("context_parallel=2 needs a sequence length divisible by "
                                                     "2 x 2 = 4 (got 30)")
    even = ContextAttention(sequence_length=32, hidden_size=32, heads=4, key_value_heads=1, head_dim=8,
                            element_bytes=4)
    assert even.methods(2, 1) == ("ring",)
    assert "all_to_all needs context_parallel=2 to divide" in even.method_problem(2, 1, "all_to_all")
    arguments = Merak3DStrategy(data_parallel=1, context_parallel="auto", context_attention="all_to_all")._arguments
    layouts = [PlannedLayout(dp=2, pp=1, tp=1, micro_batches=1, overlap=1, recompute_ratio=0.0), PlannedLayout(
        dp=1, pp=1, tp=1, micro_batches=1, overlap=1, recompute_ratio=0.0, cp=2, context_attention="all_to_all")]
    assert dropped_context_layouts(arguments, layouts, even) == [even.method_problem(2, 1, "all_to_all")]
    assert dropped_context_layouts(arguments, layouts, one_head) == [one_head.method_problem(2, 1, "all_to_all")]


def test_auto_context_parallel_that_can_only_be_one_degree_is_refused_before_launch() -> None:
    auto = Merak3DStrategy(data_parallel=1, context_parallel="auto")
    with pytest.raises(ValueError, match=r"context_parallel='auto' can only be 2 here .*pad to a multiple of 4"):
        auto.validate_arguments(2, batch_size=4, sequence_length=30)
    auto.validate_arguments(2, batch_size=4, sequence_length=32)
    Merak3DStrategy(context_parallel="auto").validate_arguments(2, batch_size=4, sequence_length=30)  # dp planned
    ulysses = Merak3DStrategy(data_parallel=1, context_parallel="auto", context_attention="all_to_all")
    config = LlamaConfig(**{**COMMON, "num_key_value_heads": 1})
    module = CausalLMModule(LlamaForCausalLM(config))
    with pytest.raises(ValueError, match=r"can only be 2 here .*1 key/value heads"):
        ulysses.validate_before_launch(module, 2, batch_size=4, sequence_length=32)
