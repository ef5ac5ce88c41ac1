"""Hydra ``profiler`` options: ``profiler=none`` (default) and ``profiler=trace`` (:class:`MerakTraceProfiler`).

``merak-train profiler=trace profiler.steps=3`` records a few steps on every rank after
``skip_steps`` warm-up steps and writes ``merak_trace.json`` and ``merak_trace.perfetto.json``
into the run's output directory, with the replay summary in the log, after timing ``profiler.untraced_steps``
(default 8) untraced steps, which a ``planner_calibration`` from the trace anchors on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lightning_merak.cli.config import OPTION_NAME_HELP, register_option
from lightning_merak.util.fields import option

__all__ = ["NoProfilerConfig", "TraceProfilerConfig", "register"]


@dataclass
class NoProfilerConfig:
    """No profiler: nothing is wrapped or recorded."""

    name: str = option("none", OPTION_NAME_HELP)

    def build(self, output_dir: Path) -> Optional[Any]:
        return None


@dataclass
class TraceProfilerConfig(NoProfilerConfig):
    """Trace ``steps`` training steps after ``skip_steps`` on every rank, then replay them."""

    name: str = "trace"
    skip_steps: int = option(2, "Warm-up steps before tracing.")
    steps: int = option(3, "Training steps traced on every rank.")
    block_spans: bool = option(True, "Time each block of the model's largest `ModuleList` too.")
    filename: str = option("merak_trace", "Base name of the trace files in the output directory (`.json`, "
                           "`.perfetto.json`).")
    untraced_steps: int = option(
        8, "Steps timed without tracing first, which a `planner_calibration` from the trace anchors on.")

    def __post_init__(self) -> None:
        if self.steps < 1 or self.skip_steps < 0 or self.untraced_steps < 0:
            raise ValueError(f"profiler.steps must be >= 1, profiler.skip_steps and profiler.untraced_steps >= 0, got "
                             f"steps={self.steps}, skip_steps={self.skip_steps}, untraced_steps={self.untraced_steps}")

    def build(self, output_dir: Path) -> Any:
        from lightning_merak.callbacks.profiler import MerakTraceProfiler  # lazy: torch, Lightning

        return MerakTraceProfiler(dirpath=output_dir, filename=self.filename, skip_steps=self.skip_steps,
                                  steps=self.steps, block_spans=self.block_spans, untraced_steps=self.untraced_steps)


def register() -> None:
    register_option("profiler", "none", NoProfilerConfig)
    register_option("profiler", "trace", TraceProfilerConfig)
