"""Layout planner core, measured refinements: robust collective fits, real blocks, gradient sync, per-block
optimizer, clipping, the batch clock and the step-time check."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_merak.planning.planner import (
    BatchClock,
    BlockTimes,
    CollectiveCost,
    Layout,
    MeasuredBlocks,
    NetworkProfile,
    StepTimeCheck,
    average_profiles,
    fit_collective_cost,
    plan,
    predict,
    required_profile_keys,
)
from tests.test_planner_core import SLOW, TP_DEGREES, space, synthetic_model


def test_collective_fit_recovers_an_exact_alpha_beta_line():
    link = CollectiveCost(latency_s=3e-4, bandwidth_bytes_per_s=2e9)
    points = [(n, link.send_s(n)) for n in (4096, 65536, 1 << 20, 16 << 20)]
    fitted = fit_collective_cost(points)
    assert fitted.latency_s == pytest.approx(3e-4, rel=1e-6)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    ring = fit_collective_cost([(n, link.all_reduce_s(n, 4)) for n, _ in points], factor=1.5)
    assert ring.all_reduce_s(8 << 20, 4) == pytest.approx(link.all_reduce_s(8 << 20, 4), rel=1e-6)


def test_collective_fit_keeps_relative_error_small_at_both_ends():
    # 2 ms of latency noise at the small end must not wreck the large end (a two-point fit through
    # a noisy small point and a large point gave an infinite bandwidth on a busy machine)
    points = [(4096, 2.5e-3), (131072, 1.0e-3), (524288, 1.4e-3), (22 << 20, 16e-3)]
    fitted = fit_collective_cost(points)
    assert fitted.bandwidth_bytes_per_s < 1e10
    assert fitted.send_s(22 << 20) == pytest.approx(16e-3, rel=0.15)


def test_collective_fit_pins_negative_terms_to_zero():
    falling = fit_collective_cost([(1000, 2e-3), (1_000_000, 1e-3)])
    assert falling.bandwidth_bytes_per_s == float("inf") and 1e-3 < falling.latency_s < 2e-3
    proportional = fit_collective_cost([(1000, 1e-6), (1_000_000, 2e-3)])
    assert proportional.latency_s == 0.0 and proportional.bandwidth_bytes_per_s > 0


@pytest.mark.parametrize("points", [[(1000, 1e-3)], [(1000, 1e-3), (1000, 2e-3)], [(1000, 0.0), (2000, 1e-3)]])
def test_collective_fit_rejects_unusable_points(points):
    with pytest.raises(ValueError, match="fit_collective_cost"):
        fit_collective_cost(points)


def test_gradient_sync_replaces_the_plain_all_reduce_for_data_parallel_only():
    link = CollectiveCost(latency_s=0.0, bandwidth_bytes_per_s=1e9)
    sync = CollectiveCost(latency_s=0.01, bandwidth_bytes_per_s=1e8)
    plain, measured = NetworkProfile({2: link}, link), NetworkProfile({2: link}, link, gradient_sync={2: sync})
    assert plain.gradient_sync_s(1e8, 2) == pytest.approx(link.all_reduce_s(1e8, 2))
    assert measured.gradient_sync_s(1e8, 2) == pytest.approx(1.01)
    assert measured.gradient_sync_s(1e8, 1) == 0.0
    profile, search = synthetic_model(), space()
    layout = Layout(2, 1, 4, 1, 1, 0.0)
    slow_sync = dataclasses.replace(SLOW, gradient_sync={2: sync})
    before, after = predict(layout, profile, SLOW, search), predict(layout, profile, slow_sync, search)
    parameter_bytes = 8 * profile.block_parameter_bytes[4] + 600_000_000 // 4  # embedding and head split by vocabulary
    assert after.components["dp_allreduce"] == pytest.approx(sync.send_s(parameter_bytes))
    assert after.components["exposed_tp_comm"] == pytest.approx(before.components["exposed_tp_comm"])


def test_measured_blocks_replace_the_simulated_chain():
    profile, search = synthetic_model(num_blocks=4), space(world_size=2, global_batch_size=8)
    layout = Layout(1, 1, 2, 1, 2, 0.0)
    modelled = predict(layout, profile, SLOW, search)
    blocks = MeasuredBlocks(forward_first_s=0.05, forward_next_s=0.04, backward_first_s=0.09, backward_next_s=0.08)
    measured_profile = dataclasses.replace(profile, measured_blocks={(2, 2, 8): blocks})
    measured = predict(layout, measured_profile, SLOW, search)
    prefix_forward, prefix_backward = profile.prefix_times[4]
    suffix_forward, suffix_backward = profile.suffix_times[4]
    outside_s = 2 * (prefix_forward + suffix_forward + prefix_backward + suffix_backward)
    optimizer_s = profile.optimizer_s_per_parameter_byte * (4 * profile.block_parameter_bytes[2] + 600_000_000 // 2)
    assert measured.step_time_s == pytest.approx(outside_s + 0.05 + 3 * 0.04 + 0.09 + 3 * 0.08 + optimizer_s)
    assert measured.components["compute"] == pytest.approx(modelled.components["compute"])
    assert sum(measured.components.values()) == pytest.approx(measured.step_time_s)
    # another overlap degree, or tp=1, is not covered by the measurement and keeps the model
    other = Layout(1, 1, 2, 1, 4, 0.0)
    assert (predict(other, measured_profile, SLOW, search).step_time_s
            == predict(other, profile, SLOW, search).step_time_s)


def test_measured_blocks_feed_the_pipeline_split():
    profile, search = synthetic_model(num_blocks=4), space(world_size=4, global_batch_size=8)
    layout = Layout(1, 2, 2, 4, 1, 0.0)
    slow_blocks = MeasuredBlocks(1.0, 1.0, 2.0, 2.0)
    measured = predict(layout, dataclasses.replace(profile, measured_blocks={(2, 1, 2): slow_blocks}), SLOW, search)
    # four blocks of 3 s per micro-batch dominate: the busiest stage holds two of them
    assert measured.step_time_s > 4 * 2 * 3.0
    assert measured.components["exposed_tp_comm"] > 0


def test_block_optimizer_time_is_counted_per_block():
    profile, search = synthetic_model(num_blocks=4), space(world_size=2, global_batch_size=8)
    layout = Layout(1, 1, 2, 1, 1, 0.0)
    per_block = dataclasses.replace(profile, block_optimizer_s={2: 0.5})
    optimizer = predict(layout, per_block, SLOW, search).components["optimizer"]
    assert optimizer == pytest.approx(4 * 0.5 + profile.optimizer_s_per_parameter_byte * 600_000_000)


def test_embedding_and_head_updates_are_counted_as_measured():
    profile, search = synthetic_model(num_blocks=4), space(world_size=2, global_batch_size=8)
    per_block = dataclasses.replace(profile, block_optimizer_s={1: 0.5, 2: 0.25})
    measured = dataclasses.replace(per_block, prefix_update_s=(3.0, 0.1), suffix_update_s=(5.0, 0.2))
    single = Layout(2, 1, 1, 1, 1, 0.0)
    assert predict(single, measured, SLOW, search).components["optimizer"] == pytest.approx(4 * 0.5 + 3.0 + 5.0)
    # two stages: the slower update is the head's stage, with whatever blocks AutoPipe gave it
    pipeline = predict(Layout(1, 2, 1, 2, 1, 0.0), measured, SLOW, search)
    assert any(pipeline.components["optimizer"] == pytest.approx(blocks * 0.5 + 5.0) for blocks in range(5))
    # without them the embedding and head are priced per byte
    assert predict(single, per_block, SLOW, search).components["optimizer"] == pytest.approx(
        4 * 0.5 + profile.optimizer_s_per_parameter_byte * 600_000_000)
    with pytest.raises(ValueError, match="prefix_update_s must be"):
        dataclasses.replace(profile, prefix_update_s=(1.0,))


def test_ranks_profiles_are_averaged_time_by_time_and_must_describe_one_model():
    fast = dataclasses.replace(synthetic_model(num_blocks=4), prefix_update_s=(1.0, 0.25),
                               measured_blocks={(2, 1, 8): MeasuredBlocks(1.0, 2.0, 3.0, 4.0)})
    slow = dataclasses.replace(
        fast, block_times={key: BlockTimes(tuple(2 * t for t in times.forward_segments_s),
                                           tuple(3 * t for t in times.backward_segments_s))
                           for key, times in fast.block_times.items()},
        prefix_update_s=(3.0, 0.75), measured_blocks={(2, 1, 8): MeasuredBlocks(3.0, 4.0, 5.0, 6.0)})
    mean = average_profiles([fast, slow])
    times = fast.block_times[(2, 4)]
    assert mean.block_times[(2, 4)].forward_segments_s == pytest.approx([1.5 * t for t in times.forward_segments_s])
    assert mean.block_times[(2, 4)].backward_segments_s == pytest.approx([2 * t for t in times.backward_segments_s])
    assert mean.prefix_update_s == (2.0, 0.5) and mean.suffix_update_s is None
    assert mean.measured_blocks[(2, 1, 8)] == MeasuredBlocks(2.0, 3.0, 4.0, 5.0)
    assert mean.block_parameter_bytes == fast.block_parameter_bytes and mean.num_blocks == 4
    assert average_profiles([fast]) == fast
    fuller = dataclasses.replace(fast, block_activation_bytes_per_sample={
        tp: 2 * saved for tp, saved in fast.block_activation_bytes_per_sample.items()})
    assert (average_profiles([fast, fuller]).block_activation_bytes_per_sample
            == fuller.block_activation_bytes_per_sample)
    with pytest.raises(ValueError, match=r"ModelProfile.num_blocks differs"):
        average_profiles([fast, dataclasses.replace(fast, num_blocks=5)])
    with pytest.raises(ValueError, match=r"ModelProfile.loss_times has different keys"):
        average_profiles([fast, dataclasses.replace(fast, loss_times={8: (0.1, 0.2)})])


def test_gradient_clipping_is_counted_when_the_run_clips():
    profile, network_ = synthetic_model(num_blocks=4), SLOW
    clipping = dataclasses.replace(profile, block_clip_s={tp: 0.25 / tp for tp in TP_DEGREES},
                                   clip_s_per_parameter_byte=1e-10)
    layout = Layout(1, 2, 2, 4, 1, 0.0)
    search = space(world_size=4, global_batch_size=8)
    without = predict(layout, clipping, network_, search)
    assert without.components["grad_clip"] == 0.0
    clipped = predict(layout, clipping, network_, dataclasses.replace(search, clip_gradients=True))
    # the slowest stage's passes (its blocks at 0.125 s, embedding or head by the byte) and a scalar
    # all-reduce over each of the pipeline and tensor-parallel groups
    scalar_s = 2 * network_.all_reduce_s(8, 2)
    stage_passes = [blocks * 0.125 + 1e-10 * 300_000_000 for blocks in range(5)]
    assert clipped.components["grad_clip"] - scalar_s == pytest.approx(max(stage_passes), rel=0.5)
    assert clipped.components["grad_clip"] > scalar_s + 2 * 0.125
    assert clipped.step_time_s == pytest.approx(without.step_time_s + clipped.components["grad_clip"])
    assert sum(clipped.components.values()) == pytest.approx(clipped.step_time_s)
    with pytest.raises(ValueError, match=r"block_clip_s\[1\].*profile them first"):
        plan(dataclasses.replace(search, clip_gradients=True), profile, network_)


def test_clipping_needs_the_pipeline_groups_all_reduce_cost():
    # an odd batch leaves no data-parallel layout: only pp=2 uses a group of two ranks
    search = space(world_size=2, global_batch_size=3, tp_degrees_allowed=(1,), max_pipeline_stages=2)
    assert required_profile_keys(search).all_reduce_group_sizes == frozenset()
    assert required_profile_keys(dataclasses.replace(search, clip_gradients=True)).all_reduce_group_sizes == {2}


def test_required_keys_list_the_real_blocks_to_measure():
    keys = required_profile_keys(space(world_size=2, global_batch_size=8, tp_degrees_allowed=(1, 2),
                                       max_pipeline_stages=1, overlap_choices=(1, 2)))
    assert keys.measured_blocks == frozenset({(2, 1, 8), (2, 2, 8)})


def test_measured_blocks_reject_negative_times():
    with pytest.raises(ValueError, match="MeasuredBlocks"):
        MeasuredBlocks(-1.0, 0.0, 0.0, 0.0)


def test_loss_is_counted_once_per_micro_batch_on_the_last_stage():
    profile, search = synthetic_model(num_blocks=4), space(world_size=2, global_batch_size=8)
    with_loss = dataclasses.replace(profile, loss_times={8: (0.3, 0.1), 4: (0.2, 0.05), 2: (0.1, 0.02)})
    # one stage with two sub-batches: the loss runs once, on the whole micro-batch of 8 samples
    layout = Layout(1, 1, 2, 1, 2, 0.0)
    added = predict(layout, with_loss, SLOW, search).step_time_s - predict(layout, profile, SLOW, search).step_time_s
    assert added == pytest.approx(0.4)
    assert predict(layout, with_loss, SLOW, search).components["compute"] == pytest.approx(
        predict(layout, profile, SLOW, search).components["compute"] + 0.4)
    # two stages, four micro-batches of 2: only the last stage pays, once per micro-batch
    piped = Layout(1, 2, 1, 4, 1, 0.0)
    plain, lossy = predict(piped, profile, SLOW, search), predict(piped, with_loss, SLOW, search)
    assert lossy.step_time_s > plain.step_time_s
    assert lossy.step_time_s - plain.step_time_s <= 4 * 0.12 + 1e-9


def test_a_profile_with_loss_times_needs_every_micro_batch_size():
    search = space(world_size=2, global_batch_size=8, tp_degrees_allowed=(1, 2), max_pipeline_stages=2)
    keys = required_profile_keys(search, 4)
    assert keys.loss_samples == frozenset({8, 4, 2, 1})  # 1, 2, 4 and 8 micro-batches
    profile = dataclasses.replace(synthetic_model(num_blocks=4), loss_times={8: (0.3, 0.1)})
    with pytest.raises(ValueError, match=r"loss_times\[1\].*loss_times\[2\].*loss_times\[4\]"):
        plan(search, profile, SLOW)
    with pytest.raises(ValueError, match="loss_times"):
        dataclasses.replace(profile, loss_times={8: (-1.0, 0.1)})


def test_batch_clock_leaves_out_warm_up_batches_and_intervals_across_a_pause():
    clock = BatchClock(warmup=1, batches=3)
    for start in (0.0, 5.0, 6.0, 8.0):  # batch 0 (warm-up) takes 5 s, then 1 s and 2 s
        clock.batch_started(start)
    clock.pause()  # validation between batch 2 and batch 3
    clock.batch_started(100.0)
    assert not clock.ready and clock.durations_s == [1.0, 2.0]
    clock.batch_started(104.0)
    clock.batch_started(200.0)  # the clock has stopped
    assert clock.ready and clock.durations_s == [1.0, 2.0, 4.0] and clock.median_s() == 2.0


def test_batch_clock_refuses_a_bad_window_and_an_empty_median():
    with pytest.raises(ValueError, match="batches >= 1"):
        BatchClock(warmup=0, batches=0)
    with pytest.raises(ValueError, match="no batch yet"):
        BatchClock(warmup=0, batches=1).median_s()


def test_step_time_check_signs_an_optimistic_prediction_negative_and_flags_large_errors():
    close = StepTimeCheck(predicted_s=0.9, measured_s=1.0, batches=5)
    assert close.error == pytest.approx(-0.1) and not close.suspect
    assert "prediction -10%" in close.describe()
    assert StepTimeCheck(predicted_s=0.5, measured_s=1.0, batches=5).suspect
