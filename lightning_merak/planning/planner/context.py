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

The attention kernel's share of a block's attention part (its projections are the rest) comes from the FLOPs
of both; that is the window a ring step's transfer can hide in.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_merak.planning.planner.profile import (
    CONTEXT_ATTENTION_METHODS,
    BlockTimes,
    NetworkProfile,
    _check_positive,
)


@dataclass(frozen=True)
class ContextAttention:
    """The attention shape context parallelism exchanges, per attention layer: the whole sequence at tp = 1.

    ``element_bytes`` is the size of one activation element (4 in fp32, 2 under 16-bit autocast).
    """

    sequence_length: int
    hidden_size: int
    heads: int
    key_value_heads: int
    head_dim: int
    element_bytes: int

    def __post_init__(self) -> None:
        _check_positive("ContextAttention", sequence_length=self.sequence_length, hidden_size=self.hidden_size,
                        heads=self.heads, key_value_heads=self.key_value_heads, head_dim=self.head_dim,
                        element_bytes=self.element_bytes)
        if self.heads % self.key_value_heads:
            raise ValueError(f"ContextAttention: key_value_heads={self.key_value_heads} must divide "
                             f"heads={self.heads}")

    @property
    def query_bytes_per_sample(self) -> int:
        """One sample's queries (also the size of the attention output) over the whole sequence."""
        return self.sequence_length * self.heads * self.head_dim * self.element_bytes

    @property
    def key_value_bytes_per_sample(self) -> int:
        """One sample's keys and values together over the whole sequence."""
        return 2 * self.sequence_length * self.key_value_heads * self.head_dim * self.element_bytes

    @property
    def kernel_fraction(self) -> float:
        """The attention kernel's share of the attention part's FLOPs (causal: each query sees half the keys on
        average); the projections of queries, keys, values and output are the rest."""
        query_width, key_value_width = self.heads * self.head_dim, self.key_value_heads * self.head_dim
        projections = 2 * self.hidden_size * (2 * query_width + 2 * key_value_width)
        kernel = 2 * self.sequence_length * query_width
        return kernel / (kernel + projections)

    def methods(self, cp: int, tp: int) -> tuple[str, ...]:
        """The methods that run at context degree ``cp`` with ``tp`` tensor-parallel ranks: none when the
        sequence does not split into ``2 cp`` balanced chunks, all-to-all only where ``cp`` divides each tensor
        rank's key/value heads."""
        if cp == 1:
            return ("ring",)
        if self.sequence_length % (2 * cp) or self.key_value_heads % tp:
            return ()
        return tuple(method for method in CONTEXT_ATTENTION_METHODS
                     if method == "ring" or (self.key_value_heads // tp) % cp == 0)

    def exchange_s(self, method: str, cp: int, tp: int, samples: int, attention: tuple[float, float],
                   network: NetworkProfile) -> tuple[float, float]:
        """``(forward_s, backward_s)`` of one block's exposed attention exchange for ``samples`` samples.

        ``attention`` is the block's attention part ``(forward_s, backward_s)`` on one context rank (already
        ``1/cp`` of the whole sequence's); a ring step's transfer hides behind the kernel's ``1/cp`` of it.
        """
        if cp == 1:
            return 0.0, 0.0
        if method not in self.methods(cp, tp):
            raise ValueError(f"context_attention={method!r} cannot run at context_parallel={cp}, tensor_parallel={tp} "
                             f"(sequence {self.sequence_length}, {self.key_value_heads} key/value heads); choose one "
                             f"of {self.methods(cp, tp) or 'no method: change the degree'}")
        local = samples / (tp * cp)  # this rank's share of the heads and of the sequence, in samples
        if method == "ring":
            shard_bytes = self.key_value_bytes_per_sample * local
            forward_step_s = self.kernel_fraction * attention[0] / cp
            backward_step_s = self.kernel_fraction * attention[1] / cp
            forward_s = (cp - 1) * max(0.0, network.p2p.send_s(shard_bytes) - forward_step_s)
            backward_s = ((cp - 1) * max(0.0, network.p2p.send_s(2 * shard_bytes) - backward_step_s)
                          + network.p2p.send_s(shard_bytes))
            return forward_s, backward_s
        link = network.all_to_all_link(cp)
        leaving = (cp - 1) / cp  # of each tensor, what goes to the other ranks
        query_s = link.send_s(self.query_bytes_per_sample * local * leaving)
        key_value_s = link.send_s(self.key_value_bytes_per_sample / 2 * local * leaving)
        direction_s = 2 * query_s + 2 * key_value_s  # queries and output, keys and values
        return direction_s, direction_s


def per_context_rank(times: BlockTimes, cp: int) -> BlockTimes:
    """A block's segments on one of ``cp`` context ranks: ``1/cp`` of the whole sequence's work each."""
    if cp == 1:
        return times
    return BlockTimes(tuple(seconds / cp for seconds in times.forward_segments_s),
                      tuple(seconds / cp for seconds in times.backward_segments_s))


def attention_part(times: BlockTimes) -> tuple[float, float]:
    """``(forward_s, backward_s)`` of a block's attention part: its first forward segment and its last backward
    one (:class:`BlockTimes` cuts a block at the tensor-parallel collectives, attention before MLP)."""
    return times.forward_segments_s[0], times.backward_segments_s[-1]
