"""The planned layout's real step time next to the planner's prediction.

A plan is only as good as its cost model, and the model cannot see everything a run pays
(framework overhead, cache effects of the real schedule, a machine that drifts). After the
first steps of a planned run, merak3d compares the median measured step with the prediction
it chose the layout by, so users see how far to trust the choice. Plain Python: the strategy
feeds batch start times in and reduces the median over ranks itself.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

SUSPECT_ERROR = 0.25
"""Beyond this relative error the ranking of close layouts is not to be trusted."""


@dataclass(frozen=True)
class StepTimeCheck:
    """Predicted and measured step time of the layout a run trains with."""

    predicted_s: float
    measured_s: float
    batches: int
    """How many batches the measured median is over."""

    @property
    def error(self) -> float:
        """predicted / measured − 1: negative when the planner was optimistic."""
        return self.predicted_s / self.measured_s - 1.0

    @property
    def suspect(self) -> bool:
        return abs(self.error) > SUSPECT_ERROR

    def describe(self) -> str:
        return (f"merak3d planner: measured step {self.measured_s:.4g} s (median of {self.batches} batches, "
                f"slowest rank) vs predicted {self.predicted_s:.4g} s: prediction {100 * self.error:+.0f}%")


class BatchClock:
    """Wall time from one training batch's start to the next, after ``warmup`` batches.

    A pause between two batches (validation) is not a batch: :meth:`pause` drops the
    interval it falls in. The clock stops once it holds ``batches`` intervals.
    """

    def __init__(self, warmup: int, batches: int) -> None:
        if warmup < 0 or batches < 1:
            raise ValueError(f"BatchClock needs warmup >= 0 and batches >= 1, got warmup={warmup}, batches={batches}")
        self.warmup, self.batches = warmup, batches
        self._seen = 0
        self._last_start: float | None = None
        self.durations_s: list[float] = []

    @property
    def ready(self) -> bool:
        return len(self.durations_s) >= self.batches

    def batch_started(self, now_s: float) -> None:
        if self.ready:
            return
        if self._last_start is not None and self._seen > self.warmup:
            self.durations_s.append(now_s - self._last_start)
        self._seen += 1
        self._last_start = now_s

    def pause(self) -> None:
        self._last_start = None

    def median_s(self) -> float:
        if not self.durations_s:
            raise ValueError("BatchClock has measured no batch yet")
        return statistics.median(self.durations_s)
