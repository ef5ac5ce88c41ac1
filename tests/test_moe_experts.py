"""Dropless grouped experts and ``merak_ep`` on one process: the core against the family's eager loop,
every named family swapped against the unswapped model, load statistics, and refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_merak.plugins.moe.core.dispatch import ExchangeLayout
from lightning_merak.plugins.moe.core.placement import Padding, PlacementPlan
from lightning_merak.plugins.moe.experts import (
    EXACT_FAMILIES,
    FAMILY_CONFIGS,
    DroplessExchange,
    enable_expert_parallel,
    enable_grouped_experts,
    expert_load,
    family_support,
    grouped_experts_forward,
    grouped_mm_applies,
    local_expert_range,
    plan_replicas,
    tiny_moe_model,
)
from lightning_merak.plugins.moe.experts.grouped import expert_mlp

TOL = 1e-5


def _experts(num_experts: int, hidden: int = 32, intermediate: int = 16, seed: int = 0) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=num_experts)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    module = MixtralExperts(config)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.2)
        module.down_proj.normal_(0, 0.2)
    return module


def _routing(tokens: int, num_experts: int, k: int, hidden: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    scores = torch.randn(tokens, num_experts, generator=gen)
    weights, index = torch.softmax(scores, -1).topk(k, dim=-1)
    return x, index, weights


def _grads(module: torch.nn.Module, x: torch.Tensor, weights: torch.Tensor, fn) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    module.zero_grad()
    out = fn(x, weights)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach(), x.grad, weights.grad, module.gate_up_proj.grad.clone(), module.down_proj.grad.clone()]


@pytest.mark.parametrize("k,num_experts", [(1, 4), (2, 8), (8, 16)])
@pytest.mark.parametrize("use_grouped_mm", [False, None])
def test_grouped_core_equals_eager_loop(k: int, num_experts: int, use_grouped_mm: bool | None) -> None:
    module = _experts(num_experts)
    x, index, weights = _routing(40, num_experts, k, 32)
    eager = _grads(module, x, weights, lambda x, w: module(x, index, w))

    def grouped(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if use_grouped_mm is None:
            return grouped_experts_forward(module, x, index, w)
        order = torch.sort(index.reshape(-1), stable=True).indices
        counts = torch.bincount(index.reshape(-1), minlength=num_experts).tolist()
        out = expert_mlp(module, x[order // k], counts, index.reshape(-1)[order], use_grouped_mm=use_grouped_mm)
        routes = out.new_zeros(out.shape).index_copy(0, order, out)
        return (routes * w.reshape(-1, 1)).view(40, k, -1).sum(1)

    for a, b in zip(eager, _grads(module, x, weights, grouped)):
        torch.testing.assert_close(b, a, atol=TOL, rtol=0)


def test_grouped_mm_detection_respects_alignment() -> None:
    weight_t = torch.randn(4, 32, 16)
    assert not grouped_mm_applies(torch.randn(10, 31), torch.randn(4, 31, 16))  # 124-byte rows
    assert not grouped_mm_applies(torch.randn(0, 32), weight_t)
    assert not grouped_mm_applies(torch.randn(10, 32, dtype=torch.float64), weight_t)


def test_exchange_matches_dispatch_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 6, (4, 8), generator=gen)
    counts[2, 2:4] = 0  # a rank owning experts it receives nothing for
    for rank in range(4):
        ours = DroplessExchange.build(counts, rank)
        theirs = ExchangeLayout.build(rank, counts.tolist(), PlacementPlan(8, 4), Padding("dropless"), 2, 1)
        assert ours.send_splits == theirs.send_splits[0]
        assert ours.recv_splits == theirs.recv_splits[0]
        assert ours.expert_rows == theirs.expert_rows[0]
        assert torch.equal(ours.recv_to_expert_major, theirs.recv_by_expert[0])


def test_local_expert_range_is_contiguous_and_checked() -> None:
    assert [local_expert_range(64, r, 4) for r in range(4)] == [range(16 * r, 16 * (r + 1)) for r in range(4)]
    with pytest.raises(ValueError, match="divides 10"):
        local_expert_range(10, 0, 4)
    with pytest.raises(ValueError, match="not a rank"):
        local_expert_range(8, 2, 2)


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", EXACT_FAMILIES)
@pytest.mark.parametrize("switch", ["merak_ep", "merak_grouped"])
def test_family_swap_equals_unswapped(family: str, switch: str) -> None:
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    assert_swap_equals_unswapped(tiny_moe_model(family), switch, ids)


def assert_swap_equals_unswapped(reference: torch.nn.Module, switch: str, ids: torch.Tensor) -> None:
    """A copy of ``reference`` switched to ``switch`` (one process) gives its logits and gradients."""
    swapped = copy.deepcopy(reference)
    if switch == "merak_ep":
        report = enable_expert_parallel(swapped)
        assert report.ep_size == 1 and report.expert_params_after == report.expert_params_before
    else:
        enable_grouped_experts(swapped)
    assert swapped.config._experts_implementation == switch
    ref_logits, ref_grads = _step(reference, ids)
    logits, grads = _step(swapped, ids)
    torch.testing.assert_close(logits, ref_logits, atol=TOL, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=TOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_expert_load_counts_every_route_and_plans() -> None:
    from lightning_merak.plugins.moe import CommCurve, CostModel

    model = tiny_moe_model("qwen3_moe")
    enable_expert_parallel(model)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    model(ids)
    model(ids)
    loads = expert_load(model)
    assert len(loads) == 2
    for counts in loads.values():
        assert counts.shape == (1, 16) and int(counts.sum()) == 2 * 24 * 8
    assert all(int(c.sum()) == 0 for c in expert_load(model).values())  # reset
    curve = CommCurve((1024.0,), (1e-4,))
    cost = CostModel(curve, curve, expert_tokens_per_s=1e6, bytes_per_token=256, expert_param_bytes=4096,
                     experts_per_rank=16)
    plans = plan_replicas(loads, cost)
    assert all(plan.num_experts == 16 and plan.replications == () for plan in plans.values())  # one rank: none

    hot = {"layer": torch.tensor([[400, 10, 10, 10], [400, 10, 10, 10]])}  # expert 0 (rank 0's) is hot
    cost = CostModel(curve, curve, expert_tokens_per_s=1e5, bytes_per_token=256, expert_param_bytes=4096,
                     experts_per_rank=2)
    for policy in ("pro_prophet", "shadowing"):
        (replication,) = plan_replicas(hot, cost, policy)["layer"].replications
        assert (replication.expert, replication.owner, replication.replicas) == (0, 0, (1,))


def test_refusals_name_the_reason() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4))
    assert family_support(dense)[0] is False
    with pytest.raises(ValueError, match="no experts module goes through"):
        enable_expert_parallel(dense)

    model = tiny_moe_model("mixtral")
    model.config.model_type = "dbrx"
    with pytest.raises(ValueError, match="refused for dbrx: its experts run their own loop"):
        enable_expert_parallel(model)
    model.config.model_type = "mixtral"
    enable_expert_parallel(model)
    with pytest.raises(ValueError, match="already expert parallel"):
        enable_expert_parallel(model)


def test_ep_without_shard_names_the_fix() -> None:
    model = tiny_moe_model("mixtral")
    from lightning_merak.plugins.moe.experts.parallel import register

    register()
    model.set_experts_implementation("merak_ep")
    with pytest.raises(RuntimeError, match="enable_expert_parallel"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_family_configs_cover_the_named_families() -> None:
    assert set(FAMILY_CONFIGS) == set(EXACT_FAMILIES)
    for family in ("qwen3_moe", "olmoe", "deepseek_v3"):
        assert tiny_moe_model(family).config.num_experts_per_tok == 8


def test_replica_plans_are_checked_against_the_layer() -> None:
    from lightning_merak.plugins.moe.core.placement import PlacementPlan, Replication
    from lightning_merak.plugins.moe.experts import experts_modules, set_replica_plans

    model = tiny_moe_model("mixtral")
    enable_expert_parallel(model)
    name = experts_modules(model)[0][0]
    with pytest.raises(ValueError, match="no experts module named"):
        set_replica_plans(model, {"nope": PlacementPlan(8, 1)})
    with pytest.raises(ValueError, match="for 8 experts on 2 ranks"):
        set_replica_plans(model, {name: PlacementPlan(8, 2, (Replication(0, 0, (1,)),))})
    set_replica_plans(model, {name: PlacementPlan(8, 1)})
    set_replica_plans(model, None)


def test_callback_refuses_strategies_other_than_ddp() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback

    class Merak3DStrategy:
        pass

    with pytest.raises(ValueError, match="not Merak3DStrategy.*use strategy=ddp"):
        ExpertParallelCallback().setup(SimpleNamespace(strategy=Merak3DStrategy()), None, "fit")
    with pytest.raises(ValueError, match="not DeepSpeedStrategy.*use strategy=ddp"):  # a DDPStrategy subclass
        ExpertParallelCallback().setup(SimpleNamespace(strategy=DeepSpeedStrategy()), None, "fit")
    for strategy in (DDPStrategy(), SingleDeviceStrategy(torch.device("cpu"))):  # no process group: nothing to do
        ExpertParallelCallback().setup(SimpleNamespace(strategy=strategy), None, "fit")


def test_permutation_gathers_both_ways_and_sentinel_routes_get_zeros() -> None:
    from lightning_merak.plugins.moe.experts.grouped import permute_rows, restore_route_order

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 4, generator=gen, requires_grad=True)
    index = torch.randperm(7, generator=gen)
    upstream = torch.randn(7, 4, generator=gen)
    (permute_rows(rows, index) * upstream).sum().backward()
    expected = rows.detach().clone().requires_grad_()
    (expected[index] * upstream).sum().backward()
    assert torch.equal(permute_rows(rows, index), expected[index]) and torch.equal(rows.grad, expected.grad)
    with pytest.raises(ValueError, match="permutation of 7 rows"):
        permute_rows(rows, index[:3])
    flat = torch.tensor([2, 9, 0, 2])  # expert 9 is a sentinel past 4 experts: sorts last, never computed
    order = torch.sort(flat, stable=True).indices
    computed = torch.arange(3.0).view(3, 1)  # outputs of the routes to experts 0, 2, 2 in sorted order
    assert restore_route_order(computed, order).view(-1).tolist() == [1.0, 0.0, 0.0, 2.0]
    assert restore_route_order(torch.arange(4.0).view(4, 1), order).view(-1).tolist() == [1.0, 3.0, 0.0, 2.0]


def test_intermediate_sets_every_intermediate_size() -> None:
    config = tiny_moe_model("qwen2_moe", intermediate=48).config
    assert config.intermediate_size == config.moe_intermediate_size == config.shared_expert_intermediate_size == 48
    assert tiny_moe_model("mixtral", intermediate=48).config.intermediate_size == 48


def test_expert_ids_for_biases_follow_from_counts() -> None:
    module = _experts(4)
    module.has_bias = True
    module.gate_up_proj_bias = torch.nn.Parameter(torch.randn(4, 32, generator=torch.Generator().manual_seed(1)))
    module.down_proj_bias = torch.nn.Parameter(torch.randn(4, 32, generator=torch.Generator().manual_seed(2)))
    rows, counts = torch.randn(9, 32, generator=torch.Generator().manual_seed(3)), [3, 0, 4, 2]
    explicit = expert_mlp(module, rows, counts, torch.tensor([0, 0, 0, 2, 2, 2, 2, 3, 3]))
    assert torch.equal(expert_mlp(module, rows, counts), explicit)
    assert not torch.equal(explicit, expert_mlp(module, rows, counts, torch.zeros(9, dtype=torch.long)))
