"""Under torchrun, the survivors of a killed rank end with ``RankLostError``, as the faults guide says.

torchrun's agent sends the survivors SIGTERM as soon as one rank dies; it came while ``FaultWatch.on_exception``
waited for the watchdog's verdict, and Lightning's SIGTERM handler, broadcasting on the broken group, raised
gloo's "Connection reset by peer" out of the wait. Here the verdict's wait is given such a SIGTERM by calling the
process's SIGTERM handler as Python would on delivery (no real signal: merak's termination handler may watch this
process).
"""

from __future__ import annotations

import signal

import pytest

from lightning_merak.callbacks.faults import FaultWatch, RankLostError

PEER_RESET = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:26511: Connection reset by peer"


def _lightning_sigterm_handler(signum, frame):
    """What Lightning's ``_sigterm_notifier_fn`` does on a broken group: its broadcast raises gloo's error."""
    raise RuntimeError(PEER_RESET)


class _VerdictAfterSigterm:
    """A watchdog whose verdict comes after torchrun's SIGTERM reached the waiting main thread."""

    handled = False

    def __init__(self, lost: dict[int, str]) -> None:
        self.lost = lost

    def lost_ranks(self, wait_s: float) -> dict[int, str]:
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        return self.lost

    def describe_lost(self, lost: dict[int, str]) -> str:
        return f"lightning_merak: lost rank {min(lost)} ({lost[min(lost)]}); resume from .../step=6.ckpt"


@pytest.fixture
def lightning_sigterm_handler():
    previous = signal.signal(signal.SIGTERM, _lightning_sigterm_handler)
    yield
    signal.signal(signal.SIGTERM, previous)


def _watch(lost: dict[int, str]) -> FaultWatch:
    watch = FaultWatch()
    watch.watchdog = _VerdictAfterSigterm(lost)  # type: ignore[assignment]
    return watch


@pytest.mark.usefixtures("lightning_sigterm_handler")
def test_a_sigterm_during_the_wait_still_ends_with_rank_lost_error():
    with pytest.raises(RankLostError, match=r"lost rank 1 \(host h, pid 42\)"):
        _watch({1: "host h, pid 42"}).on_exception(None, None, RuntimeError(PEER_RESET))
    assert signal.getsignal(signal.SIGTERM) is _lightning_sigterm_handler


@pytest.mark.usefixtures("lightning_sigterm_handler")
def test_a_sigterm_with_no_lost_rank_is_handled_as_it_would_have_been(monkeypatch):
    raised = []
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    _watch({}).on_exception(None, None, RuntimeError(PEER_RESET))
    assert raised == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is _lightning_sigterm_handler
