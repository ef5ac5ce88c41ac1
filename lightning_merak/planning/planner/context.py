"""What context parallelism costs a rank: its share of each block's work and the attention exchange around it.

Under context parallelism of degree ``cp`` every rank holds ``1/cp`` of each sequence (load-balanced causal
chunks, :mod:`lightning_merak.parallel.context.sharding`), so everything outside attention does ``1/cp`` of the
work, and so does attention: each rank's queries see the keys of the whole sequence, but the balanced chunks
give every rank the same share of the causal triangle. What it adds is the exchange that lets a rank's
queries reach every key:

- **ring** (:mod:`~lightning_merak.parallel.context.ring`): ``cp - 1`` steps per block forward, each passing
  a key/value shard to the next rank while the attention kernel runs on the one held, so a step's transfer hides
  behind that step's kernel; backward passes the key/value shards and, one step behind, their gradients (twice
  the bytes per step), and the last hop of the gradients is exposed.
- **all_to_all** (Ulysses, :mod:`~lightning_merak.parallel.context.ulysses`): four all-to-alls per block forward
  (queries, keys and values to a head split, the output back) and four backward, none overlapped; ``cp`` must
  divide each tensor-parallel rank's key/value heads.

Where the profile measured one context rank's attention compute (``ModelProfile.context_kernel_times``, next to the
model's own kernel over the whole sequence), it replaces the kernel's 1/cp share of the block: blockwise calls and
merges cost more than their share on a CPU. Without it, the kernel's share of a block's attention part (its
projections are the rest) comes from the FLOPs of both. Either is the window a ring step's transfer hides in.
"""

from __future__ import annotations

import dataclasses

from lightning_merak.planning.planner.attention import ContextAttention
from lightning_merak.planning.planner.profile import BlockTimes, ModelProfile, NetworkProfile


def exchange_s(shape: ContextAttention, method: str, cp: int, tp: int, samples: int, kernel: tuple[float, float],
               network: NetworkProfile) -> tuple[float, float]:
    """``(forward_s, backward_s)`` of one block's exposed attention exchange of ``shape`` for ``samples`` samples.

    ``kernel`` is one context rank's attention kernel time ``(forward_s, backward_s)`` in the block; a ring
    step's transfer hides behind ``1/cp`` of it.
    """
    if cp == 1:
        return 0.0, 0.0
    if method not in shape.methods(cp, tp):
        raise ValueError(f"context_attention={method!r} cannot run at context_parallel={cp}, tensor_parallel={tp} "
                         f"(sequence {shape.sequence_length}, {shape.key_value_heads} key/value heads); choose one "
                         f"of {shape.methods(cp, tp) or 'no method: change the degree'}")
    local = samples / (tp * cp)  # this rank's share of the heads and of the sequence, in samples
    if method == "ring":
        shard_bytes = shape.key_value_bytes_per_sample * local
        forward_step_s, backward_step_s = kernel[0] / cp, kernel[1] / cp
        forward_s = (cp - 1) * max(0.0, network.p2p.send_s(shard_bytes) - forward_step_s)
        backward_s = ((cp - 1) * max(0.0, network.p2p.send_s(2 * shard_bytes) - backward_step_s)
                      + network.p2p.send_s(shard_bytes))
        return forward_s, backward_s
    link = network.all_to_all_link(cp)
    leaving = (cp - 1) / cp  # of each tensor, what goes to the other ranks
    query_s = link.send_s(shape.query_bytes_per_sample * local * leaving)
    key_value_s = link.send_s(shape.key_value_bytes_per_sample / 2 * local * leaving)
    direction_s = 2 * query_s + 2 * key_value_s  # queries and output, keys and values
    return direction_s, direction_s


def context_rank_block(profile: ModelProfile, times: BlockTimes, cp: int, method: str, tp: int,
                       samples: int) -> tuple[BlockTimes, tuple[float, float], tuple[float, float]]:
    """A block's segments on one of ``cp`` context ranks, that rank's attention kernel time ``(forward_s,
    backward_s)``, and what that kernel adds per block beyond ``1/cp`` of the whole-sequence one.

    Every segment does 1/cp of the whole sequence's work. Where the profile measured the context rank's attention
    compute and the model's own kernel (:attr:`ModelProfile.context_kernel_times`), the attention part's kernel
    share is that measurement instead (the extra goes to the first forward segment and the last backward one,
    the attention part: :class:`BlockTimes` cuts a block attention first); otherwise the kernel is the FLOP share
    of the attention part (:attr:`ContextAttention.kernel_fraction`).
    """
    if cp == 1:
        return times, (0.0, 0.0), (0.0, 0.0)
    share = BlockTimes(tuple(seconds / cp for seconds in times.forward_segments_s),
                       tuple(seconds / cp for seconds in times.backward_segments_s))
    attention = (share.forward_segments_s[0], share.backward_segments_s[-1])
    whole = profile.attention_kernel_times.get((tp, samples))
    split = profile.context_kernel_times.get((cp, method, tp, samples))
    if whole is None or split is None:
        assert profile.context is not None
        fraction = profile.context.kernel_fraction
        return share, (fraction * attention[0], fraction * attention[1]), (0.0, 0.0)
    # the kernel's own 1/cp share, at most the attention part it is measured inside
    extra = tuple(measured - min(kernel / cp, part) for measured, kernel, part in zip(split, whole, attention))
    forward, backward = list(share.forward_segments_s), list(share.backward_segments_s)
    forward[0] = max(0.0, forward[0] + extra[0])
    backward[-1] = max(0.0, backward[-1] + extra[1])
    rank_block = dataclasses.replace(share, forward_segments_s=tuple(forward), backward_segments_s=tuple(backward))
    return rank_block, (split[0], split[1]), (extra[0], extra[1])
