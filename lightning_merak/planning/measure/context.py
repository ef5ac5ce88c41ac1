"""One context-parallel rank's attention compute, timed in this process: what 1/cp of the model's SDPA misses.

A rank of a context-parallel group does not run 1/cp of one SDPA call. The ring attends its load-balanced query
chunks to each rank's key/value chunks in turn (``cp`` blockwise calls, split at the causal diagonal) and merges
the partial results by their log-sum-exp; its backward repeats that per shard. All-to-all runs one attention over
the whole sequence for ``heads / cp`` heads. On a CPU these smaller kernels and the merges cost more than their
share of the whole (the measured cp=2 step at 4096 tokens is 1.3x half of cp=1's). The ranks' exchange is not
part of these times: the cost model adds it (:mod:`lightning_merak.planning.planner.context`).

Timed here with the shapes one rank holds (random inputs, no process group), next to the model's own attention
over the whole sequence (``scaled_dot_product_attention``, causal) at the same heads, so the cost model can
replace the attention kernel's 1/cp share in a block's profiled time with what a context rank runs.

A sequence longer than :data:`LONGEST_TIMED_SEQUENCE` is timed at two shorter lengths and each time extrapolated
by :func:`extrapolate_attention_s`: at 16k tokens on CPU one causal kernel's forward and backward take seconds,
and the planner times several kernels many times on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_merak.parallel.context.blockwise import attend_block, attend_block_backward, merge_attention
from lightning_merak.parallel.context.sharding import LoadBalancedLayout
from lightning_merak.planning.planner import ContextAttention
from lightning_merak.util.timing import median_call_time

__all__ = ["LONGEST_TIMED_SEQUENCE", "extrapolate_attention_s", "time_attention_kernels"]

LONGEST_TIMED_SEQUENCE = 4096
"""The longest sequence whose attention kernels are timed at their length; longer ones are extrapolated from this
length and half of it. On 2 shared CPU cores, estimates for 4096 tokens from 1024 and 2048 came within 0.8–1.3× of
timing 4096 itself (whole kernel, ring at cp 2 and 4, all-to-all at cp 2), while two timings of 4096 differed by
up to 2.5× under load (``tests/test_long_sequence_planning.py``)."""

KernelTimes = dict[tuple[int, int], tuple[float, float]]
ContextKernelTimes = dict[tuple[int, str, int, int], tuple[float, float]]

_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _inputs(shape: ContextAttention, samples: int, heads: int, key_heads: int, device: torch.device,
            ) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    dtype = _DTYPES.get(shape.element_bytes, torch.float32)

    def random(width: int) -> Tensor:
        values = torch.randn(samples, width, shape.sequence_length, shape.head_dim, generator=generator)
        return values.to(device=device, dtype=dtype)

    return random(heads), random(key_heads), random(key_heads)


def _forward_and_backward_s(forward: Callable[[], Tensor], leaves: tuple[Tensor, ...], repeats: int,
                            device: torch.device) -> tuple[float, float]:
    """Median forward time and median backward time of a differentiable ``forward``, each timed on its own (the
    backward through one kept graph): a difference of two noisy timings could come out at zero or below."""
    leaves = tuple(leaf.detach().requires_grad_(True) for leaf in leaves)
    forward_s = median_call_time(lambda: forward(*leaves), repeats, device)
    out = forward(*leaves)
    grad = torch.ones_like(out)
    return forward_s, median_call_time(lambda: out.backward(grad, retain_graph=True), repeats, device)


def _whole_sequence_s(query: Tensor, key: Tensor, value: Tensor, repeats: int,
                      device: torch.device) -> tuple[float, float]:
    """The model's own attention over the whole sequence (causal SDPA, key/value heads shared as GQA)."""
    grouped = query.shape[1] != key.shape[1]
    return _forward_and_backward_s(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped),
        (query, key, value), repeats, device)


def _ring_rank_s(query: Tensor, key: Tensor, value: Tensor, cp: int, repeats: int,
                 device: torch.device) -> tuple[float, float]:
    """Rank 0 of a ring of ``cp``: its query chunks against each rank's key/value chunks, merged (forward, as
    ``ring_attention`` runs it without autograd), then each shard's gradient from the merged result."""
    positions = LoadBalancedLayout(query.shape[2], cp).rank_positions()
    local_query = query[:, :, positions[0]].contiguous()
    shards = [(key[:, :, positions[rank]].contiguous(), value[:, :, positions[rank]].contiguous())
              for rank in range(cp)]

    def forward() -> tuple[Tensor, Tensor]:
        out = lse = None
        with torch.no_grad():
            for rank, (shard_key, shard_value) in enumerate(shards):
                block_out, block_lse = attend_block(local_query, shard_key, shard_value,
                                                    query_positions=positions[0], key_positions=positions[rank])
                if out is None:  # accumulated as the ring does: float32 at least
                    out, lse = block_out.to(torch.promote_types(block_out.dtype, torch.float32)), block_lse
                else:
                    out, lse = merge_attention(out, lse, block_out, block_lse)
        assert out is not None and lse is not None
        return out.to(query.dtype), lse

    out, lse = forward()
    grad_out = torch.ones_like(out)

    def backward() -> None:
        with torch.no_grad():
            for rank, (shard_key, shard_value) in enumerate(shards):
                attend_block_backward(grad_out, local_query, shard_key, shard_value, out, lse,
                                      query_positions=positions[0], key_positions=positions[rank])

    return median_call_time(forward, repeats, device), median_call_time(backward, repeats, device)


