"""Which parameters Muon steps in ``optim=muon``: linear maps' weights and stacks of per-expert matrices; a
convolution's kernel and a stack of per-expert biases go to AdamW (a depthwise ``(channels, 1, k)`` kernel stepped as
``channels`` separate ``1 x k`` matrices would have each channel's update normalised on its own)."""

from __future__ import annotations

import torch
import transformers
from torch import nn

from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.modules.config import OptimConfig
from lightning_merak.modules.muon import MuonWithAdamW, not_linear_maps


def _model(model_type: str, **fields: int) -> nn.Module:
    config = transformers.AutoConfig.for_model(model_type, hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64, **fields)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _muon_names(model: nn.Module) -> tuple[set[str], set[str]]:
    """Names of ``model``'s parameters in the Muon and AdamW parts of the optimizer ``optim=muon`` builds."""
    module = CausalLMModule(model, optim=OptimConfig(name="muon", total_steps=10, newton_schulz_dtype="float32"))
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, MuonWithAdamW)
    names = {id(param): name for name, param in model.named_parameters()}
    muon = {names[id(param)] for param in optimizer.matrices}
    adamw = {names[id(param)] for group in optimizer.parts[1].param_groups for param in group["params"]}
    return muon, adamw


def test_a_convolution_kernel_goes_to_adamw_and_linear_maps_to_muon():
    model = _model("mamba", state_size=4)
    muon, adamw = _muon_names(model)
    assert "backbone.layers.0.mixer.conv1d.weight" in adamw
    assert {"backbone.layers.0.mixer.in_proj.weight", "backbone.layers.0.mixer.x_proj.weight",
            "backbone.layers.0.mixer.out_proj.weight"} <= muon
    assert not any(param.ndim == 3 for name, param in model.named_parameters() if name in muon)


def test_expert_stacks_stay_with_muon_and_their_bias_stacks_go_to_adamw():
    muon, adamw = _muon_names(_model("gpt_oss", num_local_experts=4))
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"} <= muon
    assert {"model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.experts.down_proj_bias"} <= adamw
    assert "model.layers.0.mlp.router.weight" in muon


def test_transformer_families_keep_every_matrix_with_muon():
    for model in (_model("llama"), _model("mixtral", num_local_experts=4), _model("gpt2")):
        assert not not_linear_maps(model)
    model = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(2, 2, 3), nn.Bilinear(3, 3, 2))
    assert not_linear_maps(model) == {id(model[1].weight), id(model[2].weight)}
