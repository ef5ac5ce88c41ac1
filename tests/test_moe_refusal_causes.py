"""MoE models and options refused for their real reason, or not refused where nothing is wrong.

AfMoE's router inside the shared experts' tensor-parallel span, HunYuan-MoE and Cohere2-MoE (no router aux loss)
in pipeline stages with ``output_router_logits=True``, the MoE options named as ``merak-train``'s keys, and the
finite-number checks of the MoE options and Muon settings sharing one definition. One process, no launch.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

VOCAB = 128


def _model(model_type: str, config: dict) -> torch.nn.Module:
    from lightning_merak.modules.causal_lm import build_causal_lm
    from lightning_merak.modules.config import ModelConfig

    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(name=model_type, model_type=model_type, config=config), vocab_size=VOCAB)
    model.config.use_cache = False
    return model


def _ids() -> torch.Tensor:
    return torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


AFMOE = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
         "num_dense_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
         "num_experts_per_tok": 2, "num_shared_experts": 1, "global_attn_every_n_layers": 2, "sliding_window": 8}


def test_afmoe_tensor_parallel_is_refused_for_its_router_in_the_split_span():
    """Before launch by family; and from the plan of any block whose router reads a column group's input (the
    dense block still pairs), naming the router, not an unequal split of it."""
    from lightning_merak.parallel.pipeline.trace import trace_model
    from lightning_merak.parallel.tensor.blocks import check_tensor_parallel_degree
    from lightning_merak.strategies.merak3d.block_splits import tensor_parallel_plan
    from lightning_merak.strategies.merak3d.build import call_model

    model = _model("afmoe", AFMOE)
    with pytest.raises(ValueError, match=r"tensor_parallel=2: afmoe cannot be split .*mlp\.router\.gate.*"
                                         r"use tensor_parallel=1"):
        check_tensor_parallel_degree(model.config, 2)
    trace = trace_model(model, _ids(), call_model, profile=False)
    dense = tensor_parallel_plan(model.model.layers[0], trace)
    assert dense.row == ["self_attn.o_proj", "mlp.down_proj"]
    with pytest.raises(ValueError, match=r"^mlp\.router\.gate reads the input of the column layers that feed "
                                         r"mlp\.shared_experts\.down_proj but none of its outputs reach .*MoE router"
                                         r".*use tensor_parallel=1"):
        tensor_parallel_plan(model.model.layers[1], trace)


NO_AUX_LOSS = {
    "hunyuan_v1_moe": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "moe_topk": 2},
    "cohere2_moe": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                    "tie_word_embeddings": False},
}


@pytest.mark.parametrize("model_type", sorted(NO_AUX_LOSS))
def test_a_model_without_a_router_aux_loss_trains_in_stages_as_without_the_flag(model_type: str):
    """Its forward adds no aux loss: two stages with output_router_logits=True give the loss and gradients of the
    whole model without the flag (no refusal)."""
    from lightning_merak.parallel.pipeline.recording import find_trunk
    from lightning_merak.parallel.pipeline.router_aux import router_aux_of
    from lightning_merak.parallel.pipeline.stage import build_stage_module
    from lightning_merak.parallel.pipeline.trace import trace_model
    from lightning_merak.strategies.merak3d.build import call_model
    from lightning_merak.util.model_outputs import logits_of

    model = _model(model_type, {**NO_AUX_LOSS[model_type], "output_router_logits": True})
    ids = _ids()
    aux = router_aux_of(model, find_trunk(model)[1])
    assert aux is None
    trace = trace_model(model, ids, call_model, profile=False)
    stages = [build_stage_module(copy.deepcopy(model), trace, (0, 2), index, call_model, aux) for index in range(2)]
    outputs = (ids,)
    for stage in stages:
        outputs = stage(*outputs)
    loss = F.cross_entropy(outputs[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {stage.original_name(name): param.grad for stage in stages for name, param in stage.named_parameters()
             if param.grad is not None}

    reference = copy.deepcopy(model)
    reference.config.output_router_logits = False
    logits = logits_of(reference(ids))
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-5)
    expected_grads = {name: param.grad for name, param in reference.named_parameters() if param.grad is not None}
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, expected_grads[name], rtol=1e-4, atol=1e-6), name


def test_moe_refusals_name_the_key_the_user_typed():
    """merak-train's entry point wraps its checks in option_keys({argument: typed key}): moe.<key>, or the model's
    config key for a value read from the model; the Python API keeps the argument's name; an argument the entry
    point does not name keeps its own name."""
    from lightning_merak.plugins.moe.options import MoEOptions, check_layer_arguments, option_keys

    keys = {name: f"moe.{name}" for name in ("capacity_factor", "ep_size", "alpha", "dispatch", "drop_tokens")}
    keys["k"] = "model.config.num_experts_per_tok"
    layer = {"hidden_size": 8, "num_experts": 4, "ep_size": 2, "k": 2, "capacity_factor": math.nan,
             "eval_capacity_factor": 1.0, "min_capacity": 0, "noisy_gate_policy": None}
    with pytest.raises(ValueError, match=r"^capacity_factor=nan must be a finite number"):
        check_layer_arguments(**layer)
    with option_keys(keys):
        with pytest.raises(ValueError, match=r"^moe\.capacity_factor=nan must be a finite number"):
            check_layer_arguments(**layer)
        with pytest.raises(ValueError, match=r"^moe\.ep_size=3 does not divide num_experts=4"):
            check_layer_arguments(**{**layer, "ep_size": 3})
        with pytest.raises(ValueError, match=r"^moe\.alpha=-1 must be"):
            MoEOptions(alpha=-1).validate(drop_tokens=False)
        with pytest.raises(ValueError, match=r"^moe\.dispatch='dropless' never drops tokens; pass "
                                             r"moe\.drop_tokens=False"):
            MoEOptions(dispatch="dropless").validate(drop_tokens=True)
        with pytest.raises(ValueError, match=r"^model\.config\.num_experts_per_tok=3: only top-1 and top-2"):
            check_layer_arguments(**{**layer, "capacity_factor": 1.0, "k": 3})
    with pytest.raises(ValueError, match=r"^alpha=-1 must be"):
        MoEOptions(alpha=-1).validate(drop_tokens=False)


def test_moe_options_and_muon_settings_share_one_finite_number_check(monkeypatch):
    """Both defer to lightning_merak.util.values.is_finite_number: a number it refuses, both refuse."""
    from lightning_merak.modules import muon
    from lightning_merak.plugins.moe import options

    for module in (options, muon):
        monkeypatch.setattr(module, "is_finite_number", lambda value: False)
    with pytest.raises(ValueError, match=r"alpha=0\.25 must be a finite number"):
        options.MoEOptions().validate(drop_tokens=False)
    with pytest.raises(ValueError, match=r"Muon: lr=0\.02 must be a finite number"):
        muon._checked_muon_settings({"lr": 0.02}, ["lr"])


def test_merak_ep_refuses_an_expert_count_its_ranks_cannot_share_before_launch():
    """merak-train's merak_ep option refuses 3 experts over moe.ep_size=2 while it builds the model (before any
    rank starts), naming the key and the sizes that work."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from lightning_merak.plugins.moe.experts import expert_split_problem

    def mixtral(experts: int) -> torch.nn.Module:
        return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                num_local_experts=experts, num_experts_per_tok=2))

    with pytest.raises(ValueError, match=r"^moe\.ep_size=2 does not divide the 3 experts of a MoE layer: .*choose "
                                         r"moe\.ep_size from \[1, 3\]$"):
        ProphetMoEConfig(experts="merak_ep", ep_size=2).apply(mixtral(3))
    problem = expert_split_problem(mixtral(6), 4)  # the Python API (enable_expert_parallel) names its argument
    assert problem is not None and problem.startswith("ep_size=4 does not divide the 6 experts")
    assert problem.endswith("choose ep_size from [1, 2, 3, 6]")
    assert expert_split_problem(mixtral(4), 2) is None
    assert ProphetMoEConfig(experts="merak_ep", ep_size=2).apply(mixtral(4)) is not None


