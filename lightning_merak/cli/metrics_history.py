"""``logger=csv``'s logger: a run restarted with ``resume`` keeps the loss history of the attempts before it.

Why: merak-train writes every attempt of a run to the same ``<output_dir>/csv`` (``version: ""``, so a
``torchrun --max-restarts`` restart continues the run's files rather than starting ``version_1``), and Lightning's
CSVLogger deletes the ``metrics.csv`` it finds there: a restart lost every row of the attempt that died.

Here an attempt that resumed (its first row's step is above 0) keeps the earlier rows, except those it logs again:
an earlier row is replaced once this attempt logs one of its metrics at the same or an earlier step, which are the
rows a dead attempt logged after the checkpoint this one resumed from (the same steps run again). Each metric is
matched by its own first step, so one that a callback logs at another step than Lightning's (``global_step`` after the
update) keeps its row of the resumed step; ``TrainingMetrics`` logs at Lightning's step, like ``train/loss``: the
sixth update is step 5.
An attempt that starts at step 0 replaces the whole file, as Lightning's did; nothing is rewritten before the
attempt logs its first row.
"""

from __future__ import annotations

import csv

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["ResumableCSVLogger"]

Row = dict[str, str]


def _step(row: Row) -> float:
    """The step of a row read back from ``metrics.csv`` (a row without one counts as before every step)."""
    try:
        return float(row.get("step") or "-inf")
    except ValueError:
        return float("-inf")


_NOT_METRICS = ("step", "epoch")
"""Columns every row of Lightning's holds, whichever metrics it logs."""


def _names(row: dict[str, object]) -> list[str]:
    """The metrics a row holds (a row read back has every column, those it does not hold empty)."""
    return [name for name, value in row.items() if name not in _NOT_METRICS and value not in ("", None)]


class _ContinuingWriter(ExperimentWriter):
    """Lightning's writer, keeping the rows of an earlier attempt's file that this attempt does not log again."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        self._earlier: list[Row] | None = None  # read at the first save
        self._first_steps: dict[str, float] = {}  # each metric: the first step this attempt logs it at

    def _check_log_dir_exists(self) -> None:
        """Leave an earlier attempt's files in place (Lightning's writer deletes its ``metrics.csv`` here)."""

    def save(self) -> None:
        if self.metrics:
            self._replace_earlier_rows()
        super().save()

    def _replace_earlier_rows(self) -> None:
        """Drop the earlier rows this save's rows log again (at the first save: all, if this attempt starts at
        step 0), rewriting the file where any go."""
        first_save = self._earlier is None
        if self._earlier is None:
            fresh = min(float(row["step"]) for row in self.metrics) <= 0
            self._earlier = [] if fresh else self._read()
            if self._earlier:
                self.metrics_keys = sorted(self._earlier[0])  # the earlier columns stay in the header
        for row in self.metrics:
            for name in _names(row):
                self._first_steps[name] = min(self._first_steps.get(name, float("inf")), float(row["step"]))
        kept = [row for row in self._earlier
                if all(_step(row) < self._first_steps.get(name, float("inf")) for name in _names(row))]
        if first_save or len(kept) < len(self._earlier):
            ours = [] if first_save else self._read()[len(self._earlier):]
            self._earlier = kept
            self._write(kept + ours)

    def _read(self) -> list[Row]:
        if not self._fs.isfile(self.metrics_file_path):
            return []
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            return list(csv.DictReader(file))

    def _write(self, rows: list[Row]) -> None:
        if not rows:
            if self._fs.isfile(self.metrics_file_path):
                self._fs.rm_file(self.metrics_file_path)
            return
        with self._fs.open(self.metrics_file_path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(rows)


class ResumableCSVLogger(CSVLogger):
    """Lightning's :class:`~lightning.pytorch.loggers.CSVLogger`, whose ``metrics.csv`` keeps the rows an earlier
    attempt of the run logged before the step this one resumed from (see the module's docstring)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            if not callable(getattr(ExperimentWriter, "_check_log_dir_exists", None)):  # the hook overridden above
                rank_zero_warn("this Lightning's CSV writer has no _check_log_dir_exists, where earlier ones delete "
                               "an existing metrics.csv: a restart's rows of earlier attempts may not be kept")
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(log_dir=self.log_dir)
        return self._experiment
