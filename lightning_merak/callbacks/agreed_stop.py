"""``AgreedSigtermStop``: on SIGTERM every rank stops ``fit`` at the same step, with no collective in a signal handler.

Why: Lightning's SIGTERM handler (2.6) broadcasts from rank 0 inside the handler. Python runs a handler between two
bytecodes of the main thread, wherever that thread is, so the broadcast is matched with whatever collective the
peers are in (a gradient all-reduce, a pipeline send, Lightning's own per-batch broadcast): the ranks deadlock until
a termination grace ends them, or tensors of equal size silently swap data. Each rank then stops on its own flag,
so ranks signalled a moment apart stop at different steps.

How: during ``fit`` a handler that only records the signal takes the place of Lightning's (it still passes the
signal on once to the ranks Lightning's launcher started; the SLURM requeue handler and any earlier handler stay
chained after it). At each training batch's end the ranks vote
(:class:`~lightning_merak.distributed.stop_agreement.StopAgreement`, read one batch later): once any rank was
signalled, every rank sets Lightning's ``received_sigterm`` at the same batch end, and Lightning raises
``SIGTERMException`` on all of them at the same ``global_step``. A single process has nobody to agree with: the
signal sets Lightning's flag at once, as Lightning does.
"""

from __future__ import annotations

import functools
import logging
from types import FrameType
from typing import Any, Optional

import lightning
import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info, rank_zero_warn

from lightning_merak.distributed.stop_agreement import StopAgreement

__all__ = ["AgreedSigtermStop", "add_agreed_sigterm_stop"]

log = logging.getLogger(__name__)

_SIGNAL_CONNECTOR_NAMES = ("_sigterm_notifier_fn", "received_sigterm")
"""What this callback uses of Lightning's private ``trainer._signal_connector``."""


class AgreedSigtermStop(pl.Callback):
    """On SIGTERM, stop ``fit`` on every rank at the same step, one training batch after the first rank's signal.

    ``merak-train`` adds it for every strategy, and ``Merak3DStrategy`` adds it to a fit that lacks one; add it
    yourself to a Trainer of another strategy. ``signalled``: whether this rank received SIGTERM during the fit.
    """

    def __init__(self) -> None:
        self.signalled = False
        self._connector: Any = None
        self._agreement: Optional[StopAgreement] = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        connector = getattr(trainer, "_signal_connector", None)
        if not all(hasattr(connector, name) for name in _SIGNAL_CONNECTOR_NAMES):
            _warn_unsupported(lightning.__version__)
            return
        self.signalled = False
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            self._agreement = StopAgreement(getattr(trainer.strategy, "_timeout", None))  # Lightning's keep it there
        self._connector = connector
        # the Trainer composes its SIGTERM handler from this attribute after on_fit_start (register_signal_handlers)
        connector._sigterm_notifier_fn = self._record_sigterm

    def _record_sigterm(self, signum: int, frame: Optional[FrameType]) -> None:
        """Lightning's notifier without its broadcast: note the signal; pass it on to launched ranks once."""
        trainer = self._connector.trainer
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        if not self.signalled and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        self.signalled = True
        if self._agreement is None:  # one process: its own flag is the decision
            self._connector.received_sigterm = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._agreement is None or not self._agreement.vote(self.signalled) or self._connector.received_sigterm:
            return
        rank_zero_info(f"SIGTERM reached a rank: every rank stops after step {trainer.global_step}")
        self._connector.received_sigterm = True  # Lightning raises SIGTERMException at this batch's end

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # the agreed stop leaves no vote in flight; after a failure a peer may never start the one in flight
        self._end(peers_voted=self._agreement is not None and self._agreement.agreed)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end(peers_voted=True)  # the fit ended well: every rank started the vote in flight

    def _end(self, peers_voted: bool) -> None:
        """Close the votes and hand the notifier back. The handler composed from it stays installed until the
        Trainer's teardown restores the previous one: a signal meanwhile (after a failure) sets Lightning's flag."""
        if self._agreement is not None:
            self._agreement.close(peers_voted)
            self._agreement = None
        if self._connector is not None:
            vars(self._connector).pop("_sigterm_notifier_fn", None)  # Lightning's own for a later validate, test


def add_agreed_sigterm_stop(trainer: pl.Trainer) -> None:
    """Give ``trainer`` an :class:`AgreedSigtermStop` unless it has one (a strategy's ``setup``, before
    ``on_fit_start``)."""
    if not any(isinstance(callback, AgreedSigtermStop) for callback in trainer.callbacks):
        trainer.callbacks.append(AgreedSigtermStop())


@functools.cache
def _warn_unsupported(version: str) -> None:
    """Once per process: this Lightning lacks what the callback replaces."""
    rank_zero_warn(
        f"AgreedSigtermStop: Lightning {version} has no trainer._signal_connector with "
        f"{' and '.join(_SIGNAL_CONNECTOR_NAMES)}; SIGTERM keeps Lightning's own handling (ranks may stop at "
        "different steps, or wait on each other). Use a Lightning version with them (2.6) for an agreed stop"
    )
