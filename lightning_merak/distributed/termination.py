"""SIGTERM and SIGINT end every rank promptly, even one blocked inside a collective.

Why: a Python signal handler runs only between bytecodes of the main thread. A rank waiting in a
gloo collective sits in C++ for as long as its peers do not come, so neither Lightning's SIGTERM
handler nor ``KeyboardInterrupt`` ever runs there, and SLURM preemption (SIGTERM, then SIGKILL)
ends the job without a word from the ranks.

How: CPython's C-level handler writes the number of every signal it catches to the file given
to :func:`signal.set_wakeup_fd`, at delivery, whatever the main thread is doing. A daemon thread
reads it (it runs while the main thread waits in C code that releases the GIL, as gloo's waits
do) and, on the first SIGTERM or SIGINT:

1. forwards the signal to the ranks this process launched (Lightning's launcher starts ranks
   1.. as children of rank 0): its children whose ``LOCAL_RANK`` differs from its own, read
   from ``/proc`` (Linux); DataLoader workers share their parent's ``LOCAL_RANK`` and are left
   to their own parent watch;
2. leaves the normal Python handling (Lightning's SIGTERM handler, which this one chains after,
   or ``KeyboardInterrupt``) ``grace_s`` seconds to end the process;
3. then ends it with exit status ``128 + signum``, printing one line that names the signal and
   the rank.

A launched rank (``LOCAL_RANK`` > 0) also watches its parent and, when the parent is gone, says
so (naming the lost launcher) and sends itself SIGTERM, so no rank outlives the process that
started it. Other lost peers are named by :mod:`lightning_merak.distributed.watchdog`. Nothing here
imports torch.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import warnings
from types import FrameType

__all__ = ["DEFAULT_GRACE_S", "install_termination_handler"]

DEFAULT_GRACE_S = 20.0
"""Long enough for the ranks to agree on a stop and finish up to two steps (``AgreedSigtermStop``), and for a
survivor's lost-peer verdict (15 s without a heartbeat); inside SLURM's default KillWait (30 s)."""

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PARENT_POLL_S = 1.0

_watcher: _Watcher | None = None


def install_termination_handler(grace_s: float = DEFAULT_GRACE_S, watch_parent: bool | None = None) -> None:
    """Make SIGTERM and SIGINT end this process and the ranks it launched within ``grace_s`` seconds.

    Call it first thing in every rank, from the main thread (signal handlers can only be set
    there); later calls keep the first call's settings. ``watch_parent`` (default: whether
    ``LOCAL_RANK`` > 0, i.e. a launcher started this rank) ends this process when its parent dies.
    A signal the process ignores (``SIG_IGN``) stays ignored. One without a Python handler (SIGTERM,
    normally) gets one that raises ``SystemExit(128 + signum)``, so ``finally`` blocks run; Lightning's
    handler, installed later by the Trainer, chains to it and keeps its own behaviour.
    """
    global _watcher
    if grace_s < 0:
        raise ValueError(f"grace_s={grace_s} is negative; pass the seconds to wait before ending the process (>= 0)")
    if _watcher is not None:
        return
    if threading.current_thread() is not threading.main_thread():
        warnings.warn(
            "install_termination_handler() was not called from the main thread, where Python allows signal "
            "handlers; SIGTERM/SIGINT keep their default handling. Call it from the main thread",
            stacklevel=2,
        )
        return
    if watch_parent is None:
        watch_parent = _local_rank() not in (None, "0")
    _watcher = _Watcher(grace_s, watch_parent)
    os.register_at_fork(after_in_child=_forget_in_forked_child)


class _Watcher:
    """The wakeup pipe, the handled signals and the daemon thread that acts on them."""

    def __init__(self, grace_s: float, watch_parent: bool) -> None:
        self.grace_s = grace_s
        self.parent = os.getppid() if watch_parent else None
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.handled: list[int] = []
        for signum in _SIGNALS:
            current = signal.getsignal(signum)
            if current == signal.SIG_IGN:
                continue
            if current in (signal.SIG_DFL, None):
                signal.signal(signum, _exit_on_signal)
            self.handled.append(int(signum))
        self.previous_wakeup_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._run, name="merak-termination", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        received: int | None = None
        deadline = float("inf")
        while time.monotonic() < deadline:
            timeout = min(_PARENT_POLL_S, max(0.0, deadline - time.monotonic()))
            if select.select([self.read_fd], [], [], timeout)[0]:
                numbers = os.read(self.read_fd, 512)
                self._pass_on_to_previous_wakeup_fd(numbers)
                for signum in set(numbers) & set(self.handled):
                    _forward(signum)
                    if received is None:
                        received, deadline = signum, time.monotonic() + self.grace_s
            if self.parent is not None and os.getppid() != self.parent:
                message = (
                    f"lightning_merak: rank {_rank()} stops: the process that launched it (pid {self.parent}, "
                    "local rank 0 of this host) is gone\n"
                )
                os.write(2, message.encode())
                self.parent = None  # once: from here on it is an ordinary SIGTERM
                os.kill(os.getpid(), signal.SIGTERM)
        assert received is not None, "the deadline is only set by a signal"
        message = (
            f"lightning_merak: {signal.Signals(received).name} ended rank {_rank()} (pid {os.getpid()}); "
            f"its normal shutdown had not finished within {self.grace_s:g} s\n"
        )
        os.write(2, message.encode())  # no buffered stream: the main thread may hold its lock
        os._exit(128 + received)

    def _pass_on_to_previous_wakeup_fd(self, numbers: bytes) -> None:
        """An event loop that set a wakeup fd before this one still hears of its signals."""
        if self.previous_wakeup_fd >= 0:
            try:
                os.write(self.previous_wakeup_fd, numbers)
            except OSError:
                pass


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    """The handler of a signal that had none: exit as the signal would, but through ``finally`` blocks.

    Does nothing when it is called by a handler that chained it (Lightning's), which decides how to stop.
    """
    if signal.getsignal(signum) is _exit_on_signal:
        raise SystemExit(128 + signum)


def _forward(signum: int) -> None:
    """Send ``signum`` to the ranks this process launched (children with another ``LOCAL_RANK``)."""
    own = _local_rank()
    for pid in _children():
        rank = _environment_of(pid).get("LOCAL_RANK")
        if rank is not None and rank != own:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def _children() -> list[int]:
    """Direct children of this process, from ``/proc`` (none where there is no ``/proc``)."""
    me = os.getpid()
    children = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()  # the command name may hold spaces and ")"
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and int(fields[1]) == me:
            children.append(int(entry))
    return children


def _environment_of(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with (a forked child shows its parent's start-up one)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            raw = environ.read()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def _local_rank() -> str | None:
    return os.environ.get("LOCAL_RANK")


def _rank() -> str:
    """The global rank when the process group is up, else what the launcher's environment says."""
    dist = sys.modules.get("torch.distributed")  # probed, not imported: nothing here imports torch
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if name in os.environ:
            return os.environ[name]
    return "0"


def _forget_in_forked_child() -> None:
    """A forked child (a DataLoader worker) must not write its signals into its parent's pipe."""
    global _watcher
    if _watcher is None:
        return
    signal.set_wakeup_fd(-1)  # allowed: the forking thread is the child's main thread
    os.close(_watcher.read_fd)
    os.close(_watcher.write_fd)
    _watcher = None
