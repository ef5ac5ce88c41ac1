"""Pipeline partitioner and schedule simulator: exact optimality, baselines, AutoPipe, memory, schedules, plots."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_merak.parallel.pipeline import (
    BlockCost,
    Partition,
    blocks_to_recompute,
    build_partition,
    estimate_stage_memory_bytes,
    high_fan_out_nodes,
    merge_skip_connections,
    partition_autopipe,
    partition_by_parameters,
    partition_min_max,
    partition_uniform,
    peak_inflight_microbatches,
    plot_timeline,
    simulate_schedule,
    stage_aware_recompute_ratios,
    stage_op_order,
)


def block(name: str, forward_s: float = 1.0, backward_s: float = 0.0, **fields) -> BlockCost:
    defaults = {"param_bytes": 100, "output_bytes": 10, "saved_bytes": 50}
    return BlockCost(name, forward_s, backward_s, **(defaults | fields))


def language_model(num_layers: int, head_forward_s: float = 1.0) -> list[BlockCost]:
    """Embedding, numbered transformer blocks, final norm and a vocabulary-sized head."""
    return [
        block("model.embed_tokens", 0.1, param_bytes=800, is_embedding=True),
        *(block(f"model.layers.{index}") for index in range(num_layers)),
        block("model.norm", 0.05, param_bytes=1),
        block("lm_head", head_forward_s, param_bytes=800),
    ]


def allowed_boundaries(blocks: list[BlockCost], num_stages: int):
    group_starts = [group[0] for group in merge_skip_connections(blocks)][1:]
    for cuts in itertools.combinations(group_starts, num_stages - 1):
        yield (0, *cuts)


def simulated_s(partition: Partition, num_microbatches: int, p2p_s: float = 0.0) -> float:
    return simulate_schedule(
        partition.stage_forward_s, partition.stage_backward_s, num_microbatches, p2p_s=p2p_s
    ).iteration_s


def random_blocks(rng: random.Random, num_blocks: int, with_skips: bool = False) -> list[BlockCost]:
    blocks = []
    for index in range(num_blocks):
        consumes = (rng.randrange(index - 1),) if with_skips and index >= 2 and rng.random() < 0.2 else ()
        blocks.append(
            block(
                f"b{index}",
                rng.uniform(0.1, 3.0),
                rng.choice([0.0, rng.uniform(0.1, 6.0)]),
                param_bytes=rng.randrange(1, 1000),
                consumes=consumes,
            )
        )
    return blocks


# --- min-max and the baselines --------------------------------------------------------------


def test_min_max_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        blocks = random_blocks(rng, rng.randint(3, 9), with_skips=True)
        num_groups = len(merge_skip_connections(blocks))
        num_stages = rng.randint(1, min(4, num_groups))
        partition = partition_min_max(blocks, num_stages)
        stage_totals = [f + b for f, b in zip(partition.stage_forward_s, partition.stage_backward_s)]
        brute_force = min(
            max(f + b for f, b in zip(split.stage_forward_s, split.stage_backward_s))
            for split in (build_partition(blocks, cuts, "brute") for cuts in allowed_boundaries(blocks, num_stages))
        )
        assert max(stage_totals) == pytest.approx(brute_force, rel=1e-12)
        assert partition.boundaries in set(allowed_boundaries(blocks, num_stages))


def test_partition_by_parameters_is_optimal_against_brute_force():
    rng = random.Random(1)
    for _ in range(40):
        blocks = random_blocks(rng, rng.randint(3, 8))
        num_stages = rng.randint(1, 3)
        partition = partition_by_parameters(blocks, num_stages)
        brute_force = min(
            max(build_partition(blocks, cuts, "brute").stage_param_bytes)
            for cuts in allowed_boundaries(blocks, num_stages)
        )
        assert max(partition.stage_param_bytes) == brute_force
        assert partition.method == "parameters"


def test_missing_backward_uses_the_backward_ratio():
    blocks = [block("a", 1.0), block("b", 2.0, 5.0)]
    assert partition_min_max(blocks, 1).stage_backward_s == (7.0,)
    assert partition_min_max(blocks, 1, backward_ratio=3.0).stage_backward_s == (8.0,)


def test_uniform_puts_embedding_first_and_head_last():
    blocks = language_model(8)
    partition = partition_uniform(blocks, 4)
    assert partition.boundaries == (0, 3, 5, 7)
    assert [blocks[index].name for index in partition.blocks_of(3, len(blocks))] == [
        "model.layers.6",
        "model.layers.7",
        "model.norm",
        "lm_head",
    ]
    assert partition.method == "uniform"


def test_uniform_gives_extra_layers_to_the_first_stages():
    blocks = language_model(10)
    partition = partition_uniform(blocks, 4)
    layers_per_stage = [
        sum(blocks[index].name.startswith("model.layers.") for index in partition.blocks_of(stage, len(blocks)))
        for stage in range(4)
    ]
    assert layers_per_stage == [3, 3, 2, 2]


def test_uniform_layer_detection_fallbacks():
    unnamed = [block("embed", is_embedding=True), block("first"), block("second"), block("third")]
    assert partition_uniform(unnamed, 3).boundaries == (0, 2, 3)
    custom = partition_uniform(language_model(4), 2, is_layer=lambda cost: cost.name in {"model.layers.0", "lm_head"})
    assert custom.boundaries == (0, 6)
    with pytest.raises(ValueError, match="transformer block per stage.*pipeline_parallel<=2"):
        partition_uniform(language_model(2), 3)


def test_partition_lookups():
    partition = partition_uniform(language_model(4), 2)
    assert partition.boundaries == (0, 3)
    assert [partition.stage_of(index) for index in range(7)] == [0, 0, 0, 1, 1, 1, 1]
    assert partition.blocks_of(0, 7) == range(0, 3)
    assert partition.blocks_of(1, 7) == range(3, 7)
    with pytest.raises(ValueError):
        partition.blocks_of(2, 7)


def test_stage_count_errors_name_the_fix():
    blocks = [block(f"model.layers.{index}") for index in range(6)]
    with pytest.raises(
        ValueError,
        match=r"pipeline_parallel=8 exceeds the 6 blocks that can be placed in separate stages; "
        r"use pipeline_parallel<=6",
    ):
        partition_min_max(blocks, 8)
    skipped = [*blocks[:3], block("model.layers.3", consumes=(0,)), *blocks[4:]]
    for partitioner in (partition_uniform, partition_by_parameters, partition_min_max):
        with pytest.raises(ValueError, match=r"exceeds the 4 blocks .*tie the 6 blocks.*pipeline_parallel<=4"):
            partitioner(skipped, 5)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        partition_by_parameters(blocks, 0)
    with pytest.raises(ValueError, match="pipeline_parallel<=6"):
        partition_autopipe(blocks, 7, 8)


# --- skip connections -------------------------------------------------------------------------


def test_skip_connection_merges_the_blocks_it_spans():
    blocks = [block(f"n{index}") for index in range(6)]
    blocks[4] = block("n4", consumes=(1,))
    assert merge_skip_connections(blocks) == [[0], [1, 2, 3], [4], [5]]


def test_reading_the_predecessor_does_not_merge():
    blocks = [block("n0"), block("n1", consumes=(0,)), block("n2", consumes=(1,)), block("n3", consumes=(1, 2))]
    assert merge_skip_connections(blocks) == [[0], [1, 2], [3]]


def test_overlapping_skips_chain_into_one_group():
    blocks = [block(f"n{index}") for index in range(7)]
    blocks[3] = block("n3", consumes=(0,))
    blocks[5] = block("n5", consumes=(2,))
    assert merge_skip_connections(blocks) == [[0, 1, 2, 3, 4], [5], [6]]


def test_high_fan_out_values_are_carried_not_merged():
    mask_readers = [block(f"layer{index}", consumes=(0,)) for index in range(5)]
    blocks = [block("mask"), block("embed"), *mask_readers]
    assert high_fan_out_nodes(blocks) == frozenset({0})
    assert merge_skip_connections(blocks) == [[index] for index in range(7)]

    five_readers = [block("mask"), block("embed"), *mask_readers[:4]]
    assert high_fan_out_nodes(five_readers) == frozenset()
    assert merge_skip_connections(five_readers) == [[0, 1, 2, 3, 4], [5]]

    side_values = ("attention_mask", "rotary")
    named = [block("embed"), *(block(f"layer{index}", fan_out_values=side_values) for index in range(4))]
    assert merge_skip_connections(named) == [[index] for index in range(5)]


def test_partitioners_never_cut_inside_a_group():
    heavy = [block(f"n{index}", forward_s=4.0 if index in (1, 2) else 1.0) for index in range(6)]
    unconstrained = partition_min_max(heavy, 3).boundaries
    heavy[3] = block("n3", consumes=(1,))
    groups = merge_skip_connections(heavy)
    assert [1, 2] in groups and 2 in unconstrained
    for partition in (
        partition_min_max(heavy, 3),
        partition_by_parameters(heavy, 3),
        partition_uniform(heavy, 3),
        partition_autopipe(heavy, 3, 4),
    ):
        assert 2 not in partition.boundaries
        assert len(partition.boundaries) == 3


def test_invalid_consumes_is_rejected():
    with pytest.raises(ValueError, match="consumes must name earlier nodes"):
        merge_skip_connections([block("a"), block("b", consumes=(1,))])


# --- AutoPipe ------------------------------------------------------------------------------------


def test_autopipe_is_never_worse_than_min_max():
    rng = random.Random(2)
    for _ in range(40):
        blocks = random_blocks(rng, rng.randint(4, 10))
        num_stages, num_microbatches = rng.randint(2, 4), rng.choice([2, 4, 8])
        p2p_s = rng.choice([0.0, 0.2])
        autopipe = partition_autopipe(blocks, num_stages, num_microbatches, p2p_s=p2p_s)
        min_max = partition_min_max(blocks, num_stages)
        assert simulated_s(autopipe, num_microbatches, p2p_s) <= simulated_s(min_max, num_microbatches, p2p_s) + 1e-9
        assert autopipe.method == "autopipe"


def test_autopipe_improves_on_min_max_with_a_heavy_head():
    blocks = language_model(8, head_forward_s=2.5)
    min_max = partition_min_max(blocks, 3)
    autopipe = partition_autopipe(blocks, 3, num_microbatches=4)
    assert min_max.boundaries == (0, 4, 8)
    assert simulated_s(min_max, 4) == pytest.approx(66.6)
    # The middle stage is critical; handing its first layer to stage 0 makes the largest stage
    # larger, yet the simulated 1F1B iteration shorter: a gain min-max cannot see.
    assert autopipe.boundaries == (0, 5, 8)
    assert simulated_s(autopipe, 4) == pytest.approx(63.9)
    best = min(simulated_s(build_partition(blocks, cuts, "brute"), 4) for cuts in allowed_boundaries(blocks, 3))
    assert simulated_s(autopipe, 4) == pytest.approx(best)


def test_stage_memory_model():
    blocks = [block(f"n{index}", param_bytes=10, saved_bytes=100, output_bytes=5) for index in range(4)]
    assert estimate_stage_memory_bytes(blocks, (0, 2), 4, optimizer_bytes_per_param_byte=2.0) == (480, 280)
    # Stage 0 checkpoints block 0: it keeps that block's input (none: it is the first) and replays it once.
    assert estimate_stage_memory_bytes(blocks, (0, 2), 4, 2.0, recompute_ratios=[0.5, 0.0]) == (380, 280)
    # Stage 1 holds one micro-batch: checkpointing block 2 keeps its 5-byte input but replays its 100 bytes.
    assert estimate_stage_memory_bytes(blocks, (0, 2), 4, 2.0, recompute_ratios=[0.0, 0.5]) == (480, 285)
    assert estimate_stage_memory_bytes(blocks, (0, 2), 1, 2.0) == (280, 280)


def test_autopipe_respects_the_memory_limit():
    blocks = [block(f"n{index}", param_bytes=0, saved_bytes=100, output_bytes=0) for index in range(6)]
    assert partition_autopipe(blocks, 2, 4).boundaries == (0, 3)
    limited = partition_autopipe(blocks, 2, 4, memory_limit_bytes=500)
    assert limited.boundaries == (0, 2)
    assert limited.stage_memory_bytes == (400, 400)
    with pytest.raises(ValueError, match=r"fits memory_limit_bytes=300.*needs 400 bytes.*>= 400"):
        partition_autopipe(blocks, 2, 4, memory_limit_bytes=300)


def test_recompute_lets_a_split_fit_and_costs_time():
    blocks = [block(f"n{index}", param_bytes=0, saved_bytes=100, output_bytes=0) for index in range(6)]
    partition = partition_autopipe(blocks, 2, 4, memory_limit_bytes=300, recompute_ratios=[1.0, 0.0])
    assert partition.boundaries == (0, 3)
    assert partition.stage_memory_bytes == (100, 300)
    assert partition.stage_recompute_s == (3.0, 0.0)
    with pytest.raises(ValueError, match="recompute_ratios needs 2 values"):
        partition_autopipe(blocks, 2, 4, recompute_ratios=[0.5])


# --- schedule simulation -----------------------------------------------------------------------------


def timeline(result) -> list[tuple[int, str, int, float, float]]:
    return [(op.stage, op.kind, op.microbatch, op.start_s, op.end_s) for op in result.ops]


def test_1f1b_matches_a_hand_computed_timeline():
    result = simulate_schedule([1.0, 1.0], [2.0, 2.0], num_microbatches=3)
    assert timeline(result) == [
        (0, "F", 0, 0.0, 1.0),
        (0, "F", 1, 1.0, 2.0),
        (0, "B", 0, 4.0, 6.0),
        (0, "F", 2, 6.0, 7.0),
        (0, "B", 1, 7.0, 9.0),
        (0, "B", 2, 10.0, 12.0),
        (1, "F", 0, 1.0, 2.0),
        (1, "B", 0, 2.0, 4.0),
        (1, "F", 1, 4.0, 5.0),
        (1, "B", 1, 5.0, 7.0),
        (1, "F", 2, 7.0, 8.0),
        (1, "B", 2, 8.0, 10.0),
    ]
    assert result.iteration_s == 12.0
    assert result.bubble_fraction == pytest.approx(1 - 18 / 24)
    assert result.critical_stage == 1
    path = [(op.stage, op.kind, op.microbatch) for op in result.critical_path]
    steady = [(1, "F", 0), (1, "B", 0), (1, "F", 1), (1, "B", 1), (1, "F", 2), (1, "B", 2)]
    assert path == [(0, "F", 0), *steady, (0, "B", 2)]


def test_1f1b_with_p2p_latency():
    result = simulate_schedule([1.0, 1.0], [2.0, 2.0], num_microbatches=3, p2p_s=0.5)
    stage_one = [(op.kind, op.microbatch, op.start_s) for op in result.ops if op.stage == 1]
    assert stage_one == [("F", 0, 1.5), ("B", 0, 2.5), ("F", 1, 4.5), ("B", 1, 5.5), ("F", 2, 8.5), ("B", 2, 9.5)]
    assert result.iteration_s == 14.0


def test_gpipe_matches_a_hand_computed_timeline():
    result = simulate_schedule([1.0, 1.0], [2.0, 2.0], num_microbatches=2, schedule="gpipe")
    assert timeline(result) == [
        (0, "F", 0, 0.0, 1.0),
        (0, "F", 1, 1.0, 2.0),
        (0, "B", 0, 5.0, 7.0),
        (0, "B", 1, 7.0, 9.0),
        (1, "F", 0, 1.0, 2.0),
        (1, "F", 1, 2.0, 3.0),
        (1, "B", 0, 3.0, 5.0),
        (1, "B", 1, 5.0, 7.0),
    ]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 2), (4, 8), (4, 3), (8, 16)])
def test_bubble_fraction_of_uniform_stages(schedule, num_stages, num_microbatches):
    result = simulate_schedule([1.0] * num_stages, [2.0] * num_stages, num_microbatches, schedule)
    expected = (num_stages - 1) / (num_microbatches + num_stages - 1)
    assert result.bubble_fraction == pytest.approx(expected)
    assert result.iteration_s == pytest.approx(3.0 * (num_microbatches + num_stages - 1))


def test_1f1b_warmup_order_and_inflight_peak():
    assert stage_op_order(0, 4, 8, "1f1b")[:5] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
    assert stage_op_order(3, 4, 2, "1f1b") == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert stage_op_order(0, 4, 2, "1f1b") == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    for schedule, num_stages, num_microbatches in itertools.product(["1f1b", "gpipe"], [1, 3, 4], [1, 2, 6]):
        for stage in range(num_stages):
            live = peak = 0
            for kind, _ in stage_op_order(stage, num_stages, num_microbatches, schedule):
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            assert peak == peak_inflight_microbatches(stage, num_stages, num_microbatches, schedule)
    assert peak_inflight_microbatches(0, 4, 8, "1f1b") == 4
    assert peak_inflight_microbatches(0, 4, 8, "gpipe") == 8


def test_recompute_runs_before_each_backward():
    result = simulate_schedule([1.0, 1.0], [2.0, 2.0], 2, stage_recompute_s=[1.0, 0.0])
    stage_zero = [(op.kind, op.microbatch, op.start_s, op.end_s) for op in result.ops if op.stage == 0]
    assert stage_zero == [
        ("F", 0, 0.0, 1.0),
        ("F", 1, 1.0, 2.0),
        ("R", 0, 4.0, 5.0),
        ("B", 0, 5.0, 7.0),
        ("R", 1, 7.0, 8.0),
        ("B", 1, 8.0, 10.0),
    ]
    assert result.iteration_s == 10.0
    assert result.bubble_fraction == pytest.approx(1 - 14 / 20)


def test_recompute_ahead_overlaps_the_gradient_wait():
    result = simulate_schedule([1.0, 1.0], [2.0, 2.0], 2, stage_recompute_s=[1.0, 0.0], recompute_ahead=True)
    stage_zero = [(op.kind, op.microbatch, op.start_s) for op in result.ops if op.stage == 0]
    assert stage_zero == [("F", 0, 0.0), ("F", 1, 1.0), ("R", 0, 2.0), ("B", 0, 4.0), ("R", 1, 6.0), ("B", 1, 7.0)]
    assert result.iteration_s == 9.0


def test_critical_stage_is_the_slowest_one():
    result = simulate_schedule([1.0, 1.0, 3.0, 1.0], [2.0, 2.0, 6.0, 2.0], 8)
    assert result.critical_stage == 2
    assert result.iteration_s == pytest.approx(max(op.end_s for op in result.ops))


def test_simulator_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown schedule"):
        simulate_schedule([1.0], [1.0], 2, schedule="interleaved")
    with pytest.raises(ValueError, match="one entry per stage"):
        simulate_schedule([1.0, 1.0], [1.0], 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        simulate_schedule([1.0], [1.0], 0)


# --- stage-aware recompute -------------------------------------------------------------------------


def test_stage_aware_ratios_follow_the_formula():
    assert stage_aware_recompute_ratios(0.5, 4) == pytest.approx([0.5, 0.25, 0.0, 0.0])
    assert stage_aware_recompute_ratios(0.9, 4) == pytest.approx([0.9, 0.85, 0.7, 0.0])
    assert stage_aware_recompute_ratios(1.0, 3) == [1.0, 1.0, 0.0]
    assert stage_aware_recompute_ratios(0.0, 3) == [0.0, 0.0, 0.0]
    assert stage_aware_recompute_ratios(0.6, 1) == [0.6]
    ratios = stage_aware_recompute_ratios(0.8, 8)
    assert ratios[-1] == 0.0 and all(0.0 <= ratio <= 1.0 for ratio in ratios)
    assert ratios == sorted(ratios, reverse=True)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="first_stage_ratio"):
            stage_aware_recompute_ratios(bad, 4)


def test_blocks_to_recompute_floors():
    assert blocks_to_recompute(7, 0.5) == 3
    assert blocks_to_recompute(100, 0.29) == 29
    assert blocks_to_recompute(4, 1.0) == 4
    assert blocks_to_recompute(0, 0.5) == 0
    with pytest.raises(ValueError):
        blocks_to_recompute(4, 1.2)


# --- plot --------------------------------------------------------------------------------------------


def test_plot_timeline_writes_a_png(tmp_path):
    result = simulate_schedule([1.0, 1.5, 1.0], [2.0, 3.0, 2.0], 4, stage_recompute_s=[0.5, 0.25, 0.0])
    path = plot_timeline(result, tmp_path / "plots" / "timeline.png", title="1F1B")
    assert path == tmp_path / "plots" / "timeline.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5_000
