"""The attention shape context parallelism exchanges, and which methods a degree allows (plain numbers: the
profile records it, :mod:`.context` prices it)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_merak.parallel.context.model import CONTEXT_ATTENTION_METHODS


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
        for name in ("sequence_length", "hidden_size", "heads", "key_value_heads", "head_dim", "element_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ContextAttention: {name} must be > 0, got {getattr(self, name)}")
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
        rank's key/value heads (:meth:`method_problem` says why one does not)."""
        if cp == 1:
            return ("ring",)
        return tuple(method for method in CONTEXT_ATTENTION_METHODS if self.method_problem(cp, tp, method) is None)

    def method_problem(self, cp: int, tp: int, method: str) -> str | None:
        """Why ``method`` does not run at context degree ``cp > 1`` with ``tp`` tensor-parallel ranks, or None."""
        if self.sequence_length % (2 * cp):
            return (f"context_parallel={cp} needs a sequence length divisible by 2 x {cp} = {2 * cp} "
                    f"(got {self.sequence_length})")
        if self.key_value_heads % tp:
            return (f"context_parallel={cp} with tensor_parallel={tp} needs tensor_parallel to divide "
                    f"num_key_value_heads={self.key_value_heads}")
        if method == "all_to_all" and (self.key_value_heads // tp) % cp:
            return (f"all_to_all needs context_parallel={cp} to divide each tensor rank's key/value heads "
                    f"(num_key_value_heads={self.key_value_heads}, tensor_parallel={tp})")
        return None
