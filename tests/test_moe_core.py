"""Pure parts of the MoE plugin: planner, shadowing, cost model, layout, Lancet chunks and deferred
weight gradients, config, swap."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_merak.plugins.moe import (
    CommCurve,
    CostModel,
    MoE,
    MoEOptions,
    Padding,
    PlacementPlan,
    Replication,
    block_rows,
    carve_expert_groups,
    choose_chunks,
    pipelined_time,
    plan_pro_prophet,
    plan_shadowing,
    rank_loads,
)
from lightning_merak.plugins.moe.core.dispatch import ExchangeLayout, chunk_sizes


def _model(per_rank: int = 1, transfer_bw: float = 1e12, a2a_bw: float = 1e6, overlap: bool = True) -> CostModel:
    return CostModel(CommCurve.from_bandwidth(a2a_bw), CommCurve.from_bandwidth(transfer_bw), 1e6, 64, 4096,
                     per_rank, overlap=overlap)


HOT = [[400, 10, 10, 10]] * 4


def test_planner_replicates_the_hot_expert_to_its_senders_and_balances() -> None:
    plan = plan_pro_prophet(HOT, _model())
    assert plan.replications == (Replication(0, 0, (1, 2, 3)),)
    before = rank_loads(HOT, PlacementPlan(4, 4), Padding(), 1).computed
    after = rank_loads(HOT, plan, Padding(), 1).computed
    assert before == [1600, 40, 40, 40] and after == [400, 440, 440, 440]


def test_planner_keeps_stock_placement_when_transfers_cost_more_than_they_save() -> None:
    assert plan_pro_prophet(HOT, _model(transfer_bw=1e3, overlap=False)).replications == ()


def test_planner_stops_on_balanced_load_and_is_deterministic() -> None:
    assert plan_pro_prophet([[10, 10], [10, 10]], _model()).replications == ()
    counts = [[50, 50, 5, 5], [50, 50, 5, 5], [7, 3, 9, 1], [0, 40, 2, 2]]
    assert plan_pro_prophet(counts, _model()) == plan_pro_prophet(counts, _model())


def test_planner_exclusion_slots_and_zero_senders() -> None:
    counts = [[400, 10, 10, 10], [300, 10, 10, 10], [5, 10, 10, 10], [0, 10, 10, 10]]
    plan = plan_pro_prophet(counts, _model(), exclude_fewest=1)
    assert plan.replications[0].expert == 0 and plan.replications[0].replicas == (1,)
    budget = plan_pro_prophet([[400, 400, 1, 1]] * 4, _model(), alpha=0.1, slots_per_rank=1)
    assert budget.replications[1] == Replication(1, 1, (0,))
    assert all(sum(r in rep.replicas for rep in budget.replications) <= 1 for r in range(4))


def test_planner_with_several_experts_per_rank_picks_heaviest_remote_expert() -> None:
    counts = [[10, 80, 5, 5], [10, 90, 5, 5]]
    plan = plan_pro_prophet(counts, _model(per_rank=2))
    assert plan.replications[0] == Replication(1, 0, (1,))


def test_padded_capacity_shrinks_when_the_hot_block_is_replicated() -> None:
    counts = [[10, 10, 10, 10]] + [[400, 10, 10, 10]] * 3
    plan = PlacementPlan(4, 4, (Replication(0, 0, (1, 2, 3)),))
    assert block_rows(counts, PlacementPlan(4, 4), Padding("max"))[1] == [400, 400, 400, 400]
    assert block_rows(counts, plan, Padding("max"))[1] == [0, 10, 10, 10]
    assert block_rows(HOT, plan, Padding("max"))[1] == [0, 400, 400, 400], "the owner's own hot block still pads"
    assert block_rows(HOT, plan, Padding("fixed", 7))[2] == [0, 7, 7, 7]


def test_shadowing_broadcasts_hot_experts_to_all_ranks_and_leaves_uniform_load() -> None:
    plan = plan_shadowing(HOT, _model())
    assert plan.replications[0] == Replication(0, 0, (1, 2, 3))
    assert plan_shadowing([[10] * 4] * 4, _model()).replications == ()


def test_cost_model_terms_and_overlap() -> None:
    curve = CommCurve((1e3, 1e6), (1e-3, 1e-2))
    assert curve.time(5.005e5) == pytest.approx(5.5e-3) and curve.time(2e6) == pytest.approx(2e-2)
    plan = PlacementPlan(4, 4, (Replication(0, 0, (1, 2, 3)),))
    serial = _model(transfer_bw=1e6, overlap=False).terms(HOT, plan, Padding())
    hidden = _model(transfer_bw=1e6, overlap=True).terms(HOT, plan, Padding())
    assert serial.transfer == pytest.approx(3 * 4096 / 1e6)
    assert hidden.total < serial.total
    assert serial.total == pytest.approx(4 * serial.all_to_all + 3 * serial.expert_forward + 2 * serial.transfer)


def test_exchange_layout_places_every_route_once_and_chunks_partition_blocks() -> None:
    counts = [[3, 0, 2, 4], [1, 5, 0, 2]]
    plan = PlacementPlan(4, 2, (Replication(2, 1, (0,)),))
    layout = ExchangeLayout.build(0, counts, plan, Padding("dropless"), 2, chunks=2)
    assert [sum(s) for s in layout.send_splits] == [4, 3] and layout.num_sent == 7
    assert layout.replica_segments == [(2, 7, 2)]
    indices = torch.tensor([[0, 0, 0, 2, 2, 3, 3, 3, 3]])
    locations = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    rows = layout.route_rows(indices, locations)
    assert sorted(rows.flatten().tolist()) == list(range(9))
    assert chunk_sizes(7, 3) == [3, 2, 2]
    dropped = layout.route_rows(torch.tensor([[-1]]), torch.tensor([[0]]))
    assert dropped.item() == layout.num_rows


def test_lancet_chunk_choice_follows_the_cost_model() -> None:
    assert pipelined_time(1.0, 2.0, 1) == pytest.approx(4.0)
    assert pipelined_time(0.5, 1.0, 2) < 4.0
    counts = [[4000, 4000], [4000, 4000]]
    bandwidth_bound = CostModel(CommCurve.from_bandwidth(1e7), CommCurve.from_bandwidth(1e9), 1e6, 256, 1, 1)
    latency_bound = CostModel(CommCurve.from_bandwidth(1e12, latency_s=1.0), CommCurve.from_bandwidth(1e9), 1e6,
                              256, 1, 1)
    assert choose_chunks(bandwidth_bound, counts, PlacementPlan(2, 2), Padding()) > 1
    assert choose_chunks(latency_bound, counts, PlacementPlan(2, 2), Padding()) == 1


def test_expert_groups_are_carved_from_data_parallel_ranks() -> None:
    ep, edp = carve_expert_groups([4, 5, 6, 7, 8, 9], 3)
    assert ep == [[4, 5, 6], [7, 8, 9]] and edp == [[4, 7], [5, 8], [6, 9]]
    with pytest.raises(ValueError, match="ep_size=4 does not divide the 6"):
        carve_expert_groups(range(6), 4)


def test_bad_arguments_fail_before_work_with_the_fix() -> None:
    expert = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="ep_size=3 does not divide num_experts=8"):
        MoE(8, expert, num_experts=8, ep_size=3)
    with pytest.raises(ValueError, match="pass drop_tokens=False"):
        MoE(8, expert, num_experts=4, dispatch="dropless")
    with pytest.raises(ValueError, match="only top-1 and top-2"):
        MoE(8, expert, num_experts=4, k=3)
    with pytest.raises(ValueError, match="lancet_chunks"):
        MoEOptions(lancet_chunks=0).validate(True)
    with pytest.raises(ValueError, match="needs ep_size > 1"):
        MoE(8, expert, num_experts=4, placement="pro_prophet")


def test_swapped_mixtral_computes_the_original_function_on_one_rank() -> None:
    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from lightning_merak.modules.causal_lm import build_causal_lm
    from lightning_merak.modules.config import ModelConfig
    from lightning_merak.plugins.moe.block_replacement import SwappedSparseBlock

    config = ModelConfig(name="m", model_type="mixtral", config=dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2))
    torch.manual_seed(0)
    original = build_causal_lm(config, 50)
    torch.manual_seed(0)
    swapped = ProphetMoEConfig(ep_size=1, placement="none", lancet_chunks="1").apply(build_causal_lm(config, 50))
    assert sum(isinstance(m, SwappedSparseBlock) for m in swapped.modules()) == 2
    ids = torch.randint(0, 50, (2, 12))
    torch.testing.assert_close(swapped(input_ids=ids).logits, original(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no Mixtral-style sparse MoE block"):
        ProphetMoEConfig(ep_size=1, placement="none").apply(torch.nn.Linear(2, 2))


def test_hydra_composes_moe_options_with_mixtral_tiny() -> None:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from lightning_merak.cli.config import register_configs
    from lightning_merak.cli.options.moe import DeepSpeedMoEConfig, ProphetMoEConfig, register

    register_configs()
    register()
    with initialize_config_module("lightning_merak.conf", version_base="1.3"):
        for option, cls in (("prophet", ProphetMoEConfig), ("deepspeed", DeepSpeedMoEConfig)):
            cfg = OmegaConf.to_object(
                compose("config", overrides=[f"moe={option}", "model=mixtral_tiny", "output_dir=/tmp/unused"])
            )
            assert isinstance(cfg.moe, cls) and cfg.model.config["num_local_experts"] == 4
        with pytest.raises(Exception, match="placement_policy"):
            compose("config", overrides=["moe=prophet", "moe.placement_policy=x", "output_dir=/tmp/unused"])


class _ExpertWithNorm(nn.Module):
    """A Linear called twice plus a LayerNorm: shared weights and a parameter autograd must handle."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.norm = nn.LayerNorm(10)
        self.down = nn.Linear(10, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.norm(self.up(x))))
        return self.down(torch.tanh(self.up(h)))


