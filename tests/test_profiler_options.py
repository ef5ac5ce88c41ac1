"""The ``profiler`` Hydra options build the profiler merak-train hands to the Trainer, and refuse bad values."""

from __future__ import annotations

import pytest

from lightning_merak.callbacks.profiler import MerakTraceProfiler
from lightning_merak.cli.options.profiler import NoProfilerConfig, TraceProfilerConfig


def test_trace_option_builds_the_profiler(tmp_path) -> None:
    profiler = TraceProfilerConfig(steps=2, skip_steps=1, untraced_steps=8).build(tmp_path)
    assert isinstance(profiler, MerakTraceProfiler)
    assert (profiler.steps, profiler.skip_steps, profiler.untraced_steps, profiler.dirpath) == (2, 1, 8, tmp_path)
    assert NoProfilerConfig().build(tmp_path) is None


def test_trace_option_refuses_no_steps() -> None:
    with pytest.raises(ValueError, match="profiler.steps"):
        TraceProfilerConfig(steps=0)
    with pytest.raises(ValueError, match="untraced_steps=-1"):
        TraceProfilerConfig(untraced_steps=-1)