def test_a_layout_that_splits_routers_builds_a_model_without_a_router_aux_loss():
    """The layout refusals for the router aux loss (variable-length micro-batches in stages, sequence-split
    routers) are for a loss the model computes: a family without one builds with output_router_logits=True."""
    from lightning_merak.parallel.layout import Layout
    from lightning_merak.strategies.merak3d.arguments import Merak3DArguments
    from lightning_merak.strategies.merak3d.build import _router_aux

    layout = Layout(data_parallel=1, pipeline_parallel=2, tensor_parallel=2, virtual_stages=1, schedule="1f1b",
                    micro_batches=2, micro_batches_by_default=False, tp_overlap=1, recompute="none",
                    recompute_ratio=0.0)
    arguments = Merak3DArguments(pipeline_parallel=2, tensor_parallel=2, sequence_parallel=True,
                                 micro_batching="pad")
    model = _model("hunyuan_v1_moe", {**NO_AUX_LOSS["hunyuan_v1_moe"], "output_router_logits": True})
    assert _router_aux(model, arguments, layout) is None
    mixtral = _model("mixtral", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
                                 "num_experts_per_tok": 2, "output_router_logits": True})
    with pytest.raises(ValueError, match=r"output_router_logits=True with sequence_parallel=True"):
        _router_aux(mixtral, arguments, layout)
