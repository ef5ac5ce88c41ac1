"""benchmarks.merak3d's heavy-head leg, simulated: AutoPipe with and without the LM head split over the stages.

The node costs are the ones the benchmark measures on its heavy-head Llama (vocabulary 32k, 8 blocks), made
less noisy and scaled: every block takes the median block's measured cost, the head's (and the embedding's
backward, a dense gradient of the whole table) time, parameters and saved bytes grow with the vocabulary, and
the trunk gets 8 or 16 blocks. Each row is AutoPipe's split simulated under 1F1B with ``2 × stages``
micro-batches; ``max_over_mean_stage_time`` is the worst stage's forward+backward over the mean, and
``memory_max_over_mean`` the fullest stage's estimated peak bytes (AutoPipe's memory model: parameters,
gradients and optimizer state, activations of the micro-batches in flight) over the mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import product
from typing import Any

from lightning_merak.parallel import pipeline

MEASURED_VOCAB = 32000
VOCABS, LAYERS, STAGES = (32000, 128000), (8, 16), (2, 4, 8, 16)


def scaled_costs(costs: list[pipeline.BlockCost], layers: int, vocab: int) -> list[pipeline.BlockCost]:
    """The measured ``[prefix, blocks…, suffix]`` costs with ``layers`` median blocks and a ``vocab``-row head."""
    prefix, blocks, suffix = costs[0], costs[1:-1], costs[-1]
    median = sorted(blocks, key=lambda block: block.forward_s + block.resolved_backward_s())[len(blocks) // 2]
    factor = vocab / MEASURED_VOCAB
    return [
        replace(prefix, backward_s=prefix.backward_s * factor, param_bytes=int(prefix.param_bytes * factor)),
        *(replace(median, name=f"model.layers.{index}") for index in range(layers)),
        replace(suffix, forward_s=suffix.forward_s * factor, backward_s=suffix.backward_s * factor,
                param_bytes=int(suffix.param_bytes * factor), saved_bytes=int(suffix.saved_bytes * factor)),
    ]


def max_over_mean(values: Sequence[float]) -> float:
    """The largest of ``values`` over their mean."""
    return max(values) / (sum(values) / len(values))


def max_over_mean_stage_time(partition: pipeline.Partition) -> float:
    """The worst stage's forward+backward time over the mean stage's."""
    return max_over_mean([f + b for f, b in zip(partition.stage_forward_s, partition.stage_backward_s)])


def simulated_rows(costs: list[pipeline.BlockCost]) -> list[dict[str, Any]]:
    """One row per (vocabulary, blocks, stages) with fewer stages than blocks: AutoPipe alone and with the split."""
    rows = []
    for vocab, layers, stages in product(VOCABS, LAYERS, STAGES):
        if stages > layers:
            continue
        scaled, micro_batches = scaled_costs(costs, layers, vocab), 2 * stages
        row: dict[str, Any] = {"section": "vocab_stages", "label": "simulated", "vocab": vocab, "layers": layers,
                               "stages": stages, "micro_batches": micro_batches}
        for key, split in (("autopipe", False), ("vocab_stages", True)):
            partition = pipeline.partition_autopipe(scaled, stages, micro_batches, vocab_stages=split)
            simulated = pipeline.simulate_schedule(partition.stage_forward_s, partition.stage_backward_s,
                                                   micro_batches, "1f1b")
            memory = partition.stage_memory_bytes or (0,)
            row.update({f"{key}_boundaries": list(partition.boundaries),
                        f"{key}_max_over_mean": max_over_mean_stage_time(partition),
                        f"{key}_memory_max_over_mean": max_over_mean(memory),
                        f"{key}_iteration_ms": simulated.iteration_s * 1e3})
        row["simulated_speedup"] = row["autopipe_iteration_ms"] / row["vocab_stages_iteration_ms"]
        rows.append(row)
    return rows


def heavy_head_max_over_mean(rows: list[dict[str, Any]]) -> float:
    """The goal figure: the worst stage over the mean with the split, worst case over the simulated rows."""
    return max(row["vocab_stages_max_over_mean"] for row in rows)


def timeline(costs: list[pipeline.BlockCost], stages: int) -> pipeline.SimulationResult:
    """The simulated 1F1B iteration of AutoPipe's split with the head over the stages, on the measured costs."""
    partition = pipeline.partition_autopipe(costs, stages, 2 * stages, vocab_stages=True)
    return pipeline.simulate_schedule(partition.stage_forward_s, partition.stage_backward_s, 2 * stages, "1f1b")
