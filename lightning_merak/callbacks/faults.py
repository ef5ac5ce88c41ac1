"""``FaultWatch``: a hang or a lost rank ends a Lightning run on every rank with a message that names it.

The watch itself is :class:`~lightning_merak.distributed.watchdog.Watchdog` (started for ``fit``, stopped at its
end); this callback only gives it the run's newest complete checkpoint and turns the error a survivor's main
thread gets from gloo when a peer dies ("Connection closed by peer") into :class:`RankLostError`, which names
the lost rank, its host and the checkpoint to resume from. While it waits for the watchdog's verdict, a SIGTERM
(torchrun ends a failed attempt's survivors so) is held back: Lightning's handler of it broadcasts on the broken
group and would raise gloo's error instead.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist

from lightning_merak.checkpoint.files import newest_complete
from lightning_merak.distributed.watchdog import DEFAULT_DEAD_AFTER_S, DEFAULT_TIMEOUT_S, Watchdog

__all__ = ["FaultWatch", "RankLostError", "newest_checkpoint"]

log = logging.getLogger(__name__)

_PEER_FAILURES = ("connection closed by peer", "connection reset", "broken pipe", "timed out", "gloo", "nccl")
"""Words of the errors a collective raises when a peer is gone (gloo's, NCCL's, and torch's DistBackendError)."""


class RankLostError(RuntimeError):
    """A peer rank died: the message names it (rank, host, pid) and the newest checkpoint to resume from."""


def newest_checkpoint(trainer: pl.Trainer) -> str | None:
    """The newest complete checkpoint any of the trainer's checkpoint callbacks wrote, or None."""
    found = []
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        newest = newest_complete(Path(dirpath)) if dirpath else None
        if newest is not None:
            found.append((newest.stat().st_mtime, str(newest)))
    return max(found)[1] if found else None


@contextmanager
def _sigterm_held() -> Iterator[list[int]]:
    """Hold back SIGTERM in the main thread for the block; yields a list that holds it if it came (Python runs
    signal handlers in the main thread only, so elsewhere nothing is held)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: not set from Python


class FaultWatch(pl.Callback):
    """Watch collectives and peers during ``fit`` (see :mod:`lightning_merak.distributed.watchdog`).

    Args:
        timeout_s: a collective that waits this long with none completing is a hang: every rank stops
            with a message naming the collective, its group and the ranks that did not arrive.
        dead_after_s: a peer whose heartbeat is silent this long is lost (one on this host: at once, when
            its process is gone). Survivors stop within about ``dead_after_s`` + 10 s.
        poll_s: how often the watchdog reads the collective counts and beats its heartbeat.
        timeout_option: how the user sets ``timeout_s``, named in the hang message.
    """

    def __init__(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        dead_after_s: float = DEFAULT_DEAD_AFTER_S,
        poll_s: float = 1.0,
        timeout_option: str = "FaultWatch(timeout_s=...)",
    ) -> None:
        Watchdog(timeout_s, dead_after_s, poll_s)  # refuses bad values now, before any process starts
        self.timeout_s, self.dead_after_s, self.poll_s = timeout_s, dead_after_s, poll_s
        self.timeout_option = timeout_option
        self.watchdog: Watchdog | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or not dist.is_initialized() or dist.get_world_size() == 1 or self.watchdog is not None:
            return
        group_timeout = getattr(trainer.strategy, "_timeout", None)  # Lightning's strategies keep it there
        watchdog = Watchdog(self.timeout_s, self.dead_after_s, self.poll_s,
                            checkpoint=lambda: newest_checkpoint(trainer), timeout_option=self.timeout_option,
                            group_timeout_s=group_timeout.total_seconds() if group_timeout is not None else None)
        try:
            watchdog.start()
        except (RuntimeError, ValueError) as error:  # no reachable rendezvous store: train on, unwatched
            log.warning("FaultWatch: the watchdog could not start (%s); hangs and lost ranks go unnamed", error)
            return
        self.watchdog = watchdog

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A collective failed because a peer is gone: raise :class:`RankLostError` naming it instead."""
        if self.watchdog is None or not any(word in str(exception).lower() for word in _PEER_FAILURES):
            return
        with _sigterm_held() as sigterm:
            lost = self.watchdog.lost_ranks(wait_s=self.dead_after_s + 3 * self.poll_s)
        if not lost:
            if sigterm:
                signal.raise_signal(signal.SIGTERM)  # no lost peer to name: the signal's own handling goes on
            return
        self.watchdog.handled = True
        message = self.watchdog.describe_lost(lost)
        log.error(message)
        raise RankLostError(message) from exception
