"""Figures to every logger of a run, whichever kind, and the memory-over-steps figure.

:func:`log_figure` asks each logger what it can take rather than checking its class, so a subclass or
another logger with the same methods works too: an ``experiment`` with ``add_figure`` (TensorBoard), a
logger with ``log_image`` (W&B, which wraps the figure in ``wandb.Image``), an ``experiment`` with
``log_figure`` and a ``run_id`` (MLflow), and otherwise a logger with a ``log_dir`` (CSV) gets a PNG in
``<log_dir>/figures/``. Figures are ``matplotlib.figure.Figure`` objects made without pyplot, so the user's
backend and pyplot's figure list are left alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping, Optional, Sequence

import lightning.pytorch as pl
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["log_figure", "memory_figure"]


def _file_name(name: str, step: int) -> str:
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-step{step}.png"


def log_figure(trainer: pl.Trainer, name: str, figure: Figure, step: int,
               already_saved: Optional[Path] = None) -> list[str]:
    """Log ``figure`` under ``name`` at ``step`` to each of ``trainer``'s loggers (global rank 0 only); returns
    where it went, one entry per logger that took it.

    ``already_saved``: a PNG of the same figure the caller wrote; a file-only logger whose ``log_dir`` holds it
    is not given a second copy.
    """
    if not trainer.is_global_zero:
        return []
    logged = []
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        if experiment is not None and hasattr(experiment, "add_figure"):
            experiment.add_figure(name, figure, global_step=step, close=False)
            logged.append(f"{type(logger).__name__}: add_figure {name}")
        elif hasattr(logger, "log_image"):
            logger.log_image(key=name, images=[figure], step=step)
            logged.append(f"{type(logger).__name__}: log_image {name}")
        elif experiment is not None and hasattr(experiment, "log_figure") and getattr(logger, "run_id", None):
            experiment.log_figure(logger.run_id, figure, _file_name(name, step))
            logged.append(f"{type(logger).__name__}: log_figure {_file_name(name, step)}")
        elif getattr(logger, "log_dir", None):
            directory = Path(logger.log_dir)
            if already_saved is not None and Path(already_saved).resolve().parent == directory.resolve():
                continue
            path = directory / "figures" / _file_name(name, step)
            path.parent.mkdir(parents=True, exist_ok=True)
            figure.savefig(path, dpi=110)
            logged.append(str(path))
    return logged


def memory_figure(steps: Sequence[int], peak_mib: Mapping[int, Sequence[float]],
                  current_mib: Mapping[int, Sequence[float]], source: str) -> Figure:
    """Each rank's memory at each logged step: its high-water mark (solid) and what it held then (dashed)."""
    figure = Figure(figsize=(8, 4))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for rank in sorted(peak_mib):
        line, = axes.plot(steps, peak_mib[rank], marker="o", label=f"rank {rank} peak")
        axes.plot(steps, current_mib[rank], linestyle="--", color=line.get_color(), label=f"rank {rank} at step")
    axes.set_xlabel("step")
    axes.set_ylabel("MiB")
    axes.set_title(f"memory per rank ({source})")
    axes.legend(loc="best", fontsize=7)
    figure.tight_layout()
    return figure
