"""Expert-load heatmaps of a run's MoE layers (steps × EP rank, without and with the placement plan's replicas),
and when to log the load metrics, for both MoE callbacks: swapped DeepSpeed-MoE layers and ``merak_ep``
(:class:`LoadLogging`).

At the end of training rank 0 saves its first MoE layer's figure as a PNG (``heatmap_path``, or
``<trainer.log_dir>/moe_load_heatmap.png`` with ``heatmap_in_log_dir``) and hands every layer's figure to the
loggers (``moe/load_heatmap/layer<i>``, :func:`~lightning_merak.callbacks.metrics.figures.log_figure`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lightning_merak.callbacks.metrics.figures import log_figure
from lightning_merak.callbacks.metrics.steps import logged_step, logs_at
from lightning_merak.plugins.moe.options import check_count, check_flag

__all__ = ["HEATMAP_FILE", "LoadLogging", "LoadRows", "check_heatmap_place", "heatmap_file", "load_heatmap_figure",
           "log_load_heatmaps", "plot_load_heatmap"]

HEATMAP_FILE = "moe_load_heatmap.png"

LoadRows = tuple[list[list[int]], list[list[int]]]
"""One layer's load per step and EP rank: without the plan (each expert on its owner), and with it."""


def check_heatmap_place(heatmap_path: Optional[str | Path], heatmap_in_log_dir: bool) -> None:
    """Refuse a heatmap place that is not one PNG file: a directory, or both places at once."""
    if heatmap_path is not None and (not isinstance(heatmap_path, (str, Path)) or Path(heatmap_path).is_dir()):
        raise ValueError(f"heatmap_path={str(heatmap_path)!r} must name a PNG file, not a directory; pass a file "
                         f"path such as {HEATMAP_FILE!r}, or None for no heatmap")
    check_flag("heatmap_in_log_dir", heatmap_in_log_dir)
    if heatmap_path is not None and heatmap_in_log_dir:
        raise ValueError(
            f"heatmap_path={str(heatmap_path)!r} and heatmap_in_log_dir=True both place the load heatmap; "
            "pass one of them")


def load_heatmap_figure(before: Sequence[Sequence[float]], after: Sequence[Sequence[float]], title: str = "") -> Figure:
    """Two heatmaps (steps × EP rank): compute load without and with the placement plan (no pyplot: the user's
    backend and figure list are left alone)."""
    figure = Figure(figsize=(9, 3.6))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 2, sharey=True)
    vmax = max(max(map(max, before)), max(map(max, after)), 1)
    for ax, data, label in zip(axes, (before, after), ("before (each expert on its owner)", "after (plan)")):
        image = ax.imshow(list(map(list, data)), aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
        ax.set_title(label)
        ax.set_xlabel("EP rank")
    axes[0].set_ylabel("step")
    figure.colorbar(image, ax=axes, label="rows computed")
    if title:
        figure.suptitle(title)
    return figure


def plot_load_heatmap(
    before: Sequence[Sequence[float]], after: Sequence[Sequence[float]], path: Path, title: str = ""
) -> Path:
    """:func:`load_heatmap_figure` saved as a PNG at ``path``."""
    return _save_png(load_heatmap_figure(before, after, title), path)


def _save_png(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def heatmap_file(trainer: pl.Trainer, heatmap_path: Optional[str | Path], heatmap_in_log_dir: bool) -> Optional[Path]:
    """Where the PNG goes; ``trainer.log_dir`` broadcasts from rank 0, so every rank must call this."""
    if heatmap_in_log_dir:
        if not trainer.loggers:  # alike on every rank, so skipping the broadcast here is safe
            return None
        return Path(trainer.log_dir or trainer.default_root_dir) / HEATMAP_FILE
    return None if heatmap_path is None else Path(heatmap_path)


def log_load_heatmaps(trainer: pl.Trainer, history: Mapping[int, LoadRows], path: Optional[Path], step: int) -> None:
    """Rank 0: the first layer's figure to ``path`` (if any), every layer's to the loggers at ``step``."""
    if not trainer.is_global_zero or not history:
        return
    first = min(history)  # a pipeline stage holds only some layers
    for index, (before, after) in sorted(history.items()):
        if not before:
            continue
        figure = load_heatmap_figure(before, after, f"MoE layer {index}")
        saved = _save_png(figure, path) if index == first and path is not None else None
        log_figure(trainer, f"moe/load_heatmap/layer{index}", figure, step=step, already_saved=saved)


class LoadLogging(pl.Callback):
    """What both MoE callbacks do alike: log their metrics every ``log_every_n_steps`` optimizer steps (``None``:
    the trainer's ``log_every_n_steps``) and at the last step, at Lightning's step numbering
    (:mod:`~lightning_merak.callbacks.metrics.steps`), and draw each layer's load rows (``history``) at the end."""

    def __init__(self, log_every_n_steps: Optional[int], heatmap_path: Optional[str | Path],
                 heatmap_in_log_dir: bool) -> None:
        if log_every_n_steps is not None:
            check_count("log_every_n_steps", log_every_n_steps, 1,
                        "pass the steps between logged metrics (1: every step), or None for the trainer's")
        check_heatmap_place(heatmap_path, heatmap_in_log_dir)
        self.log_every_n_steps = log_every_n_steps
        self.heatmap_path = heatmap_path
        self.heatmap_in_log_dir = heatmap_in_log_dir
        self.history: dict[int, LoadRows] = {}
        """Each layer's load per training batch and EP rank (layer: its index in the model's layers)."""
        self._stepped_at: Optional[int] = None
        """``trainer.global_step`` after the last optimizer step seen (a batch without one accumulates)."""
        self._unlogged_step: Optional[int] = None
        """The logged step of the last optimizer step, until its metrics are logged."""
        self._last_step = 0

    def _stepped(self, trainer: pl.Trainer) -> Optional[bool]:
        """After a training batch: None where it made no optimizer step (gradients accumulate), else whether this
        step's metrics are logged now."""
        if trainer.global_step == self._stepped_at:
            return None
        self._stepped_at = trainer.global_step
        self._unlogged_step = self._last_step = logged_step(trainer, after_update=True)
        return logs_at(self._last_step, self.log_every_n_steps or trainer.log_every_n_steps)

    @property
    def _has_unlogged_step(self) -> bool:
        """Whether the last optimizer step's metrics are still to be logged (the run ended inside an interval)."""
        return self._unlogged_step is not None

    def _log_metrics(self, trainer: pl.Trainer, metrics: Mapping[str, float]) -> None:
        """``metrics`` to the loggers at the last optimizer step's logged step (global rank 0's)."""
        if self._unlogged_step is None:
            return
        if trainer.is_global_zero and metrics:
            for logger in trainer.loggers:
                logger.log_metrics(dict(metrics), step=self._unlogged_step)
        self._unlogged_step = None

    def _draw_heatmaps(self, trainer: pl.Trainer) -> None:
        """The heatmaps to their PNG and the loggers (every rank calls this: finding the PNG's place may be a
        collective)."""
        path = heatmap_file(trainer, self.heatmap_path, self.heatmap_in_log_dir)
        log_load_heatmaps(trainer, self.history, path, self._last_step)