@pytest.mark.parametrize("build", [lambda: nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 6)),
                                   _ExpertWithNorm])
def test_deferred_weight_grads_equal_autograd(build: Any) -> None:
    from lightning_merak.distributed.weight_gradients import SplitBackward

    experts = [build(), build()]
    params = [p for expert in experts for p in expert.parameters()]
    x = torch.randn(7, 6, requires_grad=True)
    pieces = x.split([3, 4])
    probe = torch.randn(7, 6)
    expected_y = torch.cat([expert(piece) for expert, piece in zip(experts, pieces)])
    expected = torch.autograd.grad(expected_y, [x, *params], probe)

    deferred = SplitBackward(experts)
    x2 = x.detach().requires_grad_(True)
    with deferred.recording():
        y = torch.cat([expert(piece) for expert, piece in zip(experts, x2.split([3, 4]))])
    dx = deferred.input_grad(y, x2, probe)
    assert all(call.grad_output is not None for call in deferred.calls), "a Linear output gradient was not kept"
    grads = deferred.compute(y, probe, params)
    torch.testing.assert_close(dx, expected[0])
    for param_grad, want in zip(grads, expected[1:]):
        torch.testing.assert_close(param_grad, want)
    assert all(len(m._forward_hooks) == 0 for expert in experts for m in expert.modules()), "hooks left behind"


