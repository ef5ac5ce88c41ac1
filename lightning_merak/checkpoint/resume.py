"""Which checkpoint a run resumes from: ``resume=auto`` picks the newest complete one by itself.

Under ``torchrun --max-restarts N`` a failed rank makes torchrun restart every rank with the same
command line; with ``resume=auto`` each restarted rank finds the newest complete checkpoint of the
run's ``checkpoints`` directory (:func:`~lightning_merak.checkpoint.files.newest_complete`)
and continues from it, or starts afresh when none was written yet. The run's output directory must
be the same across restarts (``hydra.run.dir=...``; the default one is named by the start time) and,
across hosts, on a file system every host sees.

From Python: ``trainer.fit(module, ckpt_path=resume_path("auto", checkpoints_dir))``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from lightning_merak.checkpoint.files import is_complete, newest_complete

__all__ = ["AUTO", "resume_path"]

AUTO = "auto"


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
        return newest_complete(Path(checkpoints))
    path = Path(resume).expanduser()
    if not path.exists():
        raise ValueError(f"resume={resume}: no such checkpoint; pass an existing .ckpt file or checkpoint "
                         f"directory, or resume=auto to pick the newest complete one in {checkpoints}")
    if is_complete(path):
        return path
    if path.is_dir():
        newest = newest_complete(path)
        if newest is not None:
            return newest
        raise ValueError(f"resume={resume}: the directory holds no complete checkpoint (*.ckpt); pass one, or "
                         "resume=auto to start afresh when none exists")
    raise ValueError(f"resume={resume} is not a complete checkpoint (cut short while it was written?); pass "
                     "another one, or resume=auto to pick the newest complete one")
