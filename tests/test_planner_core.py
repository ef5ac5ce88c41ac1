"""Layout planner core: overlapped-TP chain simulation, cost model, exhaustive search, on synthetic profiles."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from lightning_merak.planning.planner import (
    COMPONENTS,
    BlockTimes,
    CollectiveCost,
    Layout,
    ModelProfile,
    NetworkProfile,
    SearchSpace,
    candidate_layouts,
    fit_pipeline_runtime,
    plan,
    predict,
    required_profile_keys,
    simulate_overlapped_chain,
)

TP_DEGREES = (1, 2, 4, 8)
SAMPLE_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)


def synthetic_model(
    num_blocks: int = 8,
    segment_overhead_s: float = 2e-4,
    hidden_bytes_per_sample: int = 4 * 1024 * 1024,
    optimizer_s_per_parameter_byte: float = 1e-11,
) -> ModelProfile:
    """A transformer whose per-segment time is a fixed overhead plus work linear in samples / tp.

    The overhead makes small sub-batches less efficient, the cost that overlap has to earn back.
    """
    block_times = {}
    for tp in TP_DEGREES:
        for samples in SAMPLE_COUNTS:
            attention_s = segment_overhead_s + 1e-3 * samples / tp
            mlp_s = segment_overhead_s + 2e-3 * samples / tp
            block_times[(tp, samples)] = BlockTimes((attention_s, mlp_s), (2 * mlp_s, 2 * attention_s))
    return ModelProfile(
        num_blocks=num_blocks,
        hidden_bytes_per_sample=hidden_bytes_per_sample,
        block_times=block_times,
        prefix_times={samples: (1e-4 * samples, 2e-4 * samples) for samples in SAMPLE_COUNTS},
        suffix_times={samples: (3e-3 * samples, 6e-3 * samples) for samples in SAMPLE_COUNTS},
        block_parameter_bytes={tp: 200_000_000 // tp for tp in TP_DEGREES},
        prefix_parameter_bytes=300_000_000,
        suffix_parameter_bytes=300_000_000,
        block_activation_bytes_per_sample={tp: 20 * hidden_bytes_per_sample // tp for tp in TP_DEGREES},
        optimizer_s_per_parameter_byte=optimizer_s_per_parameter_byte,
    )


def network(bandwidth_bytes_per_s: float, latency_s: float = 2e-5) -> NetworkProfile:
    link = CollectiveCost(latency_s, bandwidth_bytes_per_s)
    return NetworkProfile(all_reduce={size: link for size in (2, 4, 8, 16, 32)}, p2p=link)


FAST = network(200e9)
SLOW = network(2e9)


def space(**overrides) -> SearchSpace:
    fields = {"world_size": 8, "global_batch_size": 32, "tp_degrees_allowed": (1, 2, 4), "max_pipeline_stages": 4}
    return SearchSpace(**(fields | overrides))


def rank_key(prediction) -> tuple:
    return (prediction.step_time_s, *prediction.layout.tie_break_key)


# --- overlapped chain ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("segments", "comm_s", "k", "time_s", "exposed_s", "comm_total_s"),
    [
        # k = 1 is plain TP: every collective is waited for in full.
        ([1.0, 2.0, 3.0], 0.5, 1, 7.0, 1.0, 1.0),
        # No communication: the sub-batches simply run one after another.
        ([1.0, 2.0], 0.0, 3, 9.0, 0.0, 0.0),
        # Two halves, short collectives: each hides behind the other half's segment.
        ([1.0, 1.0], 0.5, 2, 4.0, 0.0, 1.0),
        # Long collectives: the channel bounds the chain, first segment + 2 x 5 s + last segment.
        ([1.0, 1.0], 5.0, 2, 12.0, 8.0, 10.0),
        # Across blocks: t=2 c0 [2,3.5]; t=4 c1 [4,5.5]; t=5 c0' [5.5,7] after waiting 0.5 ... ends 9.5.
        ([2.0, 1.0, 1.0], 1.5, 2, 9.5, 1.5, 6.0),
        # One segment launches nothing.
        ([3.0], 1.0, 2, 6.0, 0.0, 0.0),
    ],
)
def test_overlapped_chain_hand_computed(segments, comm_s, k, time_s, exposed_s, comm_total_s):
    result = simulate_overlapped_chain(segments, comm_s, k)
    assert result.time_s == pytest.approx(time_s)
    assert result.exposed_comm_s == pytest.approx(exposed_s)
    assert result.comm_s_total == pytest.approx(comm_total_s)


def test_overlapped_chain_bounds_on_random_chains():
    rng = random.Random(0)
    for _ in range(2000):
        segments = [rng.choice([0.0, rng.random()]) for _ in range(rng.randint(1, 6))]
        comm_s, k = rng.choice([0.0, 2 * rng.random()]), rng.randint(1, 5)
        result = simulate_overlapped_chain(segments, comm_s, k)
        collectives = len(segments) - 1
        assert result.time_s == pytest.approx(k * sum(segments) + result.exposed_comm_s)
        assert result.time_s <= k * (sum(segments) + collectives * comm_s) + 1e-9
        if collectives:
            assert result.time_s >= segments[0] + k * collectives * comm_s + segments[-1] - 1e-9


@pytest.mark.parametrize(
    ("segments", "comm_s", "k", "message"),
    [([], 0.0, 1, "at least one segment"), ([1.0, -1.0], 0.0, 1, ">= 0"), ([1.0], -0.1, 1, "comm_s"),
     ([1.0], 0.0, 0, "k (sub-batches)")],
)
def test_overlapped_chain_rejects_bad_input(segments, comm_s, k, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        simulate_overlapped_chain(segments, comm_s, k)


# --- profiles --------------------------------------------------------------------------------------


def test_collective_costs_follow_the_alpha_beta_model():
    link = CollectiveCost(latency_s=1e-3, bandwidth_bytes_per_s=1e6)
    assert link.all_reduce_s(4e6, 1) == 0.0
    assert link.all_reduce_s(4e6, 4) == pytest.approx(1e-3 + 2 * 3 / 4 * 4.0)
    assert link.send_s(2e6) == pytest.approx(1e-3 + 2.0)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be > 0"):
        CollectiveCost(0.0, 0.0)


def test_network_profile_names_a_missing_group_size():
    profile = NetworkProfile(all_reduce={2: CollectiveCost(0.0, 1e9)}, p2p=CollectiveCost(0.0, 1e9))
    assert profile.all_reduce_s(1e9, 1) == 0.0
    with pytest.raises(ValueError, match=r"groups of 4 ranks \(measured: \[2\]\); profile all-reduce over 4"):
        profile.all_reduce_s(1e9, 4)


# --- cost model ------------------------------------------------------------------------------------


def _one_block_profile(**overrides) -> ModelProfile:
    fields = dict(
        num_blocks=1,
        hidden_bytes_per_sample=100,
        block_times={(2, 2): BlockTimes((1.0, 2.0), (3.0, 4.0))},
        prefix_times={2: (0.5, 0.25)},
        suffix_times={2: (1.0, 2.0)},
        block_parameter_bytes={2: 20},
        prefix_parameter_bytes=10,
        suffix_parameter_bytes=30,
        block_activation_bytes_per_sample={2: 1000},
        optimizer_s_per_parameter_byte=0.01,
    )
    return ModelProfile(**(fields | overrides))


_LINK = CollectiveCost(latency_s=0.1, bandwidth_bytes_per_s=100.0)
_TWO_RANKS = NetworkProfile(all_reduce={2: _LINK}, p2p=_LINK)


def test_single_stage_prediction_matches_hand_computation():
    profile, two_ranks = _one_block_profile(), _TWO_RANKS
    search = SearchSpace(world_size=2, global_batch_size=2, tp_degrees_allowed=(2,), max_pipeline_stages=1)
    # Each all-reduce: 0.1 + 2 * 1/2 * 200 / 100 = 2.1 s, two in forward and two in backward.
    # Forward chain [0.5 + 1, 2, 1]: 4.5 + 4.2; backward [2 + 3, 4, 0.25]: 9.25 + 4.2; optimizer 40 B x 0.01
    # (the block's 20 B per rank, and the embedding's 10 and the head's 30 split by vocabulary over 2 ranks).
    plain = predict(Layout(1, 1, 2, 1, 1, 0.0), profile, two_ranks, search)
    assert plain.step_time_s == pytest.approx(8.7 + 13.45 + 0.4)
    assert plain.components == pytest.approx(
        {"compute": 13.75, "exposed_tp_comm": 8.4, "expert_all_to_all": 0.0, "context_exchange": 0.0,
         "vocab_exchange": 0.0, "pipeline_runtime": 0.0,
         "pipeline_bubble": 0.0,
         "dp_allreduce": 0.0, "grad_clip": 0.0, "optimizer": 0.4}
    )
    whole_vocabulary = predict(Layout(1, 1, 2, 1, 1, 0.0), profile, two_ranks,
                               dataclasses.replace(search, vocab_parallel=False))
    assert whole_vocabulary.components["optimizer"] == pytest.approx(0.6)
    assert whole_vocabulary.memory_bytes == pytest.approx(4 * 60 + 2 * 1000)
    assert plain.memory_bytes == pytest.approx(4 * 40 + 2 * 1000)
    # Full recompute replays the block's compute (1 + 2 s), not its collectives, and keeps only
    # the block input plus the two cached post-collective outputs: 3 x 100 bytes per sample.
    recomputed = predict(Layout(1, 1, 2, 1, 1, 1.0), profile, two_ranks, search)
    assert recomputed.step_time_s == pytest.approx(plain.step_time_s + 3.0)
    assert recomputed.memory_bytes == pytest.approx(4 * 40 + 2 * 300 + 2 * 1000)


def test_sequence_parallelism_splits_the_sequence_split_activations_and_recomputed_inputs():
    profile = _one_block_profile(block_sequence_split_bytes_per_sample={2: 600})
    search = SearchSpace(world_size=2, global_batch_size=2, tp_degrees_allowed=(2,), max_pipeline_stages=1,
                         sequence_parallel=True)
    plain_search = dataclasses.replace(search, sequence_parallel=False)
    stored, recomputed = Layout(1, 1, 2, 1, 1, 0.0), Layout(1, 1, 2, 1, 1, 1.0)
    # 400 bytes per sample stay whole, the 600 sequence-split ones are halved
    assert predict(stored, profile, _TWO_RANKS, search).memory_bytes == pytest.approx(4 * 40 + 2 * 700)
    # a recomputed block keeps its input slice (50), two gathered (2 x 100) and two scattered (2 x 50) outputs
    assert predict(recomputed, profile, _TWO_RANKS, search).memory_bytes == pytest.approx(4 * 40 + 2 * 350 + 2 * 700)
    # the time is the profile's, taken with or without sequence parallelism
    assert predict(stored, profile, _TWO_RANKS, search).step_time_s == pytest.approx(
        predict(stored, profile, _TWO_RANKS, plain_search).step_time_s)
    # a profile that did not tell the split part prices activations as plain tensor parallelism
    assert predict(stored, _one_block_profile(), _TWO_RANKS, search).memory_bytes == pytest.approx(4 * 40 + 2 * 1000)
    with pytest.raises(ValueError, match=r"block_sequence_split_bytes_per_sample\[2\]=1200 must be within \[0, 1000\]"):
        _one_block_profile(block_sequence_split_bytes_per_sample={2: 1200}).block_activation_bytes_at(2, True)


def test_components_add_up_to_the_step_time():
    profile, search = synthetic_model(), space()
    for layout in candidate_layouts(search, profile.num_blocks):
        prediction = predict(layout, profile, SLOW, search)
        assert set(prediction.components) == set(COMPONENTS)
        assert min(prediction.components.values()) >= 0.0
        assert sum(prediction.components.values()) == pytest.approx(prediction.step_time_s, rel=1e-9)


def test_components_add_up_with_the_pipeline_runtime_priced():
    profile, search = synthetic_model(), space()
    priced = dataclasses.replace(SLOW, pipeline_action_s=1e-3, pipeline_step_s=2e-3)
    for layout in candidate_layouts(search, profile.num_blocks):
        prediction, without = predict(layout, profile, priced, search), predict(layout, profile, SLOW, search)
        assert sum(prediction.components.values()) == pytest.approx(prediction.step_time_s, rel=1e-9)
        if layout.pp == 1:
            assert prediction.step_time_s == without.step_time_s
            assert prediction.components["pipeline_runtime"] == 0.0
        else:
            # every chunk of the busiest stage pays the action time, the step its fixed part
            assert prediction.components["pipeline_runtime"] == pytest.approx(layout.micro_batches * 2e-3 + 2e-3)
            assert prediction.step_time_s >= without.step_time_s + prediction.components["pipeline_runtime"] - 1e-12


@pytest.mark.parametrize("action_s, step_s, p2p_s", [(4e-4, 3e-4, 1e-4), (1e-3, 0.0, 0.0), (0.0, 5e-4, 2e-4)])
def test_pipeline_runtime_is_recovered_from_steps_of_stages_that_compute_nothing(action_s, step_s, p2p_s):
    from lightning_merak.parallel.pipeline import simulate_schedule

    steps = {count: simulate_schedule([action_s] * 2, [action_s] * 2, count, "1f1b", p2p_s).iteration_s + step_s
             for count in (2, 8)}
    fitted_action_s, fitted_step_s = fit_pipeline_runtime(steps, p2p_s)
    assert fitted_action_s == pytest.approx(action_s, abs=1e-9)
    assert fitted_step_s == pytest.approx(step_s, abs=1e-9)


def test_pipeline_runtime_fit_clamps_noise_and_refuses_bad_input():
    # a step that shrank with more micro-batches (noise) means no action time, never a negative one
    assert fit_pipeline_runtime({2: 2e-3, 8: 1e-3}, 0.0) == (0.0, 2e-3)
    with pytest.raises(ValueError, match="two or more micro-batch counts"):
        fit_pipeline_runtime({2: 1e-3}, 0.0)
    with pytest.raises(ValueError, match="pipeline_action_s"):
        dataclasses.replace(SLOW, pipeline_action_s=-1.0)


def test_faster_network_lowers_every_predicted_time():
    profile, search = synthetic_model(), space()
    for layout in candidate_layouts(search, profile.num_blocks):
        slow, fast = predict(layout, profile, SLOW, search), predict(layout, profile, FAST, search)
        assert fast.step_time_s < slow.step_time_s, layout


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_more_recompute_saves_memory_and_costs_time(stages):
    profile = synthetic_model()
    search = space(world_size=2 * stages, tp_degrees_allowed=(2,))
    ratios = (0.0, 1.0) if stages == 1 else (0.0, 0.5, 1.0)
    predictions = [predict(Layout(1, stages, 2, 2 * stages, 2, ratio), profile, SLOW, search) for ratio in ratios]
    for less, more in zip(predictions, predictions[1:]):
        assert more.memory_bytes < less.memory_bytes
        assert more.step_time_s > less.step_time_s


def test_overlap_beats_plain_tensor_parallelism_only_when_communication_is_significant():
    profile = synthetic_model()
    search = space(world_size=4, tp_degrees_allowed=(4,), max_pipeline_stages=1, global_batch_size=8)
    plain, overlapped = Layout(1, 1, 4, 1, 1, 0.0), Layout(1, 1, 4, 1, 2, 0.0)
    fast_plain, fast_overlapped = (predict(layout, profile, FAST, search) for layout in (plain, overlapped))
    slow_plain, slow_overlapped = (predict(layout, profile, SLOW, search) for layout in (plain, overlapped))
    assert fast_plain.components["exposed_tp_comm"] < 0.1 * fast_plain.step_time_s
    assert fast_plain.step_time_s < fast_overlapped.step_time_s
    assert slow_plain.components["exposed_tp_comm"] > 0.3 * slow_plain.step_time_s
    assert slow_overlapped.step_time_s < slow_plain.step_time_s
    assert slow_overlapped.components["exposed_tp_comm"] < slow_plain.components["exposed_tp_comm"]
    assert plan(search, profile, FAST).best.layout == plain
    assert plan(search, profile, SLOW).best.layout.overlap > 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp": 1, "overlap": 2}, "needs tensor parallelism"),
        ({"pp": 1, "recompute_ratio": 0.5}, "with pp=1 use 0"),
        ({"pp": 4, "micro_batches": 2}, "micro_batches=2 < pp=4"),
        ({"recompute_ratio": 1.5}, r"in \[0, 1\]"),
        ({"dp": 0}, "Layout.dp must be >= 1"),
    ],
)
def test_layout_rejects_what_the_runtime_cannot_run(fields, message):
    base = {"dp": 1, "pp": 2, "tp": 2, "micro_batches": 4, "overlap": 1, "recompute_ratio": 0.0}
    with pytest.raises(ValueError, match=message):
        Layout(**(base | fields))


@pytest.mark.parametrize(
    ("layout", "space_fields", "message"),
    [
        (Layout(2, 2, 1, 2, 1, 0.0), {}, r"!= world_size=8"),
        (Layout(1, 2, 4, 3, 1, 0.0), {}, "not divisible by micro_batches=3"),
        (Layout(2, 1, 4, 1, 32, 0.0), {}, "does not split into overlap=32"),
        (Layout(1, 11, 1, 11, 1, 0.0), {"world_size": 11}, "use pp <= 10"),
    ],
)
def test_predict_rejects_layouts_outside_the_space(layout, space_fields, message):
    with pytest.raises(ValueError, match=message):
        predict(layout, synthetic_model(), SLOW, space(**space_fields))


def test_predict_names_a_missing_profile_key():
    profile = synthetic_model()
    trimmed = dataclasses.replace(profile, block_times={key: value for key, value in profile.block_times.items()
                                                        if key != (2, 8)})
    with pytest.raises(ValueError, match=r"no block_times entry for \(tp, samples\)=\(2, 8\)"):
        predict(Layout(4, 1, 2, 1, 1, 0.0), trimmed, SLOW, space())


# --- search ----------------------------------------------------------------------------------------


def test_candidate_layouts_follow_the_enumeration_rules():
    search = space(micro_batch_choices=(1, 2, 4, 8, 3))
    layouts = candidate_layouts(search, num_blocks=1)
    assert layouts and len(set(layouts)) == len(layouts)
    for layout in layouts:
        samples = search.global_batch_size // layout.dp // layout.micro_batches
        assert layout.dp * layout.pp * layout.tp == search.world_size
        assert layout.tp in search.tp_degrees_allowed
        assert layout.pp <= 3
        assert samples * layout.dp * layout.micro_batches == search.global_batch_size
        assert samples % layout.overlap == 0
        assert layout.micro_batches >= layout.pp and layout.micro_batches in search.micro_batch_choices
        if layout.pp == 1:  # one stage runs the counts it is given too: what the run takes (None: one)
            assert layout.recompute_ratio in (0.0, 1.0)
        if layout.tp == 1:
            assert layout.overlap == 1
    assert {layout.pp for layout in layouts} == {1, 2}
    assert {layout.micro_batches for layout in layouts if layout.pp == 1} == {1, 2, 4, 8}
    assert {layout.overlap for layout in layouts if layout.tp > 1} == {1, 2, 4}
    assert Layout(1, 2, 4, 4, 2, 0.5) in layouts
    assert Layout(1, 2, 4, 3, 1, 0.5) not in layouts


def test_candidate_layouts_exact_for_a_small_space():
    search = SearchSpace(world_size=2, global_batch_size=4, tp_degrees_allowed=(1, 2), max_pipeline_stages=2,
                         overlap_choices=(1, 2), recompute_ratios=(0.0, 0.5))
    assert candidate_layouts(search) == [
        Layout(2, 1, 1, 1, 1, 0.0),
        Layout(1, 2, 1, 2, 1, 0.0),
        Layout(1, 2, 1, 2, 1, 0.5),
        Layout(1, 2, 1, 4, 1, 0.0),
        Layout(1, 2, 1, 4, 1, 0.5),
        Layout(1, 1, 2, 1, 1, 0.0),
        Layout(1, 1, 2, 1, 2, 0.0),
    ]


def test_plan_needs_exactly_the_required_profile_keys():
    full, search = synthetic_model(), space()
    keys = required_profile_keys(search, full.num_blocks)
    assert keys.all_reduce_group_sizes == {2, 4, 8}
    assert keys.tp_degrees == {1, 2, 4}
    assert {samples for _, samples in keys.block_times} == keys.prefix_suffix_samples
    exact = dataclasses.replace(
        full,
        block_times={key: full.block_times[key] for key in keys.block_times},
        prefix_times={samples: full.prefix_times[samples] for samples in keys.prefix_suffix_samples},
        suffix_times={samples: full.suffix_times[samples] for samples in keys.prefix_suffix_samples},
    )
    assert plan(search, exact, SLOW) == plan(search, full, SLOW)
    missing_key = min(keys.block_times)
    lacking = dataclasses.replace(exact, block_times={key: value for key, value in exact.block_times.items()
                                                      if key != missing_key})
    with pytest.raises(ValueError, match=rf"lack entries the search needs: block_times\[\({missing_key[0]}, "):
        plan(search, lacking, SLOW)
    lacking_network = NetworkProfile(all_reduce={2: SLOW.all_reduce[2]}, p2p=SLOW.p2p)
    with pytest.raises(ValueError, match=r"network.all_reduce\[4\], network.all_reduce\[8\]"):
        plan(search, full, lacking_network)


@pytest.mark.parametrize("net", [FAST, SLOW], ids=["fast", "slow"])
def test_plan_picks_the_brute_force_optimum(net):
    profile, search = synthetic_model(), space(memory_limit_bytes=6e9)
    result = plan(search, profile, net)
    predictions = [predict(layout, profile, net, search) for layout in candidate_layouts(search, profile.num_blocks)]
    fitting = [prediction for prediction in predictions if prediction.fits]
    assert result.best == min(fitting, key=rank_key)
    assert result.runner_up == sorted(fitting, key=rank_key)[1]
    assert list(result.ranked) == sorted(fitting, key=rank_key)
    assert len(result.ranked) + len(result.rejected) == len(predictions)


def test_plan_is_deterministic_and_breaks_ties_by_the_fixed_order():
    profile, search = synthetic_model(num_blocks=2), space(world_size=4, tp_degrees_allowed=(1,), max_pipeline_stages=4)
    first, second = plan(search, profile, SLOW), plan(search, profile, SLOW)
    assert first == second
    assert [rank_key(prediction) for prediction in first.ranked] == sorted(map(rank_key, first.ranked))
    # On 4 stages of [prefix, block, block, suffix] each stage holds at most one block, so
    # ratio 0.5 recomputes floor(1 x r_i) = 0 blocks: the same time as no recompute, ranked after it.
    ties = [prediction for prediction in first.ranked if prediction.layout.pp == 4]
    by_micro_batches = {}
    for prediction in ties:
        by_micro_batches.setdefault(prediction.layout.micro_batches, []).append(prediction)
    for group in by_micro_batches.values():
        none, half = (next(p for p in group if p.layout.recompute_ratio == ratio) for ratio in (0.0, 0.5))
        assert none.step_time_s == half.step_time_s
        assert first.ranked.index(none) < first.ranked.index(half)


def test_memory_limit_excludes_layouts_and_changes_the_pick():
    profile = synthetic_model()
    unlimited = plan(space(), profile, SLOW)
    limit = unlimited.best.memory_bytes - 1
    limited = plan(space(memory_limit_bytes=limit), profile, SLOW)
    assert limited.best.layout != unlimited.best.layout
    assert limited.best.step_time_s >= unlimited.best.step_time_s
    assert all(prediction.memory_bytes <= limit for prediction in limited.ranked)
    reasons = dict(limited.rejected)
    assert f"memory_limit_bytes={limit:.0f}" in reasons[unlimited.best.layout]
    assert len(limited.ranked) + len(limited.rejected) == len(unlimited.ranked)


def test_plan_says_what_to_change_when_nothing_fits():
    profile = synthetic_model()
    smallest = min(predict(layout, profile, SLOW, space()).memory_bytes
                   for layout in candidate_layouts(space(), profile.num_blocks))
    with pytest.raises(ValueError, match=rf"no layout fits memory_limit_bytes=1000; the smallest needs {smallest:.0f} "
                                         r"bytes .*raise the limit or the world size"):
        plan(space(memory_limit_bytes=1000), profile, SLOW)


def test_plan_refuses_an_empty_space():
    with pytest.raises(ValueError, match="no candidate layout"):
        plan(space(global_batch_size=3, tp_degrees_allowed=(1,)), synthetic_model(), SLOW)


def test_describe_names_the_choice_the_runner_up_and_the_components():
    result = plan(space(), synthetic_model(), SLOW)
    text = result.describe()
    assert f"planner chose {result.best.layout.describe()}" in text
    assert f"runner-up {result.runner_up.layout.describe()}" in text
    assert all(name in text for name in COMPONENTS)
    assert len(text.splitlines()) == 4


def test_search_over_hundreds_of_layouts_is_fast():
    search = SearchSpace(world_size=32, global_batch_size=128, tp_degrees_allowed=TP_DEGREES, max_pipeline_stages=8,
                         micro_batch_choices=(1, 2, 4, 8, 16, 32))
    profile = synthetic_model(num_blocks=24)
    assert len(candidate_layouts(search, profile.num_blocks)) >= 250
    timings = []
    for _ in range(3):  # the fastest of three: the other test worker's load inflates even CPU time (0.4 s idle, 1.2 s)
        started = time.process_time()
        plan(search, profile, SLOW)
        timings.append(time.process_time() - started)
    assert min(timings) < 1.0, timings


def test_replica_batch_ranks_by_time_per_sample():
    """Under merak3d a dataloader's batch is per replica: dp=2 trains twice the samples per step."""
    search = SearchSpace(world_size=2, global_batch_size=None, replica_batch_size=4, tp_degrees_allowed=(1, 2),
                         max_pipeline_stages=2, overlap_choices=(1,), recompute_ratios=(0.0,))
    result = plan(search, synthetic_model(), FAST)
    by_layout = {(p.layout.dp, p.layout.pp, p.layout.tp): p for p in result.ranked}
    assert by_layout[(2, 1, 1)].samples_per_step == 8
    assert by_layout[(1, 1, 2)].samples_per_step == 4
    per_sample = [p.time_per_sample_s for p in result.ranked]
    assert per_sample == sorted(per_sample)
    with pytest.raises(ValueError, match="exactly one"):
        SearchSpace(world_size=2, global_batch_size=8, replica_batch_size=4, tp_degrees_allowed=(1,),
                    max_pipeline_stages=1)
