"""The layout planner knows data-parallel sharding: per-mode memory and time, and the "auto" search."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_merak.planning.planner import (
    BlockTimes,
    CollectiveCost,
    Layout,
    ModelProfile,
    NetworkProfile,
    SearchSpace,
    candidate_layouts,
    plan,
    predict,
    required_profile_keys,
)
from lightning_merak.planning.planner.cost_model import MEMORY_COMPONENTS
from lightning_merak.planning.planner.data_parallel import exposed_comm_s, model_state_bytes
from lightning_merak.planning.planner.profile import DATA_PARALLEL_SHARDING
from lightning_merak.strategies.merak3d import planning
from lightning_merak.strategies.merak3d.arguments import Merak3DArguments
from lightning_merak.testing import run_distributed

BLOCK_BYTES, ROOT_BYTES = 1000, 200
LINK = CollectiveCost(latency_s=0.0, bandwidth_bytes_per_s=1e4)
NETWORK = NetworkProfile(all_reduce={2: LINK, 4: LINK}, p2p=LINK)


def toy_profile(num_blocks: int = 16, backward_s: float = 0.2, optimizer_s_per_byte: float = 1e-9,
                **fields) -> ModelProfile:
    """``num_blocks`` blocks of 1000 parameter bytes (500 at tp=2), embedding and head of 200 bytes each."""
    samples = (1, 2, 4, 8)
    profile = ModelProfile(
        num_blocks=num_blocks,
        hidden_bytes_per_sample=4,
        block_times={(tp, n): BlockTimes((0.05, 0.05), (backward_s / 2, backward_s / 2))
                     for tp in (1, 2) for n in samples},
        prefix_times={n: (0.0, 0.0) for n in samples},
        suffix_times={n: (0.0, 0.0) for n in samples},
        block_parameter_bytes={1: BLOCK_BYTES, 2: BLOCK_BYTES // 2},
        prefix_parameter_bytes=ROOT_BYTES,
        suffix_parameter_bytes=ROOT_BYTES,
        block_activation_bytes_per_sample={1: 10, 2: 5},
        optimizer_s_per_parameter_byte=optimizer_s_per_byte,
    )
    return dataclasses.replace(profile, **fields)


def two_replicas(**fields) -> SearchSpace:
    """Two ranks, one stage, no tensor parallelism: only the sharding mode is left to choose."""
    base = {"world_size": 2, "global_batch_size": 8, "tp_degrees_allowed": (1,), "max_pipeline_stages": 1,
            "recompute_ratios": (0.0,), "sharding_modes": DATA_PARALLEL_SHARDING, "overlap_grad_reduce": True,
            "grad_bucket_bytes": 100}
    return SearchSpace(**(base | fields))


# --- memory ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "pipelined", "expected"),
    [
        ("none", False, (1000, 1000, 2000)),
        ("optimizer", False, (1000, 1000, 500)),
        ("gradients", False, (1000, 250 + 2 * 50, 500)),  # its slice and two buckets
        ("full", False, (250 + 300, 250 + 300, 500)),  # its slice and the 300 bytes gathered at once
        ("gradients", True, (1000, 1000, 500)),  # gradients accumulate whole over the micro-batches
        ("full", True, (250 + 1000, 1000, 500)),  # gathered parameters stay from forward to the last backward
    ],
)
def test_state_bytes_per_mode_by_hand(mode, pipelined, expected):
    parts = model_state_bytes(mode, 4, pipelined, 1000, 300, 50, toy_profile())
    assert (parts["parameters"], parts["gradients"], parts["optimizer_state"]) == pytest.approx(expected)


def test_one_shard_splits_nothing_and_mixed_precision_counts_master_weights_and_their_copies():
    profile = toy_profile()
    for mode in DATA_PARALLEL_SHARDING:
        assert model_state_bytes(mode, 1, False, 1000, 300, 50, profile) == model_state_bytes(
            "none", 4, False, 1000, 300, 50, profile)
    # bf16-mixed: the 1000 fp32 bytes are the master weights; autocast's 16-bit copies add half of those in use
    mixed = toy_profile(compute_copy_bytes_per_parameter_byte=0.5)
    assert model_state_bytes("none", 4, False, 1000, 300, 50, mixed)["parameters"] == pytest.approx(1500)
    assert model_state_bytes("full", 4, False, 1000, 300, 50, mixed)["parameters"] == pytest.approx(250 + 450)
    sgd = toy_profile(optimizer_bytes_per_parameter_byte=1.0)
    assert model_state_bytes("optimizer", 4, False, 1000, 300, 50, sgd)["optimizer_state"] == pytest.approx(250)


def test_predicted_bytes_of_a_toy_model_per_mode():
    profile, space = toy_profile(), two_replicas()
    # P = 16 blocks x 1000 + embedding 200 + head 200; gathered at once by FSDP2: two blocks + embedding + head
    whole, gathered, activations = 16_400, 2_400, 4 * 16 * 10  # 4 samples per replica, one micro-batch
    expected = {
        "none": (whole, whole, 2 * whole),
        "optimizer": (whole, whole, whole),
        "gradients": (whole, whole / 2 + 2 * 100, whole),
        "full": (whole / 2 + gathered, whole / 2 + gathered, whole),
    }
    for mode, (parameters, gradients, optimizer_state) in expected.items():
        prediction = predict(Layout(2, 1, 1, 1, 1, 0.0, mode), profile, NETWORK, space)
        assert prediction.memory_components == pytest.approx({
            "parameters": parameters, "gradients": gradients, "optimizer_state": optimizer_state,
            "activations": activations})
        assert prediction.memory_bytes == pytest.approx(sum(prediction.memory_components.values()))
        assert set(prediction.memory_components) == set(MEMORY_COMPONENTS)


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("tp", [1, 2])
def test_memory_falls_with_each_sharding_mode_at_dp_above_one(dp, tp):
    profile = toy_profile()
    space = two_replicas(world_size=dp * tp, tp_degrees_allowed=(tp,))
    memory = [predict(Layout(dp, 1, tp, 1, 1, 0.0, mode), profile, NETWORK, space).memory_bytes
              for mode in DATA_PARALLEL_SHARDING]
    assert memory == sorted(memory, reverse=True) and len(set(memory)) == len(memory)


def test_pipelined_full_sharding_holds_gathered_parameters_and_whole_gradients():
    """FSDP2 under a pipeline keeps each stage's parameters gathered and its gradients whole over the micro-batches
    (torch's PipelineStage): it saves only optimizer state, and costs the parameters' own 1/S slice on top."""
    profile = toy_profile()
    space = two_replicas(world_size=4, max_pipeline_stages=2)
    memory = {mode: predict(Layout(2, 2, 1, 2, 1, 0.0, mode), profile, NETWORK, space).memory_components
              for mode in DATA_PARALLEL_SHARDING}
    assert memory["optimizer"]["gradients"] == memory["gradients"]["gradients"] == memory["none"]["gradients"]
    assert memory["full"]["optimizer_state"] == memory["optimizer"]["optimizer_state"]
    assert memory["full"]["parameters"] == pytest.approx(1.5 * memory["none"]["parameters"])


# --- time -----------------------------------------------------------------------------------------


def test_exposed_communication_is_what_exceeds_the_window_and_at_least_the_last_piece():
    assert exposed_comm_s(1.0, 3.0, 0.1) == pytest.approx(0.1)
    assert exposed_comm_s(5.0, 3.0, 0.1) == pytest.approx(2.0)
    assert exposed_comm_s(1.0, 0.0, 0.1) == pytest.approx(1.0)
    assert exposed_comm_s(1.0, 3.0, 7.0) == pytest.approx(1.0)


def test_data_parallel_time_per_mode_by_hand():
    profile = toy_profile(num_blocks=16, backward_s=0.2)  # backward 3.2 s, forward 1.6 s
    ring_s = 16_400 / 1e4  # a ring all-reduce of P over two ranks moves P per rank
    times = {}
    for overlap in (False, True):
        space = two_replicas(overlap_grad_reduce=overlap)
        for mode in DATA_PARALLEL_SHARDING:
            prediction = predict(Layout(2, 1, 1, 1, 1, 0.0, mode), profile, NETWORK, space)
            times[mode, overlap] = prediction.components["dp_allreduce"], prediction.components["optimizer"]
    last_bucket, first_block = 100 / 16_400, 1000 / 16_400
    assert times["none", False][0] == pytest.approx(ring_s)
    assert times["none", True][0] == pytest.approx(ring_s * last_bucket)
    for sharded in ("optimizer", "gradients"):
        assert times[sharded, False][0] == pytest.approx(ring_s)  # reduce-scatter + all-gather
        assert times[sharded, True][0] == pytest.approx(ring_s / 2 * last_bucket + ring_s / 2)  # gather exposed
    # FSDP2 gathers in forward and again in backward, prefetched block by block, whatever overlap_grad_reduce says
    assert times["full", False][0] == pytest.approx(times["full", True][0])
    assert times["full", True][0] == pytest.approx(ring_s / 2 * first_block + ring_s * first_block)
    whole_step = 16_400 * 1e-9
    assert times["none", True][1] == pytest.approx(whole_step)
    for sharded in ("optimizer", "gradients", "full"):
        assert times[sharded, True][1] == pytest.approx(whole_step / 2)


def test_every_bucket_and_every_fsdp_unit_pays_its_latency():
    slow_start = NetworkProfile(all_reduce={2: CollectiveCost(latency_s=1e-3, bandwidth_bytes_per_s=1e15)}, p2p=LINK)
    profile = toy_profile(backward_s=0.0)  # nothing to hide behind in the backward

    def exposed(mode: str, **fields) -> float:
        space = two_replicas(overlap_grad_reduce=False, **fields)
        return predict(Layout(2, 1, 1, 1, 1, 0.0, mode), profile, slow_start, space).components["dp_allreduce"]

    assert exposed("none", grad_bucket_bytes=None) == pytest.approx(1e-3)  # one flattened all-reduce
    assert exposed("none", grad_bucket_bytes=4100) == pytest.approx(4e-3)  # 16 400 bytes in four buckets
    assert exposed("optimizer", grad_bucket_bytes=4100) == pytest.approx(4e-3)  # four reduce-scatters and gathers
    # FSDP2: 17 units (16 blocks and the root); the forward gathers hide behind the forward, the backward's do not
    assert exposed("full") == pytest.approx(17e-3 / 2 * 1000 / 16_400 + 17e-3, rel=1e-6)
    assert model_state_bytes("gradients", 2, False, 1000, 300, None, profile)["gradients"] == pytest.approx(1000)


def test_hybrid_sharding_adds_the_all_reduce_across_replicas_and_needs_its_group_profiled():
    profile, space = toy_profile(), two_replicas(world_size=4, shard_size=2, overlap_grad_reduce=False)
    prediction = predict(Layout(4, 1, 1, 1, 1, 0.0, "optimizer"), profile, NETWORK, space)
    ring_s = 16_400 / 1e4
    assert prediction.components["dp_allreduce"] == pytest.approx(ring_s + LINK.all_reduce_s(16_400 / 2, 2))
    assert prediction.components["optimizer"] == pytest.approx(16_400 * 1e-9 / 2)
    assert required_profile_keys(two_replicas(world_size=8, shard_size=2)).all_reduce_group_sizes == {2, 4, 8}


# --- search ---------------------------------------------------------------------------------------


def test_auto_keeps_whole_replicas_when_everything_fits_and_they_are_fastest():
    result = plan(two_replicas(), toy_profile(), NETWORK)
    assert result.best.layout.sharding == "none"
    assert {prediction.layout.sharding for prediction in result.ranked} == set(DATA_PARALLEL_SHARDING)


def test_auto_shards_exactly_when_only_a_sharded_mode_fits():
    profile, space = toy_profile(), two_replicas()
    memory = {mode: predict(Layout(2, 1, 1, 1, 1, 0.0, mode), profile, NETWORK, space).memory_bytes
              for mode in DATA_PARALLEL_SHARDING}
    assert plan(two_replicas(memory_limit_bytes=memory["none"]), profile, NETWORK).best.layout.sharding == "none"
    below_none = plan(two_replicas(memory_limit_bytes=memory["none"] - 1), profile, NETWORK)
    assert below_none.best.layout.sharding != "none"
    # the fastest that fits: FSDP2 hides its gathers, ZeRO leaves the gather after the step exposed
    assert below_none.best.layout.sharding == "full"
    only_full = plan(two_replicas(memory_limit_bytes=memory["gradients"] - 1), profile, NETWORK)
    assert [prediction.layout.sharding for prediction in only_full.ranked] == ["full"]
    with pytest.raises(ValueError, match="no layout fits"):
        plan(two_replicas(memory_limit_bytes=memory["full"] - 1), profile, NETWORK)


def test_auto_takes_the_fastest_fitting_mode_and_ties_go_to_the_less_sharded():
    # without overlap and with a free optimizer, ZeRO-1/2 cost what the all-reduce costs; with almost no backward
    # to hide behind, FSDP2's second gather makes it slower
    profile, limit = toy_profile(backward_s=1e-4, optimizer_s_per_byte=0.0), 50_000
    result = plan(two_replicas(overlap_grad_reduce=False, memory_limit_bytes=limit), profile, NETWORK)
    assert [prediction.layout.sharding for prediction in result.ranked] == ["optimizer", "gradients", "full"]
    assert result.ranked[0].step_time_s == pytest.approx(result.ranked[1].step_time_s)
    unlimited = plan(two_replicas(overlap_grad_reduce=False), profile, NETWORK)
    assert unlimited.best.layout.sharding == "none"


def test_a_fixed_mode_restricts_the_search_and_stays_at_one_replica():
    space = two_replicas(world_size=4, max_pipeline_stages=4, tp_degrees_allowed=(1, 2), sharding_modes=("gradients",))
    layouts = candidate_layouts(space, 16)
    assert {layout.sharding for layout in layouts} == {"gradients"}
    assert any(layout.dp == 1 for layout in layouts)
    assert {prediction.layout.sharding for prediction in plan(space, toy_profile(), NETWORK).ranked} == {"gradients"}


def test_candidates_leave_out_what_a_mode_cannot_run():
    space = two_replicas(world_size=4, max_pipeline_stages=1, tp_degrees_allowed=(1, 2), overlap_choices=(1, 2))
    layouts = candidate_layouts(space, 16)
    assert not any(layout.sharding == "full" and layout.overlap > 1 for layout in layouts)
    assert all(layout.sharding == "none" for layout in layouts if layout.dp == 1)  # nothing to split
    hybrid = candidate_layouts(two_replicas(world_size=8, shard_size=4, tp_degrees_allowed=(1, 2, 4)), 16)
    assert {(layout.dp, layout.sharding != "none") for layout in hybrid} == {(8, True), (8, False), (4, True),
                                                                           (4, False), (2, False)}
    with pytest.raises(ValueError, match="overlap=2"):
        Layout(2, 1, 2, 1, 2, 0.0, "full")
    with pytest.raises(ValueError, match="Layout.sharding='zero3' is unknown"):
        Layout(2, 1, 1, 1, 1, 0.0, "zero3")
    with pytest.raises(ValueError, match="SearchSpace.sharding_modes"):
        two_replicas(sharding_modes=("auto",))


def test_describe_names_the_mode_when_it_shards():
    assert Layout(2, 1, 1, 1, 1, 0.0).describe().endswith("recompute_ratio=0")
    assert Layout(2, 1, 1, 1, 1, 0.0, "optimizer").describe().endswith("sharding=optimizer")


# --- strategy glue ----------------------------------------------------------------------------------


def test_auto_sharding_makes_the_planner_run_and_a_fixed_mode_lands_in_the_layout():
    assert Merak3DArguments(data_parallel_sharding="auto").needs_planning
    fixed = Merak3DArguments(data_parallel_sharding="optimizer", data_parallel_shard_size=2)
    assert not fixed.needs_planning
    layout = fixed.layout(4)
    assert (layout.data_parallel_sharding, layout.data_parallel_shard_size) == ("optimizer", 2)


def test_the_chosen_mode_is_what_the_adopted_layout_reads():
    arguments = Merak3DArguments(data_parallel_sharding="auto", data_parallel_shard_size=2)
    adopted = planning._adopted_layout(arguments, Layout(4, 1, 1, 1, 1, 0.0, "gradients"))
    assert (adopted.data_parallel_sharding, adopted.data_parallel_shard_size) == ("gradients", 2)
    unsharded = planning._adopted_layout(arguments, Layout(4, 1, 1, 1, 1, 0.0))
    assert (unsharded.data_parallel_sharding, unsharded.data_parallel_shard_size) == ("none", None)


def test_auto_searches_only_the_modes_the_run_can_use():
    auto, model = Merak3DArguments(data_parallel_sharding="auto"), nn.Linear(4, 4)
    assert planning.sharding_modes(auto, model, None, None) == DATA_PARALLEL_SHARDING
    assert planning.sharding_modes(Merak3DArguments(data_parallel_sharding="full"), model, None, None) == ("full",)
    loss_scaling = SimpleNamespace(scaler=object())
    assert planning.sharding_modes(auto, model, loss_scaling, None) == ("none",)
    not_elementwise = torch.optim.LBFGS(model.parameters())
    assert planning.sharding_modes(auto, model, None, not_elementwise) == ("none", "full")
    sub_batches = dataclasses.replace(auto, tp_overlap=2)
    assert "full" not in planning.sharding_modes(sub_batches, model, None, None)


@pytest.mark.parametrize(
    ("dtype", "precision", "factory", "expected"),
    [
        (torch.float32, "32-true", torch.optim.AdamW, (2.0, 0.0)),
        (torch.float32, "bf16-mixed", torch.optim.AdamW, (2.0, 0.5)),
        (torch.bfloat16, "bf16-true", torch.optim.AdamW, (2.0, 0.0)),
        (torch.float32, "32-true", lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), (1.0, 0.0)),
        (torch.float32, "32-true", lambda params: torch.optim.SGD(params, lr=0.1), (0.0, 0.0)),
    ],
)
def test_state_bytes_follow_the_optimizer_and_the_precision(dtype, precision, factory, expected):
    model = nn.Linear(4, 4).to(dtype)
    ratios = planning.state_bytes_per_parameter_byte(model, SimpleNamespace(precision=precision), factory)
    assert (ratios["optimizer_bytes_per_parameter_byte"],
            ratios["compute_copy_bytes_per_parameter_byte"]) == pytest.approx(expected)


PROBE_LIMIT_GRADIENTS = 20
"""The planned run's memory limit in gradients' bytes: room for every mode, but a 1/32 share smaller than one
gradient, so bounding the network probes by the limit shows."""


def _plan_sharding_rank(rank: int, world_size: int) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.strategies.merak3d import Merak3DStrategy
    from tests.test_merak3d import BATCH, _batches, _module

    class FirstBatch(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(_batches()[0]), batch_size=BATCH)

    probes: list[dict] = []
    measure = planning.profile_network

    def recorded(*args, **kwargs):
        probes.append({"large_bytes": kwargs["large_bytes"], "gradient_bytes": kwargs["gradient_bytes"]})
        return measure(*args, **kwargs)

    module = _module("llama", optimizer="adam")
    gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    limit = PROBE_LIMIT_GRADIENTS * gradient_bytes
    strategy = Merak3DStrategy(data_parallel_sharding="auto", plan_only=True, timeout_s=120, memory_limit=limit)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    planning.profile_network = recorded
    try:
        trainer.fit(module, datamodule=FirstBatch())
    finally:
        planning.profile_network = measure
    return {"adopted": strategy.layout.data_parallel_sharding, "chosen": strategy.layout_choice.layout,
            "layouts": [p.layout for p in strategy.layout_plan.ranked], "probes": probes,
            "gradient_bytes": gradient_bytes, "limit": limit}


@pytest.mark.distributed
def test_auto_sharding_plans_every_mode_and_the_strategy_adopts_its_choice():
    """Under a memory limit every mode fits, and the network probes stay within their share of the limit (a probe
    as large as the whole gradient set the peak of runs planned near their limit)."""
    results = run_distributed(_plan_sharding_rank, 2, timeout_s=300)
    assert results[0]["chosen"] == results[1]["chosen"]
    assert all(r["adopted"] == r["chosen"].sharding for r in results)
    assert {(layout.dp, layout.pp, layout.tp, layout.sharding) for layout in results[0]["layouts"]} == {
        (2, 1, 1, mode) for mode in DATA_PARALLEL_SHARDING}
    for result in results:
        [probe] = result["probes"]
        bound = planning.largest_network_probe(result["limit"])
        assert bound < result["gradient_bytes"]
        assert probe["gradient_bytes"] <= bound and probe["large_bytes"] <= bound
