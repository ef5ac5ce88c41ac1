"""What the layout planner needs of a model whose MoE layers run ``merak_ep``: the layers, and their exchange's link.

The thin, impure side of :mod:`lightning_merak.planning.planner.experts`. :func:`expert_layers_of` reads a
transformers MoE model's experts modules (the registry families
:func:`~lightning_merak.plugins.moe.experts.experts_modules` finds): experts per layer, top-k, hidden size,
one layer's expert bytes and which trunk blocks hold them. :func:`measure_all_to_all` times gloo's (or NCCL's)
``all_to_all_single`` over groups of each expert-group size, every group busy at once, as the expert groups
exchange during a step. :func:`grouped_experts` runs the experts with ``merak_ep``'s local grouped core while
the profiler times the blocks, so a block's time is the expert computation the run will do (its routes are
about as many on each rank of an expert group as on one rank holding every expert), not the family's own loop.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.parallel.pipeline.trace import find_trunk
from lightning_merak.planning.measure.layout import consecutive_group
from lightning_merak.planning.planner import CollectiveCost, ExpertLayers, fit_collective_cost
from lightning_merak.plugins.moe.experts.enable import experts_modules
from lightning_merak.plugins.moe.experts.grouped import EXPERT_TENSORS
from lightning_merak.plugins.moe.experts.parallel import GROUPED_IMPLEMENTATION, register
from lightning_merak.util.timing import median_call_time

__all__ = ["expert_layers_of", "experts_per_layer", "grouped_experts", "measure_all_to_all"]


def _moe_blocks(model: nn.Module) -> tuple[list[int], int, int]:
    """``(trunk positions of the MoE blocks, experts per layer, one layer's expert bytes)`` of ``model`` (whole, its
    experts not yet cut); refused where the planner cannot price the layers alike."""
    _, blocks = find_trunk(model)
    positions, layer_bytes, counts = [], set(), set()
    for index, block in enumerate(blocks):
        modules = experts_modules(block)
        if len(modules) > 1:
            raise ValueError(f"trunk block {index} holds {len(modules)} experts modules; the planner prices one per "
                             "block: fix the layout instead of 'auto'")
        for _, experts in modules:
            positions.append(index)
            counts.add(int(experts.num_experts))
            layer_bytes.add(sum(param.numel() * param.element_size() for tensor in EXPERT_TENSORS
                                if isinstance(param := getattr(experts, tensor, None), nn.Parameter)))
    if not positions:
        raise ValueError("moe.experts=merak_ep: the model's trunk holds no experts module of transformers' experts "
                         "registry; use a registry MoE family (plugins.moe.experts.EXACT_FAMILIES)")
    if len(counts) != 1 or len(layer_bytes) != 1:
        raise ValueError(f"the MoE layers differ (experts {sorted(counts)}, bytes {sorted(layer_bytes)}); the planner "
                         "prices identical layers: fix the layout instead of 'auto'")
    return positions, counts.pop(), layer_bytes.pop()


def experts_per_layer(model: nn.Module) -> int:
    """The experts of each of ``model``'s MoE layers: the expert-parallel sizes a plan may choose divide it."""
    return _moe_blocks(model)[1]


def expert_layers_of(model: nn.Module, tokens_per_sample: int, hidden_bytes_per_sample: int) -> ExpertLayers:
    """The MoE layers of ``model`` as ``merak_ep`` runs them, for samples of ``tokens_per_sample`` tokens whose hidden
    state takes ``hidden_bytes_per_sample`` (the exchanged rows have its dtype)."""
    positions, num_experts, layer_bytes = _moe_blocks(model)
    config = getattr(model, "config", None)
    top_k, hidden = getattr(config, "num_experts_per_tok", None), getattr(config, "hidden_size", None)
    if not isinstance(top_k, int) or not isinstance(hidden, int):
        raise ValueError("the model's config names no num_experts_per_tok and hidden_size; fix the layout instead "
                         "of 'auto'")
    return ExpertLayers(num_experts=num_experts, top_k=top_k, hidden_size=hidden, tokens_per_sample=tokens_per_sample,
                        moe_blocks=len(positions), expert_parameter_bytes=layer_bytes,
                        dtype_bytes=max(1, hidden_bytes_per_sample // (tokens_per_sample * hidden)),
                        block_indices=tuple(positions))


@contextmanager
def grouped_experts(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s registry experts with the single-process grouped core (``merak_grouped``) inside, then
    restore each module's own implementation."""
    register()
    configs = {id(experts.config): experts.config for _, experts in experts_modules(model)}
    before = {key: config._experts_implementation for key, config in configs.items()}
    for config in configs.values():
        config._experts_implementation = GROUPED_IMPLEMENTATION
    try:
        yield
    finally:
        for key, config in configs.items():
            config._experts_implementation = before[key]


def _sizes(small_bytes: int, large_bytes: int) -> list[int]:
    """Three or four message sizes from ``small_bytes`` to ``large_bytes``, about a factor of 8 apart."""
    sizes = [max(small_bytes, large_bytes)]
    while sizes[-1] // 8 > small_bytes and len(sizes) < 3:
        sizes.append(sizes[-1] // 8)
    return sorted({small_bytes, *sizes})


def measure_all_to_all(group_sizes: Iterable[int], device: torch.device, large_bytes: int, small_bytes: int = 4096,
                       repeats: int = 5) -> dict[int, CollectiveCost]:
    """The all-to-all link per group size: latency and bandwidth of the bytes one rank sends to the others.

    Groups of consecutive ranks (as merak3d's data-parallel groups are on one node), each rank's tensor of up to
    ``large_bytes`` split evenly over its group, so it sends ``(size - 1)/size`` of it; the median of ``repeats``
    per size. Every rank must call this; rank 0's figures are returned on every rank.
    """
    world = dist.get_world_size()
    links: dict[int, CollectiveCost] = {}
    for size in sorted({size for size in group_sizes if size > 1}):
        if world % size:
            raise ValueError(f"an expert group of {size} ranks does not divide the world of {world}")
        mine = consecutive_group(size)
        points = []
        for nbytes in _sizes(small_bytes, large_bytes):
            rows = torch.ones(size * max(1, nbytes // (4 * size)), device=device)
            received = torch.empty_like(rows)
            dist.barrier()
            seconds = median_call_time(lambda: dist.all_to_all_single(received, rows, group=mine), repeats,
                                       device)
            points.append((rows.numel() * 4 * (size - 1) / size, seconds))
        links[size] = fit_collective_cost(points)
    holder = [links]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
