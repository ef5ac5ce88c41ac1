"""The timeline of one traced step, one row per rank: what each rank computed when, and how much it sat idle.

With pipeline stages the bars are the schedule's chunks (``stage <s> forward|backward mb<m>``), so the gaps
are the pipeline's bubble; without stages they are Lightning's phases (training step, backward, optimizer
step). A rank's waits for communication (a receive of the previous stage's activations, a gradient
all-reduce) fall inside those bars and are drawn over them in grey. The idle share is measured, from the
trace: one minus the ranks' busy time (bars less the waits inside them) over ranks × the step's wall time
(first start to last end, on rank 0's clock).
"""

from __future__ import annotations

import re
from typing import Optional

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from lightning_merak.planning.replay.trace import Span, Trace

__all__ = ["FIGURE_NAME", "idle_fraction", "step_bars", "step_waits", "traced_step_figure"]

FIGURE_NAME = "profiler/step_timeline"
_CHUNK = re.compile(r"^stage (\d+) (forward|backward|backward_weight) mb(\d+)$")
_PHASES = ("training_step", "backward", "optimizer_step")
_COLOURS = {"FW": "#4c72b0", "BW": "#dd8452", "UPDATE": "#55a868"}
_LABELS = {"FW": "forward", "BW": "backward", "UPDATE": "optimizer step"}
_WAIT_COLOUR = "#b0b0b0"


def step_bars(trace: Trace, step: int) -> list[list[Span]]:
    """Each rank's bars of ``step`` on rank 0's clock: its pipeline chunks, or its phases where it ran none."""
    bars = []
    for rank in trace.aligned().ranks:
        spans = [s for s in rank.spans if s.step == step and s.thread == "main"]
        chunks = [s for s in spans if _CHUNK.match(s.name)]
        bars.append(sorted(chunks or [s for s in spans if s.name in _PHASES], key=lambda s: s.start))
    return bars


def step_waits(trace: Trace, step: int) -> list[list[tuple[float, float]]]:
    """Each rank's waits for communication in ``step`` (start, end) on rank 0's clock, on its main thread."""
    return [sorted((c.wait_start, c.wait_end) for c in rank.comms
                   if c.step == step and c.wait_start is not None and c.wait_end is not None and c.stream == "main")
            for rank in trace.aligned().ranks]


def _overlap(span: Span, waits: list[tuple[float, float]]) -> float:
    """Seconds of ``span`` spent in ``waits`` (which do not overlap each other: one main thread waits at a time)."""
    return sum(max(0.0, min(end, span.end) - max(start, span.start)) for start, end in waits)


def idle_fraction(bars: list[list[Span]], waits: list[list[tuple[float, float]]]) -> float:
    """One minus every rank's busy time (its bars less the waits inside them) over ranks × the step's wall time
    (0 for an empty step)."""
    spans = [s for row in bars for s in row]
    if not spans:
        return 0.0
    wall = max(s.end for s in spans) - min(s.start for s in spans)
    busy = sum(s.end - s.start - _overlap(s, rank_waits) for row, rank_waits in zip(bars, waits) for s in row)
    return 1.0 - busy / (len(bars) * wall) if wall > 0 else 0.0


def traced_step_figure(trace: Trace, step: Optional[int] = None) -> Figure:
    """A Gantt chart of ``step`` (default: the last step every rank traced), micro-batch numbers on the chunks."""
    steps = trace.steps()
    if not steps:
        raise ValueError("the trace holds no step every rank recorded; trace at least one step (steps >= 1)")
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise ValueError(f"step {chosen} is not in the trace; its steps are {steps}")
    bars, waits = step_bars(trace, chosen), step_waits(trace, chosen)
    origin = min((s.start for row in bars for s in row), default=0.0)
    figure = Figure(figsize=(10, 0.6 * len(bars) + 1.8))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for rank, row in enumerate(bars):
        y = len(bars) - 1 - rank
        for span in row:
            start_ms, length_ms = 1e3 * (span.start - origin), 1e3 * (span.end - span.start)
            axes.broken_barh([(start_ms, length_ms)], (y - 0.4, 0.8), facecolors=_COLOURS.get(span.category, "grey"),
                             edgecolors="white", linewidth=0.5)
            chunk = _CHUNK.match(span.name)
            if chunk:
                axes.text(start_ms + length_ms / 2, y, chunk.group(3), ha="center", va="center", fontsize=7,
                          color="white")
        inside = [(start, end) for start, end in waits[rank] if any(s.start <= start < s.end for s in row)]
        axes.broken_barh([(1e3 * (start - origin), 1e3 * (end - start)) for start, end in inside], (y - 0.25, 0.5),
                         facecolors=_WAIT_COLOUR)
    axes.set_yticks(range(len(bars)), [f"rank {rank}" for rank in reversed(range(len(bars)))])
    axes.set_xlabel("time in step (ms)")
    kinds = [kind for kind in _COLOURS if any(s.category == kind for row in bars for s in row)]
    handles = [Patch(color=_COLOURS[kind], label=_LABELS[kind]) for kind in kinds]
    if any(waits):
        handles.append(Patch(color=_WAIT_COLOUR, label="waiting for communication"))
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    idle = "bubble and waits" if any(_CHUNK.match(s.name) for row in bars for s in row) else "idle and waits"
    axes.set_title(f"traced step {chosen}: {idle} {idle_fraction(bars, waits):.1%} of the ranks' time (measured)")
    figure.tight_layout()
    return figure
