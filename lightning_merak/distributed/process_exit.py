"""Process groups destroyed while the interpreter is whole, once a run has ended well.

Left to the interpreter's exit, gloo's worker threads may free a tensor after Python has shut down and abort the
rank (``terminate called without an active exception``, status -6: seen in the suite under load), and NCCL warns
that its group was never destroyed. ``merak-train`` destroys its groups when its run is done; a Python user's
``Trainer.fit`` under merak3d gets the same at exit, registered by the strategy's teardown after a run that ended
well. After a failure nothing is destroyed: a peer may still be inside a collective, and destroying would wait on it.
"""

from __future__ import annotations

import atexit

__all__ = ["leave_process_groups", "leave_process_groups_at_exit"]


def leave_process_groups() -> None:
    """Destroy this process's default process group (and with it every group), if there is one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave_process_groups_at_exit(ended_well: bool) -> None:
    """Destroy the process groups at the interpreter's exit when the last run ``ended_well``; otherwise do not (a
    later failed run takes back what an earlier run registered). Registering twice registers once."""
    atexit.unregister(leave_process_groups)
    if ended_well:
        atexit.register(leave_process_groups)
