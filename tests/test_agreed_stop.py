"""SIGTERM to one rank stops every rank of a fit at the same step (``AgreedSigtermStop``), and the SIGTERM handler
runs no collective: Lightning's broadcast inside its handler met whatever collective the peer was in."""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_merak.callbacks import agreed_stop
from lightning_merak.callbacks.agreed_stop import AgreedSigtermStop
from lightning_merak.distributed.termination import install_termination_handler
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed
from tests import test_merak3d as dense

SIGNAL_STEP = 1
"""The step whose start sends SIGTERM; every rank stops at the end of the next one (the vote is read a step late)."""


class _Launcher:
    def __init__(self) -> None:
        self.killed: list[int] = []

    def kill(self, signum: int) -> None:
        self.killed.append(signum)


class _Agreement:
    """Stands in for the gloo vote: agrees once told to."""

    def __init__(self, timeout: Any) -> None:
        self.votes: list[bool] = []
        self.agreed = False

    def vote(self, stop: bool) -> bool:
        self.votes.append(stop)
        return self.agreed

    def close(self, peers_voted: bool) -> None:
        pass


def test_the_sigterm_handler_of_a_rank_only_records_the_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank of two (no process group here): the handler Lightning composes during a fit runs no collective and
    stops nothing on its own; the launcher's ranks are signalled once; the vote decides, then Lightning's own
    handler is back."""
    broadcasts: list[Any] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "broadcast", lambda *args, **kwargs: broadcasts.append(args))
    monkeypatch.setattr(pl.Trainer, "world_size", property(lambda self: 2))
    monkeypatch.setattr(agreed_stop, "StopAgreement", _Agreement)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    launcher = trainer.strategy._launcher = _Launcher()
    stop, connector = AgreedSigtermStop(), trainer._signal_connector
    stop.on_fit_start(trainer, None)
    connector.register_signal_handlers()  # as the Trainer does after on_fit_start
    try:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        assert (broadcasts, trainer.received_sigterm, stop.signalled) == ([], False, True)
        assert launcher.killed == [signal.SIGTERM]
        stop.on_train_batch_end(trainer, None, None, None, 0)
        assert not trainer.received_sigterm, "the peers have not agreed yet"
        stop._agreement.agreed = True
        stop.on_train_batch_end(trainer, None, None, None, 1)
        assert trainer.received_sigterm
        assert stop._agreement.votes == [True, True]
        stop.on_exception(trainer, None, SIGTERMException())
        assert "_sigterm_notifier_fn" not in vars(connector)
        signal.raise_signal(signal.SIGTERM)  # before the Trainer's teardown restores the previous handler
        assert launcher.killed == [signal.SIGTERM]
    finally:
        connector.teardown()


def test_a_lightning_without_the_signal_connector_keeps_its_own_handling(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    monkeypatch.setattr(trainer, "_signal_connector", None)
    agreed_stop._warn_unsupported.cache_clear()  # it warns once per process
    with pytest.warns(UserWarning, match=rf"Lightning {pl.__version__} has no trainer._signal_connector"):
        AgreedSigtermStop().on_fit_start(trainer, None)


class _SignalAt(pl.Callback):
    """Sends SIGTERM to this process at the start of ``step`` on ``rank`` only."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if (trainer.global_rank, trainer.global_step) == (self.rank, self.step):
            os.kill(os.getpid(), signal.SIGTERM)


class _WithValidation(dense._ShardedData):
    def val_dataloader(self) -> Any:
        return self.train_dataloader()


def _losses_until_stopped(strategy: Any, callbacks: list[pl.Callback], **trainer_kwargs: Any) -> dict[str, Any]:
    """This rank's logged losses of a fit of merak3d's test model, and the step a SIGTERMException stopped it at."""
    recorder = dense._Recorder([])
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[recorder, *callbacks], **trainer_kwargs)
    stopped_at = None
    try:
        trainer.fit(dense._module("llama"), datamodule=_WithValidation(0, dense.STEPS))
    except SIGTERMException:
        stopped_at = trainer.global_step
    agreed = [callback for callback in trainer.callbacks if isinstance(callback, AgreedSigtermStop)]
    return {"losses": recorder.losses, "stopped_at": stopped_at, "agreed_stops": len(agreed),
            "handler_restored": "_sigterm_notifier_fn" not in vars(trainer._signal_connector)}


def stop_one_rank(rank: int, world_size: int, leg: str) -> list[dict[str, Any]]:
    """``ddp``: rank 1 signalled, validation between the votes, the callback added by the user; then a fit
    without a signal ends well with a vote in flight. ``merak3d``: two pipeline stages, rank 0 signalled, the
    callback added by the strategy."""
    install_termination_handler(grace_s=150)  # as merak-train: its handler stays chained after Lightning's
    if leg == "ddp":
        validation = {"limit_val_batches": 2, "val_check_interval": 2, "num_sanity_val_steps": 1}
        return [_losses_until_stopped("ddp", [AgreedSigtermStop(), _SignalAt(1, SIGNAL_STEP)], **validation),
                _losses_until_stopped("ddp", [AgreedSigtermStop()], **validation)]
    strategy = Merak3DStrategy(data_parallel=1, pipeline_parallel=2, tensor_parallel=1, timeout_s=120)
    return [_losses_until_stopped(strategy, [_SignalAt(0, SIGNAL_STEP)], limit_val_batches=0)]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("leg", ["ddp", "merak3d"])
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(leg: str) -> None:
    reference = dense._reference("llama").losses
    results = run_distributed(stop_one_rank, world_size=2, args=(leg,), timeout_s=200)
    stopped = [fits[0] for fits in results]
    for fit in stopped:
        assert fit["stopped_at"] == SIGNAL_STEP + 2, stopped
        assert fit["losses"] == pytest.approx(reference[:SIGNAL_STEP + 2], rel=1e-5)
        assert (fit["agreed_stops"], fit["handler_restored"]) == (1, True)
    for fits in results:
        for fit in fits[1:]:  # no signal: the fit ends well, with a vote in flight at its end
            assert fit["stopped_at"] is None
            assert fit["losses"] == pytest.approx(reference, rel=1e-5)
