"""Metrics every run should show (throughput, step time, MFU, gradient norm, memory) and figures for its loggers.

:class:`TrainingMetrics` logs the numbers on any strategy; :func:`log_figure` hands a figure to every logger
of a run, whatever its kind, and is how the MoE, DeltaMemory and profiler pictures reach the loggers too.
"""

from lightning_merak.callbacks.metrics.callback import MEMORY_FIGURE, TrainingMetrics
from lightning_merak.callbacks.metrics.device import MemoryReading, PeakFlops, peak_flops, read_memory
from lightning_merak.callbacks.metrics.figures import log_figure, memory_figure

__all__ = ["MEMORY_FIGURE", "MemoryReading", "PeakFlops", "TrainingMetrics", "log_figure", "memory_figure",
           "peak_flops", "read_memory"]
