"""Measure the cost model's constants on this machine, collectively over one EP group.

Every rank runs the same timings; the slowest rank's figure wins (an all-reduce MAX),
so all ranks hold bitwise identical constants and plan identically.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.plugins.moe.core.placement_cost_model import CommCurve, CostModel
from lightning_merak.timing import median_call_time

__all__ = ["profile_cost_model"]

_SIZES_BYTES = (1 << 10, 1 << 13, 1 << 16, 1 << 19, 1 << 22)


def profile_cost_model(
    expert: nn.Module,
    hidden_size: int,
    experts_per_rank: int,
    group: Any,
    ep_ranks: Sequence[int],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    repeats: int = 3,
) -> CostModel:
    """All-to-all and point-to-point curves at log-spaced sizes from 1 KiB, and expert throughput."""
    ep_size = len(ep_ranks)
    rank = dist.get_rank(group) if ep_size > 1 else 0
    element = torch.tensor([], dtype=dtype).element_size()
    figures = []
    for size in _SIZES_BYTES:
        numel = max(ep_size, size // element // ep_size * ep_size)
        send = torch.zeros(numel, dtype=dtype, device=device)
        recv = torch.empty_like(send)
        if ep_size > 1:
            figures.append(median_call_time(lambda: dist.all_to_all_single(recv, send, group=group), repeats))
        else:
            figures.append(0.0)
    partner = rank ^ 1
    for size in _SIZES_BYTES:
        buffer = torch.zeros(max(1, size // element), dtype=dtype, device=device)
        if ep_size > 1 and partner < ep_size:
            def exchange() -> None:
                works = [dist.isend(buffer, ep_ranks[partner], group=group),
                         dist.irecv(torch.empty_like(buffer), ep_ranks[partner], group=group)]
                for work in works:
                    work.wait()
            figures.append(median_call_time(exchange, repeats))
        else:
            figures.append(0.0)
    tokens = torch.ones(1024, hidden_size, dtype=dtype, device=device)
    with torch.no_grad():
        figures.append(median_call_time(lambda: expert(tokens), repeats))
    measured = torch.tensor(figures, dtype=torch.float64)
    if ep_size > 1:
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
    values = measured.tolist()
    count = len(_SIZES_BYTES)
    floor = 1e-9
    sizes = tuple(float(s) for s in _SIZES_BYTES)
    a2a = CommCurve(sizes, tuple(max(v, floor) for v in values[:count]))
    p2p = CommCurve(sizes, tuple(max(v, floor) for v in values[count: 2 * count]))
    param_bytes = sum(p.numel() for p in expert.parameters()) * element
    return CostModel(
        all_to_all=a2a,
        point_to_point=p2p,
        expert_tokens_per_s=1024 / max(values[-1], floor),
        bytes_per_token=hidden_size * element,
        expert_param_bytes=param_bytes,
        experts_per_rank=experts_per_rank,
        measured={"expert_forward_1024_tokens_s": values[-1]},
    )
