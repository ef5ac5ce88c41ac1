"""The layout planner calibrated from traced runs: constants from a trace, and a replay predictor (pure).

:func:`link_costs` reads each group kind's link from a trace (fixed time per op, effective bytes/s);
:func:`calibrate_from_traces` turns one short traced run (any layout, usually data-parallel) into the
planner's constants (:class:`~lightning_merak.planning.replay.synthesize.StepCosts`: compute per block and
sample, the rest of the forward, backward ratio, optimizer time per parameter, the loop's time per
step, and the links), plus *probes*: traces of short runs of what the main trace lacks on a model cut to
a few blocks (a tensor-parallel layout at each sub-batch overlap; a pipeline), whose costs replace the
main trace's for layouts of that kind (:meth:`TraceCalibration.costs_for`). :class:`ReplayPredictor`
replays any layout's step with them (:func:`~lightning_merak.planning.replay.synthesize.predict_layout`), a pipeline
at the
split merak3d's partitioner will pick for it (:mod:`~lightning_merak.planning.replay.stage_split`); the
planner ranks its candidates by it (:func:`~lightning_merak.planning.planner.rerank`).
:func:`block_call_cost` separates a block call's fixed time from its per-sample time with two traces whose
calls hold different numbers of samples (a data-parallel step and a pipeline's micro-batches).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from lightning_merak.planning.replay.engine import (
    SMALL_OP_BYTES,
    comm_ops,
    estimate_fixed_cost,
    measured_step_time,
    transfer_seconds,
)
from lightning_merak.planning.replay.refine import with_block_call_cost
from lightning_merak.planning.replay.stage_split import with_autopipe_split
from lightning_merak.planning.replay.synthesize import (
    LayoutSpec,
    ModelShape,
    StepCosts,
    calibrate,
    group_kind,
    predict_layout,
)
from lightning_merak.planning.replay.trace import Trace

__all__ = ["LARGE_OP_BYTES", "MIN_UNTRACED_STEPS", "Probe", "ReplayPredictor", "TraceCalibration", "block_call_cost",
           "block_call_seconds", "calibrate_from_traces", "layout_from_meta", "link_costs", "predictor_from_files",
           "probe_key", "rederivation_anchor", "traced_blocks", "untraced_step_time"]

LARGE_OP_BYTES = 32768.0
"""Ops with at least this many wire bytes set a link's rate (below, the fixed cost dominates)."""
MIN_UNTRACED_STEPS = 4
"""Untraced steps a trace needs for its calibration to anchor on their median (fewer: on the traced steps)."""


def link_costs(trace: Trace, layout: LayoutSpec) -> dict[str, tuple[float, float]]:
    """(fixed seconds per op, effective bytes/s) per group kind (:func:`group_kind`) that ``trace`` has large ops of.

    The fixed time is the median transfer of the kind's ops under ``SMALL_OP_BYTES`` (the whole trace's
    where the kind has none); the rate is the large ops' wire bytes over their transfer time beyond it.
    """
    ops = comm_ops(trace.aligned())
    overall = estimate_fixed_cost(ops)
    by_kind: dict[str, dict] = {}
    for key, op in ops.items():
        by_kind.setdefault(group_kind(key, layout), {})[key] = op
    result = {}
    for kind, kind_ops in by_kind.items():
        fixed = estimate_fixed_cost(kind_ops) if any(op.wire < SMALL_OP_BYTES for op in kind_ops.values()) else overall
        large = [op for op in kind_ops.values() if op.wire >= LARGE_OP_BYTES]
        seconds = transfer_seconds(large, fixed)
        if large and seconds > 0:
            result[kind] = (fixed, sum(op.wire for op in large) / seconds)
    return result


@dataclass(frozen=True)
class Probe:
    """A short traced run of a layout the main trace lacks (e.g. tensor-parallel), on a model of ``shape``;
    ``correction`` as :class:`TraceCalibration`'s, for this run."""

    trace: Trace
    shape: ModelShape
    layout: LayoutSpec
    correction: float = 1.0


