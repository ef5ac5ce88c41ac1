"""The planner prices ``merak_ep`` (#30 item 4): each MoE layer's all-to-all (dispatch + combine, forward and
backward) over the expert group's link, and the E/ep experts a rank keeps, against hand-computed figures."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_merak.planning.planner import (
    BlockTimes,
    CollectiveCost,
    Layout,
    ModelProfile,
    NetworkProfile,
    SearchSpace,
    candidate_layouts,
    predict,
)
from lightning_merak.planning.planner.experts import ExpertLayers

# 4 experts, top-2, hidden 8, 16 tokens per sample, fp32; one MoE block whose experts weigh 400 of its 500 bytes
EXPERTS = ExpertLayers(num_experts=4, top_k=2, hidden_size=8, tokens_per_sample=16, moe_blocks=1,
                       expert_parameter_bytes=400)
_LINK = CollectiveCost(latency_s=0.1, bandwidth_bytes_per_s=100.0)
_FAST_EXCHANGE = CollectiveCost(latency_s=0.01, bandwidth_bytes_per_s=1000.0)
_SLOW_EXCHANGE = CollectiveCost(latency_s=0.01, bandwidth_bytes_per_s=10.0)
SPACE = SearchSpace(world_size=2, global_batch_size=4, tp_degrees_allowed=(1,), max_pipeline_stages=1)


def _profile(experts: ExpertLayers | None = EXPERTS) -> ModelProfile:
    return ModelProfile(
        num_blocks=1, hidden_bytes_per_sample=100, block_times={(1, 2): BlockTimes((1.0,), (3.0,))},
        prefix_times={2: (0.5, 0.25)}, suffix_times={2: (1.0, 2.0)}, block_parameter_bytes={1: 500},
        prefix_parameter_bytes=10, suffix_parameter_bytes=30, block_activation_bytes_per_sample={1: 1000},
        optimizer_s_per_parameter_byte=0.01, experts=experts)


def _network(exchange: CollectiveCost) -> NetworkProfile:
    return NetworkProfile(all_reduce={2: _LINK}, p2p=_LINK, all_to_all={2: exchange})


def test_exchange_bytes_are_tokens_times_top_k_times_hidden_times_dtype_over_the_other_ranks() -> None:
    # 2 samples x 16 tokens x top-2 x hidden 8 x 4 bytes x (2 - 1)/2 = 1024 bytes per direction
    assert EXPERTS.all_to_all_bytes(2, 2) == 1024
    assert EXPERTS.all_to_all_bytes(2, 4) == 1536  # (4 - 1)/4 of 2048
    assert EXPERTS.all_to_all_bytes(2, 1) == 0
    # forward: counts all-gather (1 x 4 experts x 8 bytes: 0.01 + 0.032) + dispatch + combine (0.01 + 1.024 each)
    forward_s, backward_s = EXPERTS.layer_exchange_s(2, 2, _FAST_EXCHANGE)
    assert forward_s == pytest.approx(0.042 + 2 * 1.034)
    assert backward_s == pytest.approx(2 * 1.034)
    assert EXPERTS.layer_exchange_s(2, 1, _FAST_EXCHANGE) == (0.0, 0.0)


def test_prediction_adds_the_exchange_and_keeps_one_ep_th_of_the_experts() -> None:
    ep2 = predict(Layout(2, 1, 1, 1, 1, 0.0, ep=2), _profile(), _network(_FAST_EXCHANGE), SPACE)
    # compute: forward [0.5 + 1, 1] + backward [2 + 3, 0.25] = 7.75; exchange 2.110 + 2.068
    assert ep2.components["compute"] == pytest.approx(7.75)
    assert ep2.components["expert_all_to_all"] == pytest.approx(4.178)
    assert ep2.components["exposed_tp_comm"] == pytest.approx(0.0)
    # parameters 10 + 500 + 30 - 200 (half the experts) = 340; dense 140 all-reduced over 2 ranks: 0.1 + 140/100;
    # the experts' slices have no other holder (dp/ep = 1)
    assert ep2.memory_components == pytest.approx({"parameters": 340, "gradients": 340, "optimizer_state": 680,
                                                   "activations": 2 * 1000})
    assert ep2.components["dp_allreduce"] == pytest.approx(1.5)
    assert ep2.components["optimizer"] == pytest.approx(3.4)
    assert ep2.step_time_s == pytest.approx(7.75 + 4.178 + 1.5 + 3.4)
    assert ep2.step_time_s == pytest.approx(sum(ep2.components.values()))

    ep1 = predict(Layout(2, 1, 1, 1, 1, 0.0), _profile(), _network(_FAST_EXCHANGE), SPACE)
    # every rank keeps all experts: no exchange; their 400 bytes are summed over both ranks after the backward
    assert ep1.components["expert_all_to_all"] == 0.0
    assert ep1.memory_components["parameters"] == 540
    assert ep1.components["dp_allreduce"] == pytest.approx(1.5 + (0.1 + 2 * 0.5 * 400 / 100))


def test_a_slow_expert_link_makes_expert_parallelism_the_slower_layout() -> None:
    """The exchange is priced on the expert group's link: on a slow one ep=2 loses to keeping every expert, on a
    fast one it wins (it skips the experts' all-reduce), and without the exchange it would always win."""
    slow, fast = _network(_SLOW_EXCHANGE), _network(_FAST_EXCHANGE)
    ep1, ep2 = Layout(2, 1, 1, 1, 1, 0.0), Layout(2, 1, 1, 1, 1, 0.0, ep=2)
    slow_ep2 = predict(ep2, _profile(), slow, SPACE)
    # each direction 0.01 + 1024/10 s, the counts 0.01 + 32/10 s: four directions and the counts
    assert slow_ep2.components["expert_all_to_all"] == pytest.approx(4 * 102.41 + 3.21)
    assert slow_ep2.step_time_s > predict(ep1, _profile(), slow, SPACE).step_time_s
    assert predict(ep2, _profile(), fast, SPACE).step_time_s < predict(ep1, _profile(), fast, SPACE).step_time_s
    free = slow_ep2.step_time_s - slow_ep2.components["expert_all_to_all"]
    assert free < predict(ep1, _profile(), slow, SPACE).step_time_s


def test_without_a_measured_all_to_all_the_all_reduce_link_stands_in() -> None:
    network = NetworkProfile(all_reduce={2: _LINK}, p2p=_LINK)
    prediction = predict(Layout(2, 1, 1, 1, 1, 0.0, ep=2), _profile(), network, SPACE)
    assert prediction.components["expert_all_to_all"] == pytest.approx(4 * (0.1 + 10.24) + 0.1 + 0.32)


def test_a_model_without_expert_layers_is_priced_as_before() -> None:
    dense = predict(Layout(2, 1, 1, 1, 1, 0.0, ep=2), _profile(None), _network(_FAST_EXCHANGE), SPACE)
    assert dense.components["expert_all_to_all"] == 0.0
    assert dense.memory_components["parameters"] == 540
    assert dense.components["dp_allreduce"] == pytest.approx(0.1 + 540 / 100)


def test_the_search_takes_the_expert_parallel_size_of_each_data_parallel_degree() -> None:
    space = SearchSpace(world_size=4, global_batch_size=8, tp_degrees_allowed=(1,), max_pipeline_stages=2,
                        ep_size=None)
    assert {(layout.dp, layout.ep) for layout in candidate_layouts(space)} == {(4, 4), (2, 2)}
    fixed = dataclasses.replace(space, ep_size=4)
    assert {(layout.dp, layout.ep) for layout in candidate_layouts(fixed)} == {(4, 4)}


def test_layouts_the_runtime_cannot_run_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="ep=3 does not divide dp=2"):
        Layout(2, 1, 1, 1, 1, 0.0, ep=3)
    with pytest.raises(ValueError, match="does not divide the 4 experts"):
        predict(Layout(8, 1, 1, 1, 1, 0.0, ep=8), _profile(), _network(_FAST_EXCHANGE),
                dataclasses.replace(SPACE, world_size=8, global_batch_size=16))
    with pytest.raises(ValueError, match="data_parallel_sharding='none' only"):
        predict(Layout(2, 1, 1, 1, 1, 0.0, "optimizer", ep=2), _profile(), _network(_FAST_EXCHANGE),
                dataclasses.replace(SPACE, sharding_modes=("optimizer",)))
    with pytest.raises(ValueError, match="top_k=8 exceeds num_experts=4"):
        dataclasses.replace(EXPERTS, top_k=8)


