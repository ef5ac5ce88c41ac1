"""Replay of a traced run's data-flow graph and its what-ifs (a pure core, no process group): load a trace written
by ``profiler=trace`` (:class:`Trace`), replay it as traced or changed (:func:`replay_trace` with a
:class:`WhatIf`), or anchored to a measured step (:func:`anchored`)."""

from lightning_merak.planning.replay.engine import (
    ReplayResult,
    WhatIf,
    anchored,
    link_payload_bytes_per_s,
    replay_trace,
)
from lightning_merak.planning.replay.trace import Trace

__all__ = ["ReplayResult", "Trace", "WhatIf", "anchored", "link_payload_bytes_per_s", "replay_trace"]
