"""Gradient reductions without their collectives, to measure what a step costs when no communication is exposed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = ["Done", "communication_skipped", "gradient_communication_skipped", "keep_own_part"]

_communication_skipped = False


def communication_skipped() -> bool:
    """Whether reductions built now skip their collectives (:func:`gradient_communication_skipped`)."""
    return _communication_skipped


@contextlib.contextmanager
def gradient_communication_skipped() -> Iterator[None]:
    """Inside: reductions built here run no gradient collective; each rank keeps its own sums (its own part of each
    bucket when sharded), with the same buffers, copies and divisions. A step's time without its gradient
    communication is what overlap could at best reach, so measuring it needs the very same step minus the
    collectives (``benchmarks.sharding``'s exposed fraction). The replicas drift apart: for measurement only."""
    global _communication_skipped
    before, _communication_skipped = _communication_skipped, True
    try:
        yield
    finally:
        _communication_skipped = before


class Done:
    """A collective that was never started: already complete."""

    holds_buffer = False

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        return None


def keep_own_part(out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup) -> Done:
    """A reduce-scatter without the communication: this rank's part of its own sums."""
    start = dist.get_rank(group) * out.numel()
    out.copy_(flat[start:start + out.numel()])
    return Done()
