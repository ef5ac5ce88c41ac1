"""Gantt chart of a simulated schedule, one row per stage, to see bubbles and the critical path."""

from __future__ import annotations

from os import PathLike
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from lightning_merak.parallel.pipeline.simulate import SimulationResult

OP_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "R": "#8c8c8c"}
OP_LABELS = {"F": "forward", "B": "backward", "R": "recompute"}
_CRITICAL_EDGE = "#c44e52"


def plot_timeline(result: SimulationResult, path: str | PathLike[str], title: str | None = None) -> Path:
    """Draw ``result`` as a per-stage Gantt chart (micro-batch numbers on the bars) and save it as a PNG.

    Ops on the critical path get a red outline. Uses an Agg canvas directly, so pyplot's
    global backend and figure state are left alone.
    """
    num_stages = max(op.stage for op in result.ops) + 1
    critical = set(result.critical_path)
    figure = Figure(figsize=(max(6.0, 0.25 * len(result.ops) / num_stages + 4.0), 0.6 * num_stages + 1.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for op in result.ops:
        row = num_stages - 1 - op.stage
        on_path = op in critical
        axes.broken_barh(
            [(op.start_s, op.duration_s)],
            (row - 0.4, 0.8),
            facecolors=OP_COLOURS[op.kind],
            edgecolors=_CRITICAL_EDGE if on_path else "white",
            linewidth=1.5 if on_path else 0.5,
        )
        centre_s = op.start_s + op.duration_s / 2
        axes.text(centre_s, row, str(op.microbatch), ha="center", va="center", fontsize=7, color="white")
    axes.set_yticks(range(num_stages), [f"stage {stage}" for stage in reversed(range(num_stages))])
    axes.set_xlim(0, result.iteration_s or 1.0)
    axes.set_xlabel("time (s)")
    kinds = [kind for kind in OP_COLOURS if any(op.kind == kind for op in result.ops)]
    handles = [Patch(color=OP_COLOURS[kind], label=OP_LABELS[kind]) for kind in kinds]
    axes.legend(handles=handles, loc="upper right", fontsize=8)
    heading = title or "pipeline schedule"
    axes.set_title(f"{heading}: {result.iteration_s:.4g} s, bubble {result.bubble_fraction:.1%}")
    figure.tight_layout()
    output = Path(path)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, format="png", dpi=120)
    return output
