"""Which checkpoint a run resumes from: ``resume=auto`` picks the newest complete one by itself.

Under ``torchrun --max-restarts N`` a failed rank makes torchrun restart every rank with the same
command line; with ``resume=auto`` each restarted rank finds the newest complete checkpoint of the
run's ``checkpoints`` directory (:func:`~lightning_merak.checkpoint.files.newest_complete`)
and continues from it, or starts afresh when none was written yet. Newer checkpoints it skips (a save
cut short, a merak3d directory lacking a shard) are named in a warning with what they lack, so a user
sees which step the run went back to and why. The run's output directory must be the same across
restarts (``hydra.run.dir=...``; the default one is named by the start time) and, across hosts, on a
file system every host sees.

A checkpoint named explicitly that is not complete is refused, naming what it lacks and the newest complete
checkpoint beside it to resume from instead (a merak3d directory is never searched as a directory of checkpoints:
its own ``lightning.ckpt`` is no checkpoint to resume).

From Python: ``trainer.fit(module, ckpt_path=resume_path("auto", checkpoints_dir))``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

from lightning_merak.checkpoint.files import (
    is_checkpoint_directory,
    newest_complete,
    newest_complete_and_skipped,
    why_incomplete,
)

__all__ = ["AUTO", "resume_path"]

AUTO = "auto"

log = logging.getLogger(__name__)


def _newest_complete_naming_skipped(resume: str, directory: Path) -> Optional[Path]:
    """The newest complete checkpoint in ``directory``, warning about each newer one skipped and why."""
    newest, skipped = newest_complete_and_skipped(directory)
    if skipped:
        chosen = f"resuming from {newest}" if newest is not None else "no complete checkpoint is left"
        log.warning(f"resume={resume}: skipped incomplete checkpoints ("
                    + "; ".join(f"{path}: {why}" for path, why in skipped) + f"); {chosen}")
    return newest


def _incomplete(resume: str, path: Path, why: str) -> ValueError:
    """The refusal of the incomplete checkpoint ``path``, naming the newest complete one beside it, if any."""
    earlier = newest_complete(path.parent)
    instead = (f"resume from the newest complete checkpoint beside it: resume={earlier}" if earlier is not None else
               "no complete checkpoint is beside it: pass another one, or resume=auto to start afresh")
    return ValueError(f"resume={resume} is not a complete checkpoint: {why}; {instead}")


def resume_path(resume: Optional[str], checkpoints: Union[str, Path]) -> Optional[Path]:
    """The checkpoint to resume from, or None to start afresh.

    Args:
        resume: None (start afresh), ``"auto"`` (the newest complete checkpoint in ``checkpoints``,
            if any), a checkpoint (a ``.ckpt`` file or merak3d directory), or a directory of them
            (its newest complete one).
        checkpoints: the run's checkpoint directory, searched by ``"auto"``.
    """
    if resume is None or resume == "":
        return None
    if resume == AUTO:
        return _newest_complete_naming_skipped(resume, Path(checkpoints))
    path = Path(resume).expanduser()
    if not path.exists():
        raise ValueError(f"resume={resume}: no such checkpoint; pass an existing .ckpt file or checkpoint "
                         f"directory, or resume=auto to pick the newest complete one in {checkpoints}")
    if path.is_file() or is_checkpoint_directory(path):
        why = why_incomplete(path)
        if why is not None:
            raise _incomplete(resume, path, why)
        return path
    newest = _newest_complete_naming_skipped(resume, path)
    if newest is None:
        raise ValueError(f"resume={resume}: the directory holds no complete checkpoint (*.ckpt); pass one, or "
                         "resume=auto to start afresh when none exists")
    return newest