def test_moe_layers_where_the_model_has_them_are_counted_per_stage() -> None:
    """A family whose first blocks are dense (DeepSeek's first_k_dense_replace) has its MoE layers on the later
    stages: the profile names their trunk positions and each stage counts its own."""
    placed = dataclasses.replace(EXPERTS, moe_blocks=2, block_indices=(2, 3))
    assert [placed.stage_layers(first, 2, 4) for first in (0, 2)] == [0, 2]
    assert [EXPERTS.stage_layers(first, 2, 4) for first in (0, 2)] == [0.5, 0.5]  # no positions: an even spread
    with pytest.raises(ValueError, match="must name moe_blocks=2 distinct"):
        dataclasses.replace(EXPERTS, moe_blocks=2, block_indices=(1, 1))


def test_the_profile_reads_the_moe_layers_from_the_model() -> None:
    from lightning_merak.planning.measure.experts import expert_layers_of, grouped_experts
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    model = tiny_moe_model("deepseek_v3", hidden=32, layers=3, vocab=64)  # block 0 dense, 16 experts, top-8
    experts = model.model.layers[1].mlp.experts
    layers = expert_layers_of(model, tokens_per_sample=8, hidden_bytes_per_sample=8 * 32 * 4)
    assert (layers.num_experts, layers.top_k, layers.hidden_size, layers.moe_blocks) == (16, 8, 32, 2)
    assert layers.block_indices == (1, 2) and layers.dtype_bytes == 4
    assert layers.expert_parameter_bytes == 4 * (experts.gate_up_proj.numel() + experts.down_proj.numel())
    original = experts.config._experts_implementation
    with grouped_experts(model):  # the profiler times merak_ep's local grouped core, then the model is as it was
        assert experts.config._experts_implementation == "merak_grouped"
    assert experts.config._experts_implementation == original


