"""What ``merak-train`` writes at a run's end: the final checkpoint, beside the periodic ones, and the list of outputs.

The final checkpoint goes where Lightning put the run's periodic checkpoints on every rank: rank 0's checkpoint
directory, which Lightning's checkpoint callback takes from rank 0 at setup. Each node's own output directory may be
another one (Hydra's default names it by the start time, and nodes start seconds apart); a sharded checkpoint saved
under each node's own would leave each node's shards in a different directory.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from lightning_merak.callbacks.checkpoint import PeriodicCheckpoint

__all__ = ["FINAL_CHECKPOINT", "checkpoint_directory", "finish_run_loggers", "outputs", "save_final_checkpoint"]

FINAL_CHECKPOINT = "final.ckpt"


def checkpoint_directory(trainer: pl.Trainer) -> Path:
    """The directory of the run's checkpoints, the same on every rank once ``fit`` has set the trainer up: that of
    merak-train's :class:`PeriodicCheckpoint` (the first one: merak-train adds its own before the user's callbacks,
    and Lightning keeps checkpoint callbacks in order), whose directory Lightning's setup broadcasts from rank 0."""
    periodic = next((callback for callback in trainer.callbacks if isinstance(callback, PeriodicCheckpoint)), None)
    if periodic is None or periodic.dirpath is None:
        raise RuntimeError("the trainer has no PeriodicCheckpoint with a directory after fit: merak-train adds one, "
                           "under its output directory's checkpoints, to every run it builds")
    return Path(periodic.dirpath)


def save_final_checkpoint(trainer: pl.Trainer, link_last: bool) -> Path:
    """Save the final checkpoint beside the periodic ones on every rank (``link_last``: point ``last.ckpt`` at it)
    and return its path."""
    checkpoints = checkpoint_directory(trainer)
    final_checkpoint = checkpoints / FINAL_CHECKPOINT
    trainer.save_checkpoint(final_checkpoint, weights_only=False)
    if link_last and trainer.is_global_zero:
        last = checkpoints / "last.ckpt"  # a link, not a copy
        if last.is_symlink() or last.exists():
            last.unlink()
        last.symlink_to(final_checkpoint.name)
    return final_checkpoint


def outputs(trainer: pl.Trainer, final_checkpoint: Path) -> list[str]:
    """``what: where`` for each output the run wrote: the final checkpoint and each logger's files that exist."""
    found = [f"checkpoint: {final_checkpoint}"] if final_checkpoint.exists() else []
    for logger in trainer.loggers:
        directory = _run_folder(logger) or getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        where = Path(directory) / "metrics.csv" if isinstance(logger, CSVLogger) and directory else directory
        if where is not None and Path(where).exists():
            kind = "metrics" if isinstance(logger, CSVLogger) else type(logger).__name__.removesuffix("Logger").lower()
            found.append(f"{kind}: {where}")
    paths = getattr(trainer.profiler, "paths", None)  # profiler=trace: the trace, its Perfetto file, the timeline
    if isinstance(paths, dict):
        found += [f"{kind}: {path}" for kind, path in paths.items() if Path(path).exists()]
    return found


def _wandb_run(logger: object) -> object | None:
    """The W&B run ``logger`` started on this rank, where it is a W&B logger that started one; None otherwise
    (reading ``.experiment`` would start one)."""
    return getattr(logger, "_experiment", None) if type(logger).__name__ == "WandbLogger" else None


def _run_folder(logger: object) -> Path | None:
    """A W&B run's own folder (``wandb/offline-run-…``: what ``wandb sync`` takes); None for another logger."""
    files = getattr(_wandb_run(logger), "dir", None)
    return Path(files).parent if isinstance(files, str) and files else None


def finish_run_loggers(trainer: pl.Trainer) -> None:
    """Finish the W&B runs of ``trainer``'s loggers now, so what W&B prints as a run ends ("You can sync this run")
    comes before merak-train's done-line, the last line, rather than at the process's exit."""
    for logger in trainer.loggers:
        finish = getattr(_wandb_run(logger), "finish", None)
        if callable(finish):
            finish()