@dataclass(frozen=True)
class TraceCalibration:
    """The planner's constants from traced runs: ``base`` from the main trace, ``probes`` per
    (pipelined, tp, overlap) (:func:`probe_key`).

    ``correction`` multiplies the predictions made with ``base``: the traced run's untraced step time over
    its traced one where measured outside the trace (1.0 where unknown, or where the trace holds untraced steps),
    times the run's step over its re-derivation from ``base`` (:func:`calibrate_from_traces`); each probe has its
    own, after its costs.
    """

    base: StepCosts
    shape: ModelShape
    traced: LayoutSpec
    probes: tuple[tuple[tuple[bool, int, int], StepCosts, float], ...] = ()
    correction: float = 1.0

    def costs_for(self, layout: LayoutSpec) -> tuple[StepCosts, float]:
        """The costs and correction ``layout`` is replayed with: the probe of its kind (pipelined, tp, overlap);
        else, with tp > 1, the unpipelined probe of its tp and overlap; else, pipelined, the pipeline probe at
        tp = 1; else the main trace's."""
        probes = {key: (costs, correction) for key, costs, correction in self.probes}
        pipelined = layout.pp > 1
        for key in ((pipelined, layout.tp, layout.overlap), (False, layout.tp, layout.overlap) if layout.tp > 1
                    else None, (True, 1, 1) if pipelined else None):
            if key in probes:
                return probes[key]
        return self.base, self.correction

    def describe(self) -> dict[str, Any]:
        """The constants, for logs and benchmark reports."""
        return {"base": dataclasses.asdict(self.base), "correction": self.correction,
                "probes": {f"{'pp ' if pipelined else ''}tp{tp} k{k}": {**dataclasses.asdict(c), "correction": f}
                           for (pipelined, tp, k), c, f in self.probes}}


def probe_key(layout: LayoutSpec) -> tuple[bool, int, int]:
    """What a probe of ``layout`` stands for: (pipelined, tensor-parallel degree, overlap)."""
    return layout.pp > 1, layout.tp, layout.overlap


def _with_links(costs: StepCosts, trace: Trace, layout: LayoutSpec,
                fallback: Sequence[tuple[str, float, float]] = ()) -> StepCosts:
    links = {kind: (fixed, rate) for kind, fixed, rate in fallback}
    links.update(link_costs(trace, layout))
    return dataclasses.replace(costs, links=tuple((kind, *links[kind]) for kind in sorted(links)))


def calibrate_from_traces(trace: Trace, shape: ModelShape, layout: LayoutSpec, probes: Sequence[Probe] = (),
                          correction: float = 1.0) -> TraceCalibration:
    """The planner's constants from ``trace`` (a run of ``layout`` on a model of ``shape``) and ``probes``.

    A probe of a tensor-parallel layout keeps the collectives' exposed time inside its blocks' and head's
    times (its sub-batch overlap and vocabulary-parallel head are measured, not modelled); its other links
    default to the main trace's. A pipeline probe at tp=1 whose block calls hold another number of samples than the
    main trace's gets a block call's fixed time from the line through both (:func:`block_call_cost`): more
    micro-batches make more, smaller calls, and a call's fixed part does not shrink with its samples.

    Every cost set is anchored on its own trace: its corrections also hold the traced run's step (its untraced
    steps' median where the trace has them, :func:`untraced_step_time`) over the step its costs re-derive for the
    traced layout, so each traced layout predicts its own run's step and other layouts move by the re-derived change
    only (what the re-derivation misses on the traced layout cancels, as in
    :func:`~lightning_merak.planning.replay.synthesize.predict_from_traced`).
    Raises before calibrating when two probes stand for the same :func:`probe_key`.
    """
    keys = [probe_key(p.layout) for p in probes]
    if len(set(keys)) != len(keys):
        raise ValueError(f"two probes trace the same (pipelined, tensor_parallel, overlap): {keys}; keep one of each")
    if min([correction] + [p.correction for p in probes]) <= 0:
        raise ValueError("corrections must be positive (untraced over traced step time)")
    doubled = [name for name, t, c in [("the main trace", trace, correction)]
               + [(f"probe {probe_key(p.layout)}", p.trace, p.correction) for p in probes]
               if c != 1.0 and untraced_step_time(t) is not None]
    if doubled:
        raise ValueError(f"{', '.join(doubled)} already anchor on their own untraced steps; leave their corrections "
                         "at 1.0")
    base = _with_links(calibrate(trace, shape, layout), trace, layout)
    calibrated = {}
    for probe in probes:
        costs = calibrate(probe.trace, probe.shape, probe.layout, tp_comm_in_compute=True)
        if _calls_differ(trace, layout, probe):
            costs = with_block_call_cost(costs, probe.layout, block_call_cost(trace, layout, probe.trace,
                                                                              probe.layout))
        calibrated[probe_key(probe.layout)] = _with_links(costs, probe.trace, probe.layout, base.links)
    probed = [(probe_key(p.layout), calibrated[probe_key(p.layout)],
               p.correction * rederivation_anchor(calibrated[probe_key(p.layout)], p.trace, p.shape, p.layout))
              for p in probes]
    return TraceCalibration(base, shape, layout, tuple(probed),
                            correction * rederivation_anchor(base, trace, shape, layout))


