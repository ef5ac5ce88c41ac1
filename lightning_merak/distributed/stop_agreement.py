"""Every rank agrees when to stop: a MAX vote of each rank's flag, on a gloo group of its own, read one call late.

Why a vote: a signal reaches the ranks at different moments (or only some of them), so a rank that stopped on its
own flag would stop at another step than its peers, and leave them waiting in the next collective.

Why a group of its own: a collective is matched with whatever the peer issues next on the same group. On a
dedicated group the vote never meets the strategy's gradient reductions, pipeline sends or background-thread
collectives; gloo serves it from a CPU tensor whatever the training backend (NCCL included).

Why one call late: each call starts its vote asynchronously and reads the one the previous call started, which
has long completed by then, so the vote costs the step no wait. The ranks stop one call after the first flag.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["StopAgreement"]


class StopAgreement:
    """Votes of every rank of the default process group on whether to stop; create it on every rank at once.

    ``timeout``: how long a vote may wait for a peer (the default: torch's for gloo groups).
    """

    def __init__(self, timeout: timedelta | None = None) -> None:
        # a gloo group over every rank (a collective of the default group); not process_groups.new_group, which
        # binds a group to the rank's GPU on NCCL
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self.agreed = False

    def vote(self, stop: bool) -> bool:
        """Whether the ranks agreed to stop: the vote the previous call started (False at the first call).

        Starts this call's vote with ``stop`` unless the ranks already agreed; once agreed, every later call
        answers True and starts none. Every rank must call it equally often.
        """
        if self._pending is not None:
            work, flag = self._pending
            self._pending = None
            work.wait()
            self.agreed = bool(flag.item())
        if not self.agreed:
            flag = torch.tensor([int(stop)], dtype=torch.int32)
            self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return self.agreed

    def close(self, peers_voted: bool) -> None:
        """End the votes. ``peers_voted`` (a fit every rank ended alike): wait for the vote in flight and destroy the
        group. Otherwise (a rank failed) leave both alone: a peer may never start the vote, and destroying the group
        would wait for it (as :mod:`~lightning_merak.distributed.process_exit` leaves the groups of a failed run)."""
        if peers_voted:
            if self._pending is not None:
                self._pending[0].wait()
            dist.destroy_process_group(self._group)
        self._pending = None
