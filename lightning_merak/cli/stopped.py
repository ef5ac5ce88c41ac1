"""A run stopped by SIGTERM ends with a failing exit status and says where to resume.

Lightning stops ``fit`` on SIGTERM by raising ``SIGTERMException``, a ``SystemExit`` without a code: the process
exits with status 0, which a shell (``merak-train ... && next-step``), a job script or torchrun reads as a finished
run. ``merak-train`` exits with ``128 + SIGTERM`` (143), as a process the signal ended does, after one line naming
the step it stopped at and the newest complete checkpoint to resume from.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import Iterator

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_merak.callbacks.faults import newest_checkpoint

__all__ = ["SIGTERM_EXIT_STATUS", "exit_failing_on_sigterm"]

SIGTERM_EXIT_STATUS = 128 + int(signal.SIGTERM)


@contextmanager
def exit_failing_on_sigterm(trainer: pl.Trainer) -> Iterator[None]:
    """Turn Lightning's SIGTERM stop inside the block into exit status 143 (on every rank; rank 0 says why)."""
    try:
        yield
    except SIGTERMException:
        if trainer.is_global_zero:
            newest = newest_checkpoint(trainer)
            resume = (f"resume from {newest} (resume={newest}, or resume=auto with the same hydra.run.dir)"
                      if newest is not None else "no checkpoint was written yet")
            print(f"merak-train: stopped by SIGTERM at step {trainer.global_step}, before the run's end; {resume}",
                  file=sys.stderr, flush=True)
        sys.exit(SIGTERM_EXIT_STATUS)
