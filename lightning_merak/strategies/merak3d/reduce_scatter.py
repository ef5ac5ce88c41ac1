"""ZeRO's reduce-scatter of a gradient bucket on CPU ranks, with half of gloo's bytes.

Gloo reduce-scatters by all-reducing the whole tensor and slicing it, so each rank sends and receives about
twice a bucket: measured on the emulated 1 Gbit/s link, 8 MB took 72 ms against an all-to-all's 43 at dp2 and
118 against 59 at dp4 (``docs/findings.md``, #29). Both classes here send each rank only the part it owns, in
one all-to-all (which stays in the group's queue of collectives, in launch order, as gloo's reduce-scatter did),
and sum it on arrival; :func:`start_reduce_scatter` picks the one for a group and device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["ExchangeReduceScatter", "PairwiseReduceScatter", "start_reduce_scatter", "sum_in_rank_order"]


def sum_in_rank_order(parts: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``out = ((parts[0] + parts[1]) + parts[2]) + …``: one fixed order, so every run and every rank that sums
    the same parts gets the same bits (a reduction kernel over a stacked tensor may pair them differently)."""
    out.copy_(parts[0])
    for part in parts[1:]:
        out += part
    return out


class PairwiseReduceScatter:
    """A reduce-scatter over two CPU ranks as an all-to-all that sends only the peer's half, then one addition.

    Gloo's costs as long as an all-reduce (72 against 68 ms for 8 MB at dp2) and 1.6 times an exchange of halves
    (45 ms). The sum is exact: two addends in either order give gloo's bits. The peer's half lands in ``out``
    and this rank's half is added, so no memory is needed beyond ``out``."""

    def __init__(self, out: torch.Tensor, flat: torch.Tensor, rank: int, group: dist.ProcessGroup) -> None:
        halves, peer = flat.view(2, -1), 1 - rank
        self._out, self._own, self._summed = out, halves[rank], False
        splits = [0, 0]
        splits[peer] = out.numel()
        self._work = dist.all_to_all_single(out, halves[peer], splits, splits, group=group, async_op=True)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> None:
        """Wait for the exchange and add this rank's half to the peer's."""
        self._work.wait()
        if not self._summed:
            self._out += self._own
            self._summed = True


class ExchangeReduceScatter:
    """A reduce-scatter over three or more CPU ranks as one all-to-all, summed in rank order.

    Rank ``r`` sends each peer ``p`` its copy of part ``p`` of ``flat`` and receives every rank's copy of part
    ``r`` into a buffer the size of ``flat`` (its own copy included: an all-to-all's pieces are consecutive, so
    leaving out a part in the middle would shift the others), which :meth:`wait` sums into ``out`` in rank order
    0, 1, …, n−1 and frees. The sum is deterministic; gloo's ring adds in another order (over its own
    segments), so the two differ in the last bits. The buffer lives from the launch until :meth:`wait`."""

    def __init__(self, out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup) -> None:
        ranks = dist.get_world_size(group)
        if flat.numel() != ranks * out.numel():
            raise ValueError(f"a bucket of {flat.numel()} elements does not split into {ranks} parts of "
                             f"{out.numel()}: pad it to a multiple of the shard group's size")
        self._out, self._ranks = out, ranks
        self._received: Optional[torch.Tensor] = torch.empty_like(flat)
        self._work = dist.all_to_all_single(self._received, flat, group=group, async_op=True)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> None:
        """Wait for the exchange, sum the received copies in rank order into ``out`` and free them."""
        self._work.wait()
        if self._received is not None:
            sum_in_rank_order(self._received.view(self._ranks, -1).unbind(), self._out)
            self._received = None


def start_reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """Start summing, over ``group``, the part of ``flat`` this rank owns (its rank in ``group``) into ``out``;
    returns the work to wait for. CPU tensors exchange only owned parts (above); elsewhere the backend's own
    reduce-scatter runs (NCCL's is native)."""
    ranks = dist.get_world_size(group)
    if flat.device.type != "cpu" or ranks == 1:
        return dist.reduce_scatter_single(out, flat, group=group, async_op=True)
    if ranks == 2:
        return PairwiseReduceScatter(out, flat, dist.get_rank(group), group)
    return ExchangeReduceScatter(out, flat, group)