def untraced_step_time(trace: Trace) -> Optional[float]:
    """The median of the traced run's untraced steps after its window (``MerakTraceProfiler(untraced_steps=...)``;
    each step's slowest rank), or None where the trace holds fewer than :data:`MIN_UNTRACED_STEPS`.

    What a user predicts is a run's untraced steady steps. A few traced steps are a poor stand-in: they come early,
    sit in one spell of a shared machine and carry the profiler's cost (a three-step window read 0.88-1.37 of its
    run's untraced median over 24 runs, median 1.08); the median over more steps, later in the run, moves less.
    """
    steps = trace.meta.get("untraced_step_s") or []
    if any(not isinstance(s, (int, float)) or s <= 0 for s in steps):
        raise ValueError(f"the trace's untraced_step_s must hold positive seconds, got {steps!r}")
    return statistics.median(steps) if len(steps) >= MIN_UNTRACED_STEPS else None


def rederivation_anchor(costs: StepCosts, trace: Trace, shape: ModelShape, layout: LayoutSpec) -> float:
    """``trace``'s run's step (:func:`untraced_step_time`, else its traced steps) over the step ``costs``
    (calibrated on it) re-derive for its own ``layout``."""
    rederived = predict_layout(costs, shape, layout).step_time
    if rederived <= 0:
        raise ValueError("the calibrated costs re-derive an empty step; trace a run whose steps hold compute spans")
    untraced = untraced_step_time(trace)
    return (untraced if untraced is not None else measured_step_time(trace)) / rederived


def _calls_differ(trace: Trace, layout: LayoutSpec, probe: Probe) -> bool:
    """Whether ``probe`` is a pipeline at tp=1 whose block calls hold other numbers of samples than ``trace``'s
    (also at tp=1), both with block spans: two points of a block call's line."""
    if probe.layout.pp < 2 or probe.layout.tp != 1 or layout.tp != 1:
        return False
    if not traced_blocks(trace) or not traced_blocks(probe.trace):
        return False
    return layout.samples / layout.micro_batches != probe.layout.samples / probe.layout.micro_batches


class ReplayPredictor:
    """Predicts a layout's step time by replaying it with a :class:`TraceCalibration`'s constants.

    With ``partition="autopipe"`` (merak3d's default) a pipelined layout is replayed at the split autopipe will
    pick for it (:func:`~lightning_merak.planning.replay.stage_split.autopipe_stage_blocks` on the costs it is replayed
    with), not at a traced pipeline's: the run partitions at its start for its own micro-batches, and a traced
    split holds only for the traced count. Other partition methods keep the traced split. Each cost set's anchor
    stays at its trace's own split (the one its run used).
    """

    def __init__(self, calibration: TraceCalibration, partition: str = "autopipe") -> None:
        self.calibration = calibration
        self.partition = partition

    def _costs(self, layout: LayoutSpec) -> tuple[StepCosts, float]:
        costs, correction = self.calibration.costs_for(layout)
        if self.partition == "autopipe":
            costs = with_autopipe_split(costs, self.calibration.shape, layout)
        return costs, correction

    def stage_blocks(self, layout: LayoutSpec) -> tuple[int, ...]:
        """The blocks per stage ``layout`` is replayed with (() unpipelined, or where a partition other than autopipe
        has no traced split of this many stages: the replay then splits evenly)."""
        return tuple(self._costs(layout)[0].stage_blocks) if layout.pp > 1 else ()

    def step_time(self, layout: LayoutSpec) -> float:
        """Seconds per step of ``layout`` on the calibration's model."""
        costs, correction = self._costs(layout)
        return predict_layout(costs, self.calibration.shape, layout).step_time * correction

    def planner_step_time(self, layout: Any, samples_per_replica: int) -> float:
        """:meth:`step_time` of a planner ``Layout`` (sharding is not modelled: priced as none)."""
        return self.step_time(LayoutSpec(layout.dp, layout.pp, layout.tp, layout.micro_batches, samples_per_replica,
                                         recompute=layout.recompute_ratio, overlap=layout.overlap))