def test_the_search_asks_for_the_expert_groups_links_and_leaves_out_uneven_expert_splits() -> None:
    from lightning_merak.planning.planner import plan, required_profile_keys

    space = SearchSpace(world_size=4, global_batch_size=8, tp_degrees_allowed=(1,), max_pipeline_stages=2,
                        ep_size=None)
    keys = required_profile_keys(space)
    assert keys.all_to_all_group_sizes == {2, 4} and {2, 4} <= keys.all_reduce_group_sizes
    assert required_profile_keys(dataclasses.replace(space, ep_size=1)).all_to_all_group_sizes == frozenset()
    profile = dataclasses.replace(
        _profile(dataclasses.replace(EXPERTS, num_experts=2, top_k=1)),
        block_times={(1, 2): BlockTimes((1.0,), (3.0,)), (1, 1): BlockTimes((0.5,), (1.5,))},
        prefix_times={2: (0.5, 0.25), 1: (0.25, 0.125)}, suffix_times={2: (1.0, 2.0), 1: (0.5, 1.0)})
    network = NetworkProfile(all_reduce={2: _LINK, 4: _LINK}, p2p=_LINK, all_to_all={2: _FAST_EXCHANGE})
    ranked = plan(space, profile, network).ranked  # ep=4 would split 2 experts over 4 ranks: left out
    assert {(p.layout.dp, p.layout.pp, p.layout.ep) for p in ranked} == {(4, 1, 1), (4, 1, 2), (2, 2, 1), (2, 2, 2)}
    with pytest.raises(ValueError, match="divides the 2 experts; set moe.ep_size"):
        plan(dataclasses.replace(space, max_pipeline_stages=1, ep_size=4), profile, network)
