"""The replay predictor prices a pipeline at the split merak3d's autopipe will pick for its micro-batches (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_merak.planning.replay.calibration import ReplayPredictor, TraceCalibration
from lightning_merak.planning.replay.call_curve import CallCurve
from lightning_merak.planning.replay.stage_split import autopipe_stage_blocks, partitioner_nodes, with_autopipe_split
from lightning_merak.planning.replay.synthesize import LayoutSpec, ModelShape, StepCosts, predict_layout

SHAPE = ModelShape(blocks=4, block_params=100_000, other_params=50_000, hidden=8, seq=4)
COSTS = StepCosts(block_forward_per_sample=0.00025, rest_forward_per_sample=0.00075, backward_ratio=2.0,
                  update_per_param=0.0, host_per_step=0.0, op_fixed_s=1e-5, link_bytes_per_s=1e9,
                  block_call_s=0.001, stage_blocks=(2, 2))
"""A block call: 1 ms fixed plus 0.25 ms a sample; the head 0.75 ms a sample, no fixed part. On one sample a block
(1.25 ms) outweighs the head (0.75 ms): two blocks on each stage balance best. On four samples the head (3 ms)
outweighs a block (2 ms): three blocks and one do."""


def _pipeline(micro_batches: int) -> LayoutSpec:
    return LayoutSpec(dp=1, pp=2, tp=1, micro_batches=micro_batches, samples=8)


def _priced_at(split: tuple[int, ...], layout: LayoutSpec) -> float:
    return predict_layout(dataclasses.replace(COSTS, stage_blocks=split), SHAPE, layout).step_time


def test_the_split_follows_the_micro_batch_size_as_autopipe_weighs_it() -> None:
    assert autopipe_stage_blocks(COSTS, SHAPE, _pipeline(8)) == (2, 2)  # one sample a micro-batch
    assert autopipe_stage_blocks(COSTS, SHAPE, _pipeline(2)) == (3, 1)  # four
    assert autopipe_stage_blocks(COSTS, SHAPE, LayoutSpec(2, 1, 1, 1, 8)) == ()
    assert with_autopipe_split(COSTS, SHAPE, LayoutSpec(2, 1, 1, 1, 8)) is COSTS
    with pytest.raises(ValueError, match="pipeline_parallel=8 exceeds"):
        autopipe_stage_blocks(COSTS, SHAPE, LayoutSpec(1, 8, 1, 8, 8))


def test_the_predictor_prices_another_micro_batch_count_at_its_own_split_not_the_traced_one() -> None:
    # a pipeline traced at 8 micro-batches, split 2 + 2 as autopipe picks it there
    calibration = TraceCalibration(COSTS, SHAPE, LayoutSpec(2, 1, 1, 1, 8), (((True, 1, 1), COSTS, 1.25),))
    predictor = ReplayPredictor(calibration)
    assert predictor.stage_blocks(_pipeline(8)) == (2, 2)
    assert predictor.step_time(_pipeline(8)) == pytest.approx(1.25 * _priced_at((2, 2), _pipeline(8)))
    # at 2 micro-batches the run will split 3 + 1, and the prediction follows it
    assert predictor.stage_blocks(_pipeline(2)) == (3, 1)
    assert predictor.step_time(_pipeline(2)) == pytest.approx(1.25 * _priced_at((3, 1), _pipeline(2)))
    assert _priced_at((3, 1), _pipeline(2)) < 0.95 * _priced_at((2, 2), _pipeline(2))  # the split matters
    # a run partitioned another way keeps the traced split
    uniform = ReplayPredictor(calibration, partition="uniform")
    assert uniform.stage_blocks(_pipeline(2)) == (2, 2)
    assert uniform.step_time(_pipeline(2)) == pytest.approx(1.25 * _priced_at((2, 2), _pipeline(2)))


def test_the_partitioner_sees_the_embedding_on_the_first_stage_and_no_loss_on_the_last() -> None:
    prefix = CallCurve((1.0, 4.0), (0.005, 0.010), (0.005, 0.010))  # a heavy embedding: 5 ms each way on 1 sample
    costs = dataclasses.replace(COSTS, chunk_forward_s=0.006, prefix_curve=prefix, curve_reference_samples=1.0)
    nodes = partitioner_nodes(costs, SHAPE, _pipeline(2))
    assert [node.name for node in nodes] == ["prefix", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "suffix"]
    assert (nodes[0].forward_s, nodes[0].backward_s) == pytest.approx((0.010, 0.010))  # the embedding at 4 samples
    assert (nodes[1].forward_s, nodes[1].backward_s) == pytest.approx((0.002, 0.004))
    assert (nodes[-1].forward_s, nodes[-1].backward_s) == pytest.approx((0.003, 0.006))  # the head
    assert autopipe_stage_blocks(costs, SHAPE, _pipeline(8)) == (1, 3)  # the embedding takes a block's place
    # the last stage's loss between chunks is the loop's work, which the run's partitioner does not time
    with_loss = dataclasses.replace(COSTS, chunk_host_s=(0.0, 0.5), chunk_host_after_backward_s=(0.0, 0.5))
    assert partitioner_nodes(with_loss, SHAPE, _pipeline(8)) == partitioner_nodes(COSTS, SHAPE, _pipeline(8))
