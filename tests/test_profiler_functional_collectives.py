"""The profiler records torch's functional collectives (DTensor's redistributions), with the wait on their result."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as functional

from lightning_merak.callbacks.profiler.recorder import TraceRecorder


def test_functional_collectives_and_their_waits_are_recorded(single_rank_group: dist.ProcessGroup) -> None:
    original = functional.all_reduce
    recorder = TraceRecorder(0, block_spans=False)
    recorder.install()
    try:
        reduced = functional.all_reduce(torch.ones(8), "sum", single_rank_group)
        assert torch.equal(reduced + 0, torch.ones(8))  # first use: the wait
        gathered = functional.all_gather_single_autograd(torch.ones(4, 2), 0, single_rank_group)  # calls the base
        gathered.wait()
    finally:
        trace = recorder.finish()
    assert functional.all_reduce is original
    assert [(c.op, c.kind, c.group, c.seq, c.nbytes) for c in trace.comms] == [
        ("all_reduce", "collective", (0,), 0, 32), ("all_gather_single", "collective", (0,), 1, 32)]
    for record in trace.comms:
        assert record.launch <= record.wait_start <= record.wait_end
        assert not record.blocking
