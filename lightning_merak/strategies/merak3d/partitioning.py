"""Where merak3d cuts the pipeline: rank 0 runs the chosen partitioner on its measured node costs, priced with the
optimizer's per-parameter work where AutoPipe cuts, and every rank takes that partition."""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_merak.parallel import pipeline
from lightning_merak.parallel.layout import Layout
from lightning_merak.parallel.pipeline.trace import ModelTrace
from lightning_merak.strategies.merak3d.vocab_stages_build import vocab_split_autopipe

__all__ = ["agree_on_partition"]


def agree_on_partition(trace: ModelTrace, layout: Layout, method: str, global_rank: int,
                       broadcast: Callable[[Any, int], Any], vocab_stages: str = "off", split_embedding: bool = False,
                       model: Optional[nn.Module] = None,
                       optimizer_seconds: Optional[Callable[[], Mapping[int, float]]] = None) -> Any:
    """Rank 0 partitions its measured costs; every rank uses that partition (with ``vocab_stages`` 'on' or 'auto',
    AutoPipe and min-max price the head, and with ``split_embedding`` the input embedding, split over the
    stages). AutoPipe also prices ``optimizer_seconds()`` (seconds by id of ``model``'s parameters, called on rank 0
    only), divided over the data-parallel replicas, among which each Muon matrix has one owner."""
    num_stages = layout.num_stages
    partition = None
    if global_rank == 0:
        if optimizer_seconds is not None and model is not None and method == "autopipe":
            trace = copy.copy(trace)
            trace.costs = pipeline.with_optimizer_seconds(trace.costs, trace.node_parameters(model),
                                                          optimizer_seconds(), layout.data_parallel)
        partitioners = {
            "autopipe": lambda: vocab_split_autopipe(trace, layout, vocab_stages, split_embedding),
            "min_max": lambda: pipeline.partition_min_max(trace.costs, num_stages, vocab_stages=vocab_stages == "on",
                                                          split_embedding=split_embedding),
            "parameters": lambda: pipeline.partition_by_parameters(trace.costs, num_stages),
            "uniform": lambda: pipeline.partition_uniform(trace.costs, num_stages),
        }
        partition = partitioners[method]()
    partition = broadcast(partition, 0)
    optimizer = ("" if partition.stage_optimizer_s is None else ", optimizer work per stage "
                 f"{[round(seconds * 1e3, 1) for seconds in partition.stage_optimizer_s]} ms")
    rank_zero_info(f"merak3d: {method} partition, stage boundaries {partition.boundaries} over "
                   f"{[cost.name for cost in trace.costs]}{optimizer}")
    return partition
