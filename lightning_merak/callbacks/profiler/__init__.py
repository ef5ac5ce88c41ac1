"""Trace distributed steps on every rank and replay them (dPRO): profiler, Perfetto traces, what-if replay.

:class:`MerakTraceProfiler` records a few steps (``Trainer(profiler=...)``); :mod:`.trace` holds the
records, :mod:`.replay` the pure replay core, :mod:`.chrome` the Perfetto export; :mod:`.call_curve` and
:mod:`.probe` the call times by micro-batch size that the micro-batch what-if scales traced calls with;
:mod:`.synthesize` re-derives other layouts from a trace's costs, :mod:`.refine` refines those costs with the probe's
calls, :mod:`.calibration` calibrates the layout planner from traces.
"""

from lightning_merak.callbacks.profiler.lightning_profiler import MerakTraceProfiler, estimate_clock_offsets
from lightning_merak.planning.replay.chrome import chrome_trace, replayed_chrome_trace, write_chrome_trace
from lightning_merak.planning.replay.engine import (
           ReplayResult,
           WhatIf,
           anchored,
           graph_from_trace,
           replay,
           replay_trace,
)
from lightning_merak.planning.replay.summary import summarize, summary_numbers
from lightning_merak.planning.replay.trace import CommRecord, RankTrace, Span, Trace

__all__ = ["CommRecord", "MerakTraceProfiler", "RankTrace", "ReplayResult", "Span", "Trace", "WhatIf", "anchored",
           "chrome_trace", "estimate_clock_offsets", "graph_from_trace", "replay", "replay_trace",
           "replayed_chrome_trace", "summarize", "summary_numbers", "write_chrome_trace"]
