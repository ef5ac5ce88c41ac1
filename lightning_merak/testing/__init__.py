"""Test bed shared by the test suite and the benchmarks: real multi-process runs and
step-by-step comparison with a single-process reference.

Imported on demand, not from here: :mod:`lightning_merak.testing.data` (each rank's share of fixed global
batches), :mod:`lightning_merak.testing.causal_lm` (the built-in causal LM with a fixed optimizer, SGD or Adam),
:mod:`lightning_merak.testing.netem` (ranks on an emulated
cluster network; needs root) and :mod:`lightning_merak.testing.delta_models` (small models and
Lightning wrappers for the DeltaMemory tests and benchmark)."""

from lightning_merak.testing.compare import (
    LayoutTraceRecorder,
    NormBeforeClipping,
    TraceRecorder,
    TrainingTrace,
    assert_traces_match,
    layout_gradients,
    merge_rank_traces,
    module_losses,
    record_reference_trace,
    snapshot_gradients,
)
from lightning_merak.testing.distributed import DistributedRunError, find_free_port, run_distributed

__all__ = [
    "DistributedRunError",
    "LayoutTraceRecorder",
    "NormBeforeClipping",
    "TraceRecorder",
    "TrainingTrace",
    "assert_traces_match",
    "find_free_port",
    "layout_gradients",
    "merge_rank_traces",
    "module_losses",
    "record_reference_trace",
    "run_distributed",
    "snapshot_gradients",
]