def test_select_local_experts_keeps_this_ranks_slice() -> None:
    from lightning_merak.plugins.moe.checkpoint import expert_param_positions, select_local_experts

    prefix = "block.moe.deepspeed_moe.experts.deepspeed_experts."
    full = {f"{prefix}{e}.0.weight": torch.full((2,), float(e)) for e in range(6)}
    full["block.dense.weight"] = torch.zeros(1)
    state = dict(full)
    assert select_local_experts(state, prefix, ep_rank=1, experts_per_rank=2, num_experts=6)
    assert sorted(state) == ["block.dense.weight", f"{prefix}0.0.weight", f"{prefix}1.0.weight"]
    assert state[f"{prefix}0.0.weight"][0] == 2.0 and state[f"{prefix}1.0.weight"][0] == 3.0
    assert not select_local_experts(state, prefix, ep_rank=1, experts_per_rank=2, num_experts=6), "local passes"
    partial = {f"{prefix}{e}.0.weight": torch.zeros(1) for e in range(4)}
    with pytest.raises(ValueError, match="num_experts"):
        select_local_experts(partial, prefix, ep_rank=0, experts_per_rank=2, num_experts=6)

    expert = nn.Linear(2, 2)
    for p in expert.parameters():
        p.allreduce = False
    dense = nn.Linear(2, 2)
    groups = [{"params": list(dense.parameters())}, {"params": list(expert.parameters()), "moe": True}]
    assert expert_param_positions(groups) == [2, 3]


def test_data_parallel_groups_from_a_3d_mesh() -> None:
    from lightning_merak.plugins.moe.groups import data_parallel_groups_from_mesh

    mesh = torch.arange(8).reshape(2, 2, 2).tolist()
    groups = data_parallel_groups_from_mesh(mesh, ["pp", "dp", "tp"])
    assert groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert carve_expert_groups(groups[2], 2) == ([[4, 6]], [[4], [6]])
    assert data_parallel_groups_from_mesh(torch.arange(4).reshape(2, 2, 1).tolist(), ["pp", "dp", "tp"]) == [
        [0, 1], [2, 3]]
    with pytest.raises(ValueError, match="'dp'"):
        data_parallel_groups_from_mesh(mesh, ["pp", "x", "tp"])


def test_moe_param_groups_split_experts_for_zero() -> None:
    from lightning_merak.plugins.moe import moe_param_groups

    model = nn.ModuleDict({
        "dense": nn.Linear(4, 4),
        "moe": MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=2, ep_size=1, k=1),
    })
    model["dense"].bias.requires_grad_(False)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = moe_param_groups([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    expert_ids = {id(p) for p in model["moe"].deepspeed_moe.experts.parameters()}
    seen = [id(p) for group in groups for p in group["params"]]
    assert len(seen) == len(set(seen)) == sum(p.requires_grad for p in model.parameters())
    for group in groups:
        is_expert = {id(p) in expert_ids for p in group["params"]}
        assert is_expert == {bool(group.get("moe"))}, "a group mixes expert and dense parameters"
        if group.get("moe"):
            assert group["name"] == model["moe"].expert_group_name
    assert {g["weight_decay"] for g in groups if g.get("moe")} == {0.1, 0.0}, "options must carry over"
    with pytest.raises(ValueError, match="no parameters"):
        moe_param_groups([])