def _all_to_all_rank_s(query: Tensor, key: Tensor, value: Tensor, repeats: int,
                       device: torch.device) -> tuple[float, float]:
    """One attention over the whole sequence for this rank's ``heads / cp`` heads (``query`` etc. already cut)."""
    positions = torch.arange(query.shape[2])
    return _forward_and_backward_s(
        lambda q, k, v: attend_block(q, k, v, query_positions=positions, key_positions=positions)[0],
        (query, key, value), repeats, device)


def extrapolate_attention_s(points: Sequence[tuple[int, float]], length: int) -> float:
    """Seconds at ``length`` tokens of an attention kernel timed at two shorter lengths ``(tokens, seconds)``.

    The kernel's work has a part linear in the length (loading queries, merging partial results, the softmax
    statistics) and a quadratic part (scores against every earlier key), so the time is fitted as
    ``a·L + b·L²`` through the two points. Noise that makes either coefficient negative leaves the other alone,
    fitted to the longer point, so the estimate never falls with the length.
    """
    (short, short_s), (long, long_s) = sorted(points)
    if not 0 < short < long:
        raise ValueError(f"extrapolate_attention_s needs two distinct positive lengths, got {points}")
    quadratic = (long_s / long - short_s / short) / (long - short)
    linear = short_s / short - quadratic * short
    if quadratic < 0:
        linear, quadratic = long_s / long, 0.0
    elif linear < 0:
        linear, quadratic = 0.0, long_s / long**2
    return linear * length + quadratic * length**2


def time_attention_kernels(shape: ContextAttention, keys: Iterable[tuple[int, str, int, int]],
                           device: torch.device, repeats: int,
                           longest_timed: int = LONGEST_TIMED_SEQUENCE) -> tuple[KernelTimes, ContextKernelTimes]:
    """``(whole, split)``: the model's attention kernel over the whole sequence by ``(tp, samples)``, and one
    context rank's attention compute by ``(cp, method, tp, samples)``, for every key of ``keys``; each
    ``(forward_s, backward_s)`` for one attention layer of ``samples`` samples on a tensor-parallel rank.

    A sequence longer than ``longest_timed`` is timed at the longest length up to it that every degree of
    ``keys`` splits into balanced chunks, and at half of that, and extrapolated (:func:`extrapolate_attention_s`).
    """
    kept = [(cp, method, tp, samples) for cp, method, tp, samples in sorted(set(keys))
            if method in shape.methods(cp, tp)]  # the planner leaves the others out
    unit = 2 * math.lcm(*(cp for cp, *_ in kept)) if kept else 2
    long = longest_timed // unit * unit
    short = long // 2 // unit * unit
    if shape.sequence_length <= longest_timed or short < unit:
        return _timed_kernels(shape, kept, device, repeats)
    timed = [_timed_kernels(dataclasses.replace(shape, sequence_length=length), kept, device, repeats)
             for length in (short, long)]

    def extrapolated(at_short: tuple[float, float], at_long: tuple[float, float]) -> tuple[float, float]:
        forward, backward = (extrapolate_attention_s(((short, a), (long, b)), shape.sequence_length)
                             for a, b in zip(at_short, at_long))
        return forward, backward

    return ({key: extrapolated(timed[0][0][key], value) for key, value in timed[1][0].items()},
            {key: extrapolated(timed[0][1][key], value) for key, value in timed[1][1].items()})


def _timed_kernels(shape: ContextAttention, keys: Sequence[tuple[int, str, int, int]], device: torch.device,
                   repeats: int) -> tuple[KernelTimes, ContextKernelTimes]:
    """:func:`time_attention_kernels` at ``shape``'s own length, for ``keys`` whose method the shape allows."""
    whole: KernelTimes = {}
    split: ContextKernelTimes = {}
    for cp, method, tp, samples in keys:
        heads, key_heads = shape.heads // tp, shape.key_value_heads // tp
        query, key, value = _inputs(shape, samples, heads, key_heads, device)
        if (tp, samples) not in whole:
            whole[(tp, samples)] = _whole_sequence_s(query, key, value, repeats, device)
        if method == "ring":
            split[(cp, method, tp, samples)] = _ring_rank_s(query, key, value, cp, repeats, device)
        else:
            split[(cp, method, tp, samples)] = _all_to_all_rank_s(
                query[:, :heads // cp], key[:, :key_heads // cp], value[:, :key_heads // cp], repeats, device)
    return whole, split