def layout_from_meta(meta: dict[str, Any], samples: Optional[int] = None) -> LayoutSpec:
    """The traced layout a :class:`~lightning_merak.callbacks.profiler.MerakTraceProfiler` trace's meta records.

    Raises, naming the fix, when the trace does not say (it was not written under merak3d or DDP).
    """
    layout = meta.get("layout")
    if not isinstance(layout, dict):
        raise ValueError("the trace's meta records no layout; trace a run under Merak3DStrategy or DDP with "
                         "MerakTraceProfiler, which records it")
    context_parallel = int(layout.get("cp") or 1)
    if context_parallel > 1:
        raise ValueError(f"the trace was recorded at context_parallel={context_parallel}, which the replay calibration "
                         "does not model; trace a run of the same model without context parallelism")
    return LayoutSpec(int(layout["dp"]), int(layout["pp"]), int(layout["tp"]), int(layout.get("micro_batches") or 1),
                      int(samples or layout.get("samples") or 1), overlap=int(layout.get("overlap") or 1))


def block_call_seconds(trace: Trace) -> float:
    """The median time of one block's forward call in ``trace`` (medians: a preempted call moves them least)."""
    calls = [s.end - s.start for r in trace.ranks for s in r.spans
             if s.is_block()]
    if not calls:
        raise ValueError("the trace has no block spans; trace a run with MerakTraceProfiler, which times each block")
    return statistics.median(calls)


def block_call_cost(first: Trace, first_layout: LayoutSpec, second: Trace, second_layout: LayoutSpec) -> float:
    """The fixed seconds of a block forward call (its time at no samples), from two traces of the same model
    whose calls hold different numbers of samples: the line through their median calls, clamped to
    [0, the shorter call] (noise can tilt it either way).

    Raises, naming the fix, where both hold as many samples per call (nothing to tell the costs apart).
    """
    points = []
    for trace, layout in ((first, first_layout), (second, second_layout)):
        if layout.tp != 1:
            raise ValueError("block calls of a tensor-parallel trace hold its collectives' waits; pass traces at tp=1")
        points.append((layout.samples / layout.micro_batches, block_call_seconds(trace)))
    (n1, t1), (n2, t2) = points
    if n1 == n2:
        raise ValueError(f"both traces hold {n1:g} samples per block call; pass two with different micro-batch sizes "
                         "(e.g. a data-parallel trace and a pipeline trace with several micro-batches)")
    fixed = (n1 * t2 - n2 * t1) / (n1 - n2)
    return min(max(fixed, 0.0), t1, t2)


def traced_blocks(trace: Trace) -> int:
    """How many blocks the traced model has: the distinct blocks whose forward any rank recorded (0: none)."""
    return len(trace.block_names())


def predictor_from_files(paths: Sequence[Union[str, Path]], shape: ModelShape, samples: int,
                         partition: str = "autopipe") -> ReplayPredictor:
    """A predictor from trace files of this model (``shape``) at ``samples`` per replica and step: the first
    calibrates, the others are probes (their meta gives their layouts, their block spans how many blocks
    their models kept); ``partition`` is the run's pipeline partition method."""
    if not paths:
        raise ValueError("predictor_from_files needs at least one trace file")
    traces = [Trace.load(path) for path in paths]
    probes = [Probe(t, dataclasses.replace(shape, blocks=traced_blocks(t) or shape.blocks),
                    layout_from_meta(t.meta, samples)) for t in traces[1:]]
    main = traces[0]
    return ReplayPredictor(calibrate_from_traces(main, shape, layout_from_meta(main.meta, samples), probes), partition)
