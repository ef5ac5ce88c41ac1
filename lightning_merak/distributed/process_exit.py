"""Process groups destroyed while the interpreter is whole, once a run has ended well.

Left to the interpreter's exit, gloo's worker threads may free a tensor after Python has shut down and abort the
rank (``terminate called without an active exception``, status -6: seen in the suite under load), and NCCL warns
that its group was never destroyed. ``merak-train`` destroys its groups when its run is done; a Python user's
``Trainer.fit`` under merak3d gets the same at exit, registered by the strategy's teardown after a run that ended
well. After a failure nothing is destroyed: a peer may still be inside a collective, and destroying would wait on it.

Destroying a group shuts it down, but its gloo worker threads end only with the group object, which the run's own
objects (layouts, meshes, strategies) keep alive to the process's end, past the interpreter's teardown; C++'s exit
then tears gloo down under threads still running, which aborts the rank as above now and then (1 run in about 45 of
a loaded 2-core machine). So a command whose work ended well leaves by :func:`exit_after_python_teardown`: what a
normal exit runs in Python, then the process's end without C++'s.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

__all__ = ["exit_after_python_teardown", "leave_process_groups", "leave_process_groups_at_exit"]


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


def exit_after_python_teardown(code: int = 0) -> None:
    """End the process with ``code`` after what a normal interpreter exit runs in Python (non-daemon threads joined,
    ``atexit`` handlers: loggers, ``logging``'s flush; standard streams flushed), skipping C++'s static destructors,
    which could run under native worker threads still alive (module docstring)."""
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)  # CPython's own exit path; private, so looked up
    if run_exit_handlers is None:
        sys.exit(code)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a reader gone: nothing left to deliver
            pass
    os._exit(code)
