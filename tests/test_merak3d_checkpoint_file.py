"""A Lightning ``.ckpt`` file's optimizer state under merak3d: entries numbered by the saving optimizer's parameter
order become entries keyed by name, which any optimizer over the model (another order, another stage's subset)
takes back by name, as copies of the file's tensors (a memory-mapped file must not back the state)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_merak.checkpoint.sharded import ShardedCheckpointer


def _stepped(params: list[nn.Parameter]) -> torch.optim.Adam:
    optimizer = torch.optim.Adam(params, lr=0.1)
    sum(p.sum() for p in params).backward()
    optimizer.step()
    return optimizer


def test_a_file_s_optimizer_state_is_keyed_by_name_and_placed_by_name() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    saved = _stepped([model[1].weight, model[0].weight, model[0].bias]).state_dict()  # not the module's order
    checkpointer = ShardedCheckpointer(lambda: (0, (1, 1, 1)))

    named = checkpointer.named_optimizer_state(saved, ["1.weight", "0.weight", "0.bias"])
    assert named["merak3d_consolidated"] and named["param_groups"][0]["params"] == ["1.weight", "0.weight", "0.bias"]
    assert torch.equal(named["state"]["0.weight"]["exp_avg"], saved["state"][1]["exp_avg"])

    stage = torch.optim.Adam([model[0].bias, model[0].weight], lr=0.1)  # another order, no 1.weight: one stage's
    checkpointer.load_optimizer_state(stage, {**named, "param_groups": [
        {**named["param_groups"][0], "params": ["0.bias", "0.weight"]}]}, model)
    placed = stage.state[model[0].weight]["exp_avg"]
    assert torch.equal(placed, saved["state"][1]["exp_avg"])
    assert placed.untyped_storage().data_ptr() != saved["state"][1]["exp_avg"].untyped_storage().data_ptr()
    assert torch.equal(stage.state[model[0].bias]["exp_avg_sq"], saved["state"][2]["exp_avg_sq"])


def test_a_file_whose_optimizer_holds_other_parameters_is_refused_with_the_fix() -> None:
    model = nn.Linear(2, 3)
    saved = _stepped(list(model.parameters())).state_dict()
    with pytest.raises(ValueError, match="holds 2 parameters, this run's 1: resume with the configure_optimizers"):
        ShardedCheckpointer(lambda: (0, (1, 1, 1))).named_optimizer_state(saved, ["weight"])


def test_a_file_missing_experts_is_refused_before_loading() -> None:
    """A file whose fused expert tensors hold fewer experts than the model (a ``merak_ep`` DDP run's that kept rank 0's
    only) cannot be cut into any rank's experts."""
    from lightning_merak.plugins.moe.experts import enable_expert_parallel, tiny_moe_model

    holder = nn.Module()
    holder.model = tiny_moe_model("qwen3_moe", hidden=32, layers=1, vocab=64, seed=0)
    enable_expert_parallel(holder.model)  # one process: every expert local
    state = {f"model.{name}": tensor.detach().clone() for name, tensor in holder.model.state_dict().items()}
    name = "model.model.layers.0.mlp.experts.gate_up_proj"
    whole = state[name]
    state[name] = whole[: whole.shape[0] // 2]
    with pytest.raises(ValueError, match=f"{name} holds 8 experts, this model 16"):
        ShardedCheckpointer(lambda: (0, (1, 1, 1))).read_file({"state_dict": state}, holder)
    state[name] = whole
    kept = ShardedCheckpointer(lambda: (0, (1, 1, 1))).read_file({"state_dict": state}, holder)["state_dict"][name]
    assert torch.equal(kept, whole)


def test_a_muon_file_s_optimizer_state_resumes_by_name() -> None:
    """``MuonWithAdamW`` saves ``{"parts": [Muon's, AdamW's]}``, not torch's format: read as torch's over the parts'
    groups in order (the order its ``param_groups`` list them in), a resumed optimizer steps as the saved one does."""
    from lightning_merak.modules.muon import MuonWithAdamW

    def muon(model: nn.Module) -> MuonWithAdamW:
        return MuonWithAdamW([{"params": list(model.parameters())}], lr=0.02, momentum=0.95,
                             newton_schulz_dtype="float32")

    def step(model: nn.Module, optimizer: MuonWithAdamW, seed: int) -> None:
        optimizer.zero_grad()
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
        optimizer.step()

    torch.manual_seed(0)
    saving = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    saving_optimizer = muon(saving)
    for seed in range(2):
        step(saving, saving_optimizer, seed)
    saved = copy.deepcopy(saving_optimizer.state_dict())  # as read from a file: no tensor of the live state
    assert list(saved) == ["parts"]

    resumed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    resumed.load_state_dict(saving.state_dict())
    resumed_optimizer = muon(resumed)
    names = {id(param): name for name, param in resumed.named_parameters()}
    checkpointer = ShardedCheckpointer(lambda: (0, (1, 1, 1)))
    named = checkpointer.named_optimizer_state(
        saved, [names[id(param)] for group in resumed_optimizer.param_groups for param in group["params"]])
    assert [group["params"] for group in named["param_groups"]] == [["0.weight", "1.weight"], ["0.bias", "1.bias"]]
    checkpointer.load_optimizer_state(resumed_optimizer, named, resumed)
    step(saving, saving_optimizer, 2)
    step(resumed, resumed_optimizer, 2)
    for (name, expected), actual in zip(saving.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)
