"""Measure the cost model's constants on this machine, collectively over one EP group.

Every rank runs the same timings; the slowest rank's figure wins (an all-reduce MAX),
so all ranks hold bitwise identical constants and plan identically.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.distributed.process_groups import collective_device
from lightning_merak.plugins.moe.core.placement_cost_model import CommCurve, CostModel
from lightning_merak.util.timing import median_call_time

__all__ = ["profile_cost_model"]

_SIZES_BYTES = (1 << 10, 1 << 13, 1 << 16, 1 << 19, 1 << 22)
_OVERLAP_SIZE_INDEX = 3  # 512 KiB: an expert's parameters in the benchmarks


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
    """All-to-all and point-to-point curves at log-spaced sizes from 1 KiB, expert throughput (every rank at once
    and rank 0 alone), overlap efficiency.

    The efficiency says how much of a transfer runs hidden beside expert compute; the cost model
    and Lancet's chunk choice hide transfers only to that extent.
    """
    ep_size = len(ep_ranks)
    rank = dist.get_rank(group) if ep_size > 1 else 0
    element = torch.tensor([], dtype=dtype).element_size()
    figures = []
    for size in _SIZES_BYTES:
        numel = max(ep_size, size // element // ep_size * ep_size)
        send = torch.zeros(numel, dtype=dtype, device=device)
        recv = torch.empty_like(send)
        if ep_size > 1:
            figures.append(median_call_time(lambda: dist.all_to_all_single(recv, send, group=group), repeats,
                                            device))
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
            figures.append(median_call_time(exchange, repeats, device))
        else:
            figures.append(0.0)
    tokens = torch.ones(1024, hidden_size, dtype=dtype, device=device)
    with torch.no_grad():
        figures.append(_expert_alone(expert, tokens, rank, group, ep_size, repeats))
        figures.append(median_call_time(lambda: expert(tokens), repeats, device))
        figures.append(_transfer_beside_compute(expert, tokens, ep_ranks, rank, group, dtype, device, repeats))
        figures.append(_all_to_all_beside_compute(expert, tokens, ep_size, group, dtype, device, repeats))
    measured = torch.tensor(figures, dtype=torch.float64, device=collective_device(group) if ep_size > 1 else "cpu")
    if ep_size > 1:
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
    values = measured.tolist()
    all_to_all_overlap_s = values.pop()
    overlap_s = values.pop()
    count = len(_SIZES_BYTES)
    floor = 1e-9
    sizes = tuple(float(s) for s in _SIZES_BYTES)
    a2a = CommCurve(sizes, tuple(max(v, floor) for v in values[:count]))
    p2p = CommCurve(sizes, tuple(max(v, floor) for v in values[count: 2 * count]))
    param_bytes = sum(p.numel() for p in expert.parameters()) * element
    alone_s = values[-2]
    shared_rate = 1024 / max(values[-1], floor)
    alone_rate = 1024 / max(alone_s, floor)
    return CostModel(
        all_to_all=a2a,
        point_to_point=p2p,
        expert_tokens_per_s=shared_rate,
        expert_tokens_per_s_alone=alone_rate if alone_s > 0 and alone_rate > shared_rate else None,
        bytes_per_token=hidden_size * element,
        expert_param_bytes=param_bytes,
        experts_per_rank=experts_per_rank,
        overlap_efficiency=_efficiency(values[count + _OVERLAP_SIZE_INDEX], values[-1], overlap_s),
        all_to_all_overlap_efficiency=_efficiency(values[_OVERLAP_SIZE_INDEX], values[-1], all_to_all_overlap_s),
        measured={"expert_forward_1024_tokens_s": values[-1], "expert_forward_alone_1024_tokens_s": alone_s,
                  "transfer_beside_compute_s": overlap_s,
                  "all_to_all_beside_compute_s": all_to_all_overlap_s},
    )


def _expert_alone(expert: nn.Module, tokens: torch.Tensor, rank: int, group: Any, ep_size: int, repeats: int) -> float:
    """Seconds of an expert forward on EP rank 0 while the others wait (the MAX over ranks keeps rank 0's figure).

    Beside the same forward on every rank at once, this tells whether ranks share cores: then the
    busiest rank of an unbalanced step runs faster than the shared rate (:class:`CostModel`).
    """
    if ep_size < 2:
        return 0.0
    dist.barrier(group=group)
    alone = median_call_time(lambda: expert(tokens), repeats, tokens.device) if rank == 0 else 0.0
    dist.barrier(group=group)
    return alone


def _transfer_beside_compute(expert: nn.Module, tokens: torch.Tensor, ep_ranks: Sequence[int], rank: int, group: Any,
                             dtype: torch.dtype, device: torch.device | str, repeats: int) -> float:
    """Seconds for a point-to-point exchange with an expert forward run while it is in flight."""
    partner = rank ^ 1
    if len(ep_ranks) < 2 or partner >= len(ep_ranks):
        return 0.0
    element = torch.tensor([], dtype=dtype).element_size()
    buffer = torch.zeros(_SIZES_BYTES[_OVERLAP_SIZE_INDEX] // element, dtype=dtype, device=device)

    def both() -> None:
        works = [dist.isend(buffer, ep_ranks[partner], group=group),
                 dist.irecv(torch.empty_like(buffer), ep_ranks[partner], group=group)]
        expert(tokens)
        for work in works:
            work.wait()

    return median_call_time(both, repeats, device)


def _all_to_all_beside_compute(expert: nn.Module, tokens: torch.Tensor, ep_size: int, group: Any,
                               dtype: torch.dtype, device: torch.device | str, repeats: int) -> float:
    """Seconds for an all-to-all with an expert forward run while it is in flight (what Lancet chunks rely on)."""
    if ep_size < 2:
        return 0.0
    element = torch.tensor([], dtype=dtype).element_size()
    numel = max(ep_size, _SIZES_BYTES[_OVERLAP_SIZE_INDEX] // element // ep_size * ep_size)
    send = torch.zeros(numel, dtype=dtype, device=device)
    recv = torch.empty_like(send)

    def both() -> None:
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        expert(tokens)
        work.wait()

    return median_call_time(both, repeats, device)


def _efficiency(transfer_s: float, compute_s: float, both_s: float) -> float:
    """Share of the shorter of transfer and compute hidden when they run together (1 on one rank)."""
    if both_s <= 0.0 or min(transfer_s, compute_s) <= 0.0:
        return 1.0
    return min(1.0, max(0.0, (transfer_s + compute_s - both_s) / min(transfer_s, compute_s)))
