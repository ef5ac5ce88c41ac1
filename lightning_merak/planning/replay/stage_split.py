"""The split of the blocks a pipelined run will use, derived from calibrated costs (pure).

merak3d partitions a pipeline at start-up with ``autopipe`` on costs it measures on one micro-batch: the
embedding, every block and the head, forward and backward, for the run's micro-batch count (no memory limit,
no recomputation, no send time). The split follows the micro-batch size: a block call's fixed time weighs more
on small micro-batches, the head's per-sample time more on large ones, so one model goes to three blocks and
one at two micro-batches of four samples and to two and two at eight of one. A traced pipeline's own split
therefore prices only its own micro-batch count; :func:`autopipe_stage_blocks` runs the same partitioner on
what a :class:`~lightning_merak.planning.replay.synthesize.StepCosts` prices those nodes at for another layout.
"""

from __future__ import annotations

import dataclasses

from lightning_merak.parallel.pipeline.costs import BlockCost
from lightning_merak.parallel.pipeline.partition import partition_autopipe
from lightning_merak.planning.replay.synthesize import LayoutSpec, ModelShape, StepCosts

__all__ = ["autopipe_stage_blocks", "partitioner_nodes", "with_autopipe_split"]


def partitioner_nodes(costs: StepCosts, shape: ModelShape, layout: LayoutSpec) -> list[BlockCost]:
    """The nodes the run's partitioner balances, priced by ``costs`` at ``layout``'s micro-batch: the first
    stage's own work beyond a later stage's (the embedding), ``shape.blocks`` blocks, and the head.

    As in the run's profile, the head holds no loss and no stage carries the loop's work between chunks (a
    trace's gaps): what the partitioner does not see must not move the split. Bytes are left at 0: the run
    partitions without a memory limit.
    """
    samples = layout.samples / layout.micro_batches / layout.tp
    prefix = [max(costs.chunk_seconds(0, samples, forward) - costs.chunk_seconds(1, samples, forward), 0.0)
              for forward in (True, False)]
    block = [costs.block_seconds(samples, forward) for forward in (True, False)]
    head = [costs.rest_seconds(samples, forward) for forward in (True, False)]
    return ([BlockCost("prefix", *prefix, 0, 0, 0, is_embedding=True)]
            + [BlockCost(f"blocks.{index}", *block, 0, 0, 0) for index in range(shape.blocks)]
            + [BlockCost("suffix", *head, 0, 0, 0)])


def autopipe_stage_blocks(costs: StepCosts, shape: ModelShape, layout: LayoutSpec) -> tuple[int, ...]:
    """Blocks per stage ``autopipe`` picks for ``layout`` from ``costs`` (:func:`partitioner_nodes`), as merak3d
    calls it at a run's start; () for an unpipelined layout. Raises (the partitioner's error) where the model
    has fewer blocks than stages."""
    if layout.pp < 2:
        return ()
    nodes = partitioner_nodes(costs, shape, layout)
    partition = partition_autopipe(nodes, layout.pp, layout.micro_batches)
    return tuple(sum(1 for node in partition.blocks_of(stage, len(nodes)) if 0 < node <= shape.blocks)
                 for stage in range(layout.pp))


def with_autopipe_split(costs: StepCosts, shape: ModelShape, layout: LayoutSpec) -> StepCosts:
    """``costs`` replaying ``layout`` at the split ``autopipe`` picks for it (:func:`autopipe_stage_blocks`);
    unchanged for an unpipelined layout."""
    if layout.pp < 2:
        return costs
    return dataclasses.replace(costs, stage_blocks=autopipe_stage_blocks(costs, shape, layout))
