"""Memory timeline plot: measured resident saved bytes per step, and the plan's simulation.

Uses ``matplotlib.figure.Figure`` directly, never pyplot, so the user's backend is untouched. Given the
trainer, the figure also goes to its loggers (:func:`~lightning_merak.callbacks.metrics.log_figure`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

import lightning.pytorch as pl
from matplotlib.figure import Figure

from lightning_merak.callbacks.delta.ledger import TimelinePoint
from lightning_merak.callbacks.delta.memory_planner import Action, Plan, StepProfile, simulate_timeline
from lightning_merak.callbacks.metrics.figures import log_figure

__all__ = ["FIGURE_NAME", "save_timeline_plot", "timeline_figure"]

FIGURE_NAME = "delta/memory_timeline"

_COLOURS = {Action.KEEP: "tab:gray", Action.SWAP: "tab:blue", Action.RECOMPUTE: "tab:orange"}
_MIB = 2**20


def save_timeline_plot(
    path: str,
    timelines: Mapping[str, Sequence[TimelinePoint]],
    budget_bytes: Optional[int],
    plan: Optional[Plan],
    profile: Optional[StepProfile],
    trainer: Optional[pl.Trainer] = None,
) -> str:
    """Write :func:`timeline_figure` as a PNG and return its path; with ``trainer``, log it to the trainer's
    loggers too, as ``delta/memory_timeline`` at the trainer's step."""
    figure = timeline_figure(timelines, budget_bytes, plan, profile)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)
    if trainer is not None:
        log_figure(trainer, FIGURE_NAME, figure, trainer.global_step, already_saved=Path(path))
    return path


def timeline_figure(
    timelines: Mapping[str, Sequence[TimelinePoint]],
    budget_bytes: Optional[int],
    plan: Optional[Plan],
    profile: Optional[StepProfile],
) -> Figure:
    """Two panels. Top: resident saved bytes over one step as measured by the ledger, for the last
    warm-up (unmanaged) step and the last managed step. Bottom: the planner's simulated
    timeline per forward/backward event, unmanaged vs planned, ticks coloured by action.
    """
    figure = Figure(figsize=(11, 8))
    measured, simulated = figure.subplots(2, 1)
    for label, points in timelines.items():
        if points:
            measured.step(
                [p.t_s * 1e3 for p in points], [p.resident_bytes / _MIB for p in points], where="post", label=label
            )
    if budget_bytes is not None:
        measured.axhline(budget_bytes / _MIB, color="red", linestyle="--", label="budget")
        simulated.axhline(budget_bytes / _MIB, color="red", linestyle="--", label="budget")
    measured.set_xlabel("time in step (ms)")
    measured.set_ylabel("resident saved activations (MiB)")
    measured.set_title("DeltaMemory: measured (callback accounting)")
    measured.legend(loc="upper right")

    if plan is not None and profile is not None:
        keep_all = {b.name: Action.KEEP for b in profile.blocks}
        for label, actions in (("unmanaged", keep_all), ("planned", plan.actions)):
            points = simulate_timeline(profile, actions)
            simulated.step(range(len(points)), [b / _MIB for _, b in points], where="post", label=label)
        events = [label for label, _ in simulate_timeline(profile, plan.actions)]
        simulated.set_xticks(range(len(events)))
        simulated.set_xticklabels(events, rotation=90, fontsize=6)
        for tick, label in zip(simulated.get_xticklabels(), events):
            name = label.split(" ")[1] if " " in label else ""
            if name in plan.actions:
                tick.set_color(_COLOURS[plan.actions[name]])
        simulated.set_title("planner simulation (tick colour: grey keep, blue swap, orange recompute)")
        simulated.set_ylabel("MiB")
        simulated.legend(loc="upper right")
    figure.tight_layout()
    return figure
