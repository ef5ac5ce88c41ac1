"""What-if on layouts: re-derive every rank's work from a traced run and replay another layout (pure).

:func:`calibrate` reads, from a trace of any merak3d layout, what does not depend on the layout:
forward time per block and sample, the rest of the forward (head and loss) per sample, backward
as a multiple of forward, optimizer time per parameter, the loop's own time per step, and the
link (fixed cost per op, effective bandwidth). :func:`layout_graph` then builds the step of another
layout — data, pipeline and tensor parallel degrees, micro-batches, recomputation, any rank count
(beyond the traced machine: simulated) — as the same task graph the trace replay uses: 1F1B
order per stage (:func:`~lightning_merak.parallel.pipeline.simulate.stage_op_order`), activations
between stages, two all-reduces per block and pass under tensor parallelism, the gradient
all-reduce over data-parallel replicas. Each op is priced by the link of its group kind
(``StepCosts.links``: data-parallel, pipeline or tensor-parallel), the traced one where known.
A cost set calibrated from a probe trace of a tensor-parallel run (``tp_comm_in_compute``) already
holds the tensor-parallel collectives' exposed time in its block and head times: no op is added for them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Optional

from lightning_merak.parallel.pipeline.simulate import stage_op_order
from lightning_merak.planning.replay.block_timing import covering, merged_intervals, timed_block_backward
from lightning_merak.planning.replay.call_curve import CallCurve
from lightning_merak.planning.replay.engine import (
    CommOp,
    ReplayResult,
    TaskGraph,
    WhatIf,
    build_graph,
    comm_ops,
    estimate_bandwidth,
    estimate_fixed_cost,
    main_thread_waits,
    replay,
)
from lightning_merak.planning.replay.trace import Trace, comm_key, wire_bytes

__all__ = ["BLOCK_BACKWARD_RATIO", "LayoutSpec", "ModelShape", "StepCosts", "calibrate", "group_kind", "layout_graph",
           "predict_from_traced", "predict_layout"]


@dataclass(frozen=True)
class ModelShape:
    """What the layout changes: blocks and their parameters, the rest's parameters, activation size per sample."""

    blocks: int
    block_params: int
    other_params: int
    hidden: int
    seq: int
    bytes_per_element: int = 4


@dataclass(frozen=True)
class LayoutSpec:
    """A layout's degrees, micro-batches and the samples each data-parallel replica trains per step.

    ``recompute`` is the fraction of blocks whose forward is recomputed in backward (``True``: all);
    ``overlap`` the tensor-parallel sub-batches, which only selects a probe's costs (:class:`StepCosts`).
    """

    dp: int
    pp: int
    tp: int
    micro_batches: int
    samples: int
    recompute: float = 0.0
    overlap: int = 1

    @property
    def ranks(self) -> int:
        return self.dp * self.pp * self.tp


@dataclass(frozen=True)
class StepCosts:
    """Layout-free costs read from a trace (seconds).

    ``links`` holds (group kind, fixed s per op, bytes/s) per kind the trace had ops of
    (:func:`group_kind`); other kinds use ``op_fixed_s`` and ``link_bytes_per_s``.
    ``tp_comm_in_compute``: block and head times include the tensor-parallel collectives' exposed time.
    ``backward_ratio`` is a block's backward over its forward; ``rest_backward_ratio`` the head's and loss's
    (None: the same). ``stage_blocks``: the pipeline's blocks per stage (calibrated: the traced run's, which its
    anchor re-derives; :func:`~lightning_merak.planning.replay.stage_split.with_autopipe_split` sets the one another
    layout's
    run will use), kept for layouts with as many stages; others split the blocks evenly.

    Fixed costs per call, which smaller micro-batches do not shrink: ``block_call_s`` per block forward call
    beyond its samples' share (:func:`.refine.with_block_call_cost`: two traces at different samples per call tell them
    apart); in a pipeline, ``chunk_forward_s`` per micro-batch and stage beyond its blocks and head (the stage's
    own machinery, the embedding on the first stage), and ``chunk_host_s`` per stage, the loop's work after a forward
    chunk before the next chunk (launching its send; on the last stage the loss), ``chunk_host_after_backward_s``
    after a backward chunk (() : as after a forward one). Backward prices the chunk's forward at ``backward_ratio``.
    ``block_curve`` and ``head_curve`` (:func:`.refine.with_call_curves`), measured calls at several sizes, replace the
    fixed-plus-per-sample line of blocks and head for sizes other than ``curve_reference_samples``;
    ``prefix_curve``, the first stage's own work measured the same way, replaces the guess for a chunk's fixed work
    (:meth:`chunk_seconds`); ``loss_curve`` shapes the last stage's loss with the samples (:meth:`gap_seconds`).
    ``chunk_backward_s``: a pipeline trace's mean backward chunk per stage, its waits removed, which sets the blocks'
    and the head's backward level where a prefix curve is given (:func:`.refine.with_call_curves`).
    ``backward_ratio_source`` says where ``backward_ratio`` comes from: ``"pipeline"`` (a pipeline's first-stage
    chunks), ``"blocks"`` (the blocks' timed backward spans), ``"step"`` (the whole step's backward over forward: no
    block spans), ``"flops"`` (the FLOPs ratio: the trace's block backwards overlapped data-parallel reduction, or
    were not timed), ``"probe"`` (a single-process probe's calls, :func:`.refine.with_probed_backward`).
    """

    block_forward_per_sample: float
    rest_forward_per_sample: float
    backward_ratio: float
    update_per_param: float
    host_per_step: float
    op_fixed_s: float
    link_bytes_per_s: float
    links: tuple[tuple[str, float, float], ...] = ()
    tp_comm_in_compute: bool = False
    rest_backward_ratio: Optional[float] = None
    stage_blocks: tuple[int, ...] = ()
    block_call_s: float = 0.0
    chunk_forward_s: float = 0.0
    chunk_host_s: tuple[float, ...] = ()
    block_curve: Optional[CallCurve] = None
    head_curve: Optional[CallCurve] = None
    curve_reference_samples: float = 0.0
    prefix_curve: Optional[CallCurve] = None
    chunk_host_after_backward_s: tuple[float, ...] = ()
    loss_curve: Optional[CallCurve] = None
    chunk_backward_s: tuple[float, ...] = ()
    backward_ratio_source: str = "flops"

    def gap_seconds(self, stage: int, stages: int, after_forward: bool, samples: float) -> float:
        """The loop's work on ``stage`` (of ``stages``) after a chunk, before the next: traced per stage (their mean
        where the stage count differs). After a forward chunk the last stage sends nothing and computes the loss: its
        traced gap sets the level and the ``loss_curve`` the shape, as for blocks."""
        gaps = self.chunk_host_s if after_forward or not self.chunk_host_after_backward_s \
            else self.chunk_host_after_backward_s
        if not gaps:
            return 0.0
        seconds = gaps[stage] if len(gaps) == stages else statistics.mean(gaps)
        if after_forward and stage == stages - 1 and self.loss_curve is not None:
            reference = self.curve_reference_samples
            seconds *= self.loss_curve.forward_scale(samples, reference)
        return max(seconds, 0.0)

    def chunk_seconds(self, stage: int, samples: float, forward: bool, recompute: float = 0.0) -> float:
        """A pipeline chunk's work on ``stage`` beyond its blocks and head, on ``samples`` samples.

        Without a ``prefix_curve``: ``chunk_forward_s`` on every stage, its backward at the blocks' ratio (plus
        ``recompute``). With one: the first stage's traced forward moves with the prefix's measured forward, its
        backward is the prefix's measured backward (the embedding's gradient; nothing recomputes it); later stages
        keep the traced forward less the prefix's (the stage's own machinery), fixed, and no backward.
        """
        if self.prefix_curve is None:
            return self.chunk_forward_s * (1.0 if forward else self.backward_ratio + recompute)
        reference = self.curve_reference_samples
        if stage > 0:
            return max(self.chunk_forward_s - self.prefix_curve.forward(reference), 0.0) if forward else 0.0
        if forward:
            return max(self.chunk_forward_s + self.prefix_curve.forward(samples)
                       - self.prefix_curve.forward(reference), 0.0)
        return self.prefix_curve.backward(samples)

    def block_seconds(self, samples: float, forward: bool, recompute: float = 0.0) -> float:
        """One block call's forward (or backward, with ``recompute`` of its forward) on ``samples`` samples.

        With a ``block_curve`` (:func:`.refine.with_call_curves`) the call at the calibrated size keeps its traced time
        and other sizes follow the curve's shape; without, a fixed part plus a time per sample.
        """
        if self.block_curve is None:
            return self.traced_block_call(samples) * (1.0 if forward else self.backward_ratio + recompute)
        reference = self.curve_reference_samples
        traced = self.traced_block_call(reference)
        call = traced * self.block_curve.forward_scale(samples, reference)
        if forward:
            return call
        return traced * self.backward_ratio * self.block_curve.backward_scale(samples, reference) + recompute * call

    def traced_block_call(self, samples: float) -> float:
        """A block's forward call on ``samples`` samples as calibrated (fixed part plus per sample), before any
        curve reshapes it."""
        return self.block_call_s + self.block_forward_per_sample * samples

    def rest_seconds(self, samples: float, forward: bool) -> float:
        """The head's and loss's forward (or backward) on ``samples`` samples; with a ``head_curve``, shaped as
        :meth:`block_seconds`."""
        ratio = 1.0 if forward else (self.backward_ratio if self.rest_backward_ratio is None
                                     else self.rest_backward_ratio)
        if self.head_curve is None:
            return self.rest_forward_per_sample * samples * ratio
        reference = self.curve_reference_samples
        scale = (self.head_curve.forward_scale(samples, reference) if forward
                 else self.head_curve.backward_scale(samples, reference))
        return self.rest_forward_per_sample * reference * ratio * scale

    def link(self, kind: str) -> tuple[float, float]:
        """(fixed seconds per op, bytes/s) for ops of ``kind``."""
        for name, fixed, rate in self.links:
            if name == kind:
                return fixed, rate
        return self.op_fixed_s, self.link_bytes_per_s


def group_kind(key: tuple, layout: LayoutSpec) -> str:
    """"dp", "pp" or "tp" for an op's key (:func:`~lightning_merak.planning.replay.trace.comm_key`) in a run of
    ``layout``
    (ranks ordered data-parallel outermost, then stage, then tensor-parallel rank); "world" for groups that
    span several dimensions. Point-to-point ops are the pipeline's."""
    if key[0] != "collective":
        return "pp"
    coords = [(r // (layout.pp * layout.tp), (r // layout.tp) % layout.pp, r % layout.tp) for r in key[1]]
    varying = [name for index, name in enumerate(("dp", "pp", "tp")) if len({c[index] for c in coords}) > 1]
    return varying[0] if len(varying) == 1 else "world"


BLOCK_BACKWARD_RATIO = 2.0
"""A block's backward over its forward: input and weight gradients, each a forward's matmuls (FLOPs)."""


def _rank_breakdown(trace: Trace, kept: Optional[LayoutSpec] = None) -> list[dict[str, float]]:
    """Per rank and step: FW, BW, UPDATE compute (their waits removed), block forward (recomputations', inside a
    backward, left out), host, and step time.

    With ``kept``, waits only for that layout's tensor-parallel collectives stay in the compute. "block BW" and
    "block FW timed" are the blocks' backward spans and the forwards of the calls they time. Pipeline ranks add
    the gaps between chunks per step after forward and after backward chunks ("gaps FW", "gaps BW"), the
    median busy time of each kind ("gap FW", "gap BW": the last stage's loss follows a forward chunk) and the median
    forward chunk's time beyond its blocks ("chunk extra"): medians, as a preempted chunk moves them least.
    """
    aligned = trace.aligned()
    steps = max(len(aligned.steps()), 1)
    result = []
    for rank in aligned.ranks:
        records = [(comm_key(rank.rank, c), c) for c in rank.comms]
        waits = [(w[0], w[1]) for w in main_thread_waits(rank.spans, records, True)
                 if not (kept and w[2] and all(group_kind(k, kept) == "tp" for k in w[2]))]

        turn_waits: dict[str, list[tuple[float, float]]] = {}
        for span in rank.spans:
            if span.category == "WAIT":
                turn_waits.setdefault(span.thread, []).append((span.start, span.end))

        def busy(start: float, end: float, thread: str = "main") -> float:
            """The seconds of (start, end) that ``thread`` computed: less the rank's communication waits and, on a
            sub-batch's thread, its waits for its turn (another sub-batch computed then)."""
            inside = [(max(start, a), min(end, b)) for a, b in waits + turn_waits.get(thread, [])
                      if a < end and b > start]
            return end - start - sum(b - a for a, b in merged_intervals(inside))

        totals = {"FW": 0.0, "BW": 0.0, "UPDATE": 0.0, "block": 0.0, "step": 0.0, "waits": 0.0, "gaps FW": 0.0,
                  "gaps BW": 0.0, "FW chunks": 0.0}
        top = {c: min((s.depth for s in rank.spans if s.category == c), default=0) for c in ("FW", "BW", "UPDATE")}
        # Under a pipeline schedule Lightning's training step holds every chunk, forward and backward: the
        # chunks are the compute, the rest of the step (the schedule's own work) counts as the loop's.
        chunked = any(s.name.startswith("stage ") for s in rank.spans)
        in_backward = covering(s for s in rank.spans if s.category == "BW")
        totals["block BW"], totals["block FW timed"] = timed_block_backward(rank.spans, busy, in_backward)
        blocks = [s for s in rank.spans if s.is_block() and not in_backward(s.start, s.end)]  # recomputations: BW's
        totals["block"] = sum(busy(b.start, b.end, b.thread) for b in blocks)
        for span in rank.spans:
            seconds = busy(span.start, span.end)
            if chunked and span.name.startswith("stage "):
                totals[span.category] += seconds
            elif span.category in top and span.depth == top[span.category]:
                if span.category == "UPDATE" or not chunked:
                    totals[span.category] += seconds
            elif span.category == "step":
                totals["step"] += span.end - span.start
                totals["waits"] += span.end - span.start - seconds
        gaps: dict[str, list[float]] = {"FW": [], "BW": []}
        extras = []
        if chunked:
            for step in aligned.steps():
                chunks = sorted((s for s in rank.spans if s.step == step and s.name.startswith("stage ")),
                                key=lambda s: s.start)
                for before, after in zip(chunks, chunks[1:]):
                    gaps[before.category].append(busy(before.end, after.start))
                extras += [busy(c.start, c.end) - sum(busy(b.start, b.end, b.thread) for b in blocks
                                                      if c.start <= b.start and b.end <= c.end)
                           for c in chunks if c.category == "FW"]
            totals["gaps FW"], totals["gaps BW"], totals["FW chunks"] = len(gaps["FW"]), len(gaps["BW"]), len(extras)
        totals["host"] = totals["step"] - totals["waits"] - totals["FW"] - totals["BW"] - totals["UPDATE"]
        result.append({key: value / steps for key, value in totals.items()}
                      | {f"gap {kind}": statistics.median(gaps[kind]) if gaps[kind] else 0.0 for kind in gaps}
                      | {"chunk extra": statistics.median(extras) if extras else 0.0})
    return result


def calibrate(trace: Trace, shape: ModelShape, layout: LayoutSpec, tp_comm_in_compute: bool = False) -> StepCosts:
    """The layout-free costs of ``trace``, a run of ``layout`` on a model of ``shape``.

    Ranks are ordered data-parallel outermost, then pipeline stage, then tensor-parallel rank.
    ``tp_comm_in_compute`` (a probe of a tensor-parallel layout) keeps the time spent waiting for
    tensor-parallel collectives in the blocks' and the head's times.

    In a pipeline trace a chunk's forward beyond its blocks on the stages before the last (no head there) is
    taken as fixed per chunk (``chunk_forward_s``, also charged to the last stage's chunks before its head),
    and the loop's work between chunks as fixed per gap (``chunk_host_s``): the per-sample costs are what is left.
    """
    per_rank = _rank_breakdown(trace, layout if tp_comm_in_compute and layout.tp > 1 else None)
    # The partitioner balances stages (a heavy head shares its stage with fewer blocks): each rank's blocks are
    # the ones it recorded; a trace without block spans is taken as evenly split.
    counted = [len(rank.block_names()) for rank in trace.ranks]
    timed = any(counted)
    stages = [(rank // layout.tp) % layout.pp for rank in range(len(per_rank))]
    per_rank = _slowest_of_each_stage(per_rank, stages)
    chunk_fw = [t["chunk extra"] for t, stage in zip(per_rank, stages) if stage < layout.pp - 1 and t["FW chunks"]]
    chunk_forward = max(statistics.mean(chunk_fw), 0.0) if chunk_fw else 0.0
    # A pipeline's first stage holds blocks and the embedding but no head: its chunks' backward over forward is the
    # blocks' measured ratio (at its micro-batches' size, below the FLOPs ratio). Other traces take their blocks'
    # timed backwards (a tensor-parallel probe's block forward holds collective waits that its backward does not
    # double) unless data-parallel gradient reduction overlaps them (a dp2 block's backward read 2.0-2.3x its
    # forward on CPU against 1.7-1.9x without the overlap: work that layouts without data parallelism do not do),
    # else the FLOPs ratio.
    first_stage = [t["BW"] / t["FW"] for t, stage in zip(per_rank, stages) if stage == 0 and t["FW"] > 0]
    block_ratios = [t["block BW"] / t["block FW timed"] for t in per_rank if t["block FW timed"] > 0]
    if layout.pp > 1 and first_stage:
        block_ratio, source = statistics.mean(first_stage), "pipeline"
    elif block_ratios and (layout.dp == 1 or not _reduces_during_backward(trace, layout)):
        block_ratio, source = statistics.mean(block_ratios), "blocks"
    else:
        block_ratio, source = BLOCK_BACKWARD_RATIO, "flops"
    gaps: dict[int, list[tuple[float, float]]] = {}
    block_fw, rest_fw, ratio, rest_ratio, update, host = [], [], [], [], [], []
    for rank, totals in enumerate(per_rank):
        stage = stages[rank]
        blocks_here = counted[rank] if timed else shape.blocks / layout.pp
        if blocks_here:
            block_fw.append(totals["block"] * layout.tp / (blocks_here * layout.samples))
        own = chunk_forward * totals["FW chunks"]
        rest = max(totals["FW"] - totals["block"] - own, 0.0)
        if stage == layout.pp - 1:
            rest_fw.append(rest * layout.tp / layout.samples)
        if totals["FW"] > 0:
            ratio.append(totals["BW"] / totals["FW"])
        if stage == layout.pp - 1 and totals["block"] > 0 and rest > 0:  # no backward span per block
            rest_ratio.append(max(totals["BW"] - block_ratio * (totals["block"] + own), 0.0) / rest)
        update.append(totals["UPDATE"] / _params_on_rank(shape, layout, stage, blocks_here))
        host.append(totals["host"] - totals["gap FW"] * totals["gaps FW"] - totals["gap BW"] * totals["gaps BW"])
        if totals["gaps FW"] or totals["gaps BW"]:  # one micro-batch: no gap after a backward chunk
            after_forward = totals["gap FW"] if totals["gaps FW"] else totals["gap BW"]
            gaps.setdefault(stage, []).append((after_forward, totals["gap BW"] if totals["gaps BW"] else after_forward))
    fixed = estimate_fixed_cost(comm_ops(trace.aligned()))
    bandwidth = estimate_bandwidth(trace)
    if bandwidth is None:
        raise ValueError("the trace has no op large enough to estimate the link's bandwidth; trace a layout with "
                         "data or pipeline parallelism on more than 32 KiB per op")
    whole = statistics.mean(ratio) if ratio else BLOCK_BACKWARD_RATIO
    per_block = bool(block_fw and rest_ratio)
    return StepCosts(statistics.mean(block_fw) if block_fw else 0.0, statistics.mean(rest_fw) if rest_fw else 0.0,
                     block_ratio if per_block else whole, statistics.mean(update),
                     statistics.mean(host), fixed, bandwidth, tp_comm_in_compute=tp_comm_in_compute and layout.tp > 1,
                     rest_backward_ratio=statistics.mean(rest_ratio) if per_block else None,
                     stage_blocks=tuple(counted[s * layout.tp] for s in range(layout.pp)) if timed and layout.pp > 1
                     else (), chunk_forward_s=chunk_forward,
                     chunk_host_s=tuple(statistics.mean(g[0] for g in gaps[s]) for s in range(layout.pp))
                     if len(gaps) == layout.pp else (),
                     chunk_host_after_backward_s=tuple(statistics.mean(g[1] for g in gaps[s]) for s in range(layout.pp))
                     if len(gaps) == layout.pp else (),
                     chunk_backward_s=_stage_means([(s, t["BW"] / t["FW chunks"]) for s, t in zip(stages, per_rank)
                                                    if t["FW chunks"]], layout.pp),
                     backward_ratio_source=source if per_block else "step" if ratio else "flops")


def _reduces_during_backward(trace: Trace, layout: LayoutSpec) -> bool:
    """Whether any rank launched a data-parallel collective while its blocks' backward ran (from a step's first
    timed block backward to its last): gradient reduction overlapped with them, as DDP and merak3d's
    ``overlap_grad_reduce`` do."""
    for rank in trace.ranks:
        windows: dict[int, list[float]] = {}
        for span in rank.spans:
            if span.is_block("BW"):
                window = windows.setdefault(span.step, [span.start, span.end])
                window[0], window[1] = min(window[0], span.start), max(window[1], span.end)
        if any(windows[c.step][0] <= c.launch <= windows[c.step][1] for c in rank.comms
               if c.step in windows and group_kind(comm_key(rank.rank, c), layout) == "dp"):
            return True
    return False


def _slowest_of_each_stage(per_rank: list[dict[str, float]], stages: list[int]) -> list[dict[str, float]]:
    """Every rank's breakdown replaced by its stage's slowest (most FW, BW and UPDATE compute): a synchronous step
    waits for the slowest of the ranks that do the same work, and on a contended machine the replicas of one traced
    step computed up to 30% apart, so their mean priced every layout low."""
    def compute(totals: dict[str, float]) -> float:
        return totals["FW"] + totals["BW"] + totals["UPDATE"]

    slowest = {}
    for totals, stage in zip(per_rank, stages):
        if stage not in slowest or compute(totals) > compute(slowest[stage]):
            slowest[stage] = totals
    return [slowest[stage] for stage in stages]


def _stage_means(values: list[tuple[int, float]], stages: int) -> tuple[float, ...]:
    """The mean of (stage, value) pairs per stage; () unless every one of ``stages`` has a value."""
    per_stage = [[v for s, v in values if s == stage] for stage in range(stages)]
    return tuple(statistics.mean(v) for v in per_stage) if stages > 1 and all(per_stage) else ()


def _params_on_rank(shape: ModelShape, layout: LayoutSpec, stage: int, blocks: float) -> float:
    """Parameters a rank holds: its stage's ``blocks``, the rest split between first and last stage, over tp."""
    rest = shape.other_params * ((stage == 0) + (stage == layout.pp - 1)) / 2
    return (blocks * shape.block_params + rest) / layout.tp


class _Builder:
    """Every rank's pieces and the ops between them, for :func:`~lightning_merak.planning.replay.engine.build_graph`."""

    def __init__(self, costs: StepCosts) -> None:
        self.costs = costs
        self.pieces: dict[int, list[tuple[str, Any]]] = {}
        self.ops: dict[tuple, CommOp] = {}

    def compute(self, rank: int, category: str, seconds: float) -> None:
        self.pieces[rank].append(("compute", (category, seconds)))

    def op(self, key: tuple, name: str, ranks: list[int], nbytes: float, channel: str, group_size: int,
           kind: str) -> None:
        if key not in self.ops:
            wire = wire_bytes(name, int(nbytes), group_size)
            fixed, rate = self.costs.link(kind)
            self.ops[key] = CommOp(key, name, channel, wire, fixed * max(group_size - 1, 1) + wire / rate, 0.0,
                                   {r: None for r in ranks})

    def send(self, rank: int, key: tuple, nbytes: float, channel: str) -> None:
        """An activation or gradient sent to the next or previous stage, whose receive was posted at the step's
        start (the receiver waits for it where it needs it)."""
        self.op(key, "send", [rank], nbytes, channel, 2, "pp")
        self.pieces[rank].append(("launch", key))

    def launch_collective(self, rank: int, key: tuple, ranks: list[int], nbytes: float, channel: str,
                          kind: str) -> None:
        """An asynchronous all-reduce (a gradient bucket): the rank goes on and waits for it later."""
        self.op(key, "all_reduce", ranks, nbytes, channel, len(ranks), kind)
        self.pieces[rank].append(("launch", key))

    def collective(self, rank: int, key: tuple, name: str, ranks: list[int], nbytes: float, channel: str,
                   kind: str) -> None:
        """A blocking collective: the rank waits for it where it issues it."""
        if len(ranks) > 1:
            self.op(key, name, ranks, nbytes, channel, len(ranks), kind)
            self.pieces[rank].append(("wait", ([key], [key], 0.0)))


def layout_graph(costs: StepCosts, shape: ModelShape, layout: LayoutSpec) -> tuple[TaskGraph, dict[str, Any]]:
    """The task graph of one step of ``layout`` with ``costs``; and what it assumed (for reports)."""
    b = _Builder(costs)
    mb = layout.samples / layout.micro_batches
    activation = mb * shape.seq * shape.hidden * shape.bytes_per_element
    per_stage = list(costs.stage_blocks)
    if len(per_stage) != layout.pp or sum(per_stage) != shape.blocks:
        per_stage = [shape.blocks // layout.pp + (s < shape.blocks % layout.pp) for s in range(layout.pp)]

    pipelined = layout.pp > 1

    def rank_of(d: int, s: int, t: int) -> int:
        return (d * layout.pp + s) * layout.tp + t

    for d in range(layout.dp):
        for s in range(layout.pp):
            for t in range(layout.tp):
                rank = rank_of(d, s, t)
                b.pieces[rank] = []
                b.compute(rank, "host", costs.host_per_step / 2)
                tp_ranks = [rank_of(d, s, u) for u in range(layout.tp)]
                order = stage_op_order(s, layout.pp, layout.micro_batches, "1f1b")
                dp_ranks = [rank_of(e, s, t) for e in range(layout.dp)]
                last_backward = max(p for p, (kind, _) in enumerate(order) if kind == "B")
                buckets: list[tuple] = []

                def reduce(part: str, params: float) -> None:
                    """Launch the gradient all-reduce of ``params`` the last backward pass has just finished."""
                    if layout.dp > 1 and params:
                        key = ("dp", s, t, part)
                        b.launch_collective(rank, key, dp_ranks, params / layout.tp * shape.bytes_per_element,
                                            f"dp{s},{t}", "dp")
                        buckets.append(key)

                for position, (kind, m) in enumerate(order):
                    forward = kind == "F"
                    category = "FW" if forward else "BW"
                    reducing = position == last_backward
                    if forward and s > 0:
                        b.pieces[rank].append(("wait", ([("act", d, s - 1, t, m)], [], 0.0)))
                    if not forward and s < layout.pp - 1:
                        b.pieces[rank].append(("wait", ([("grad", d, s + 1, t, m)], [], 0.0)))
                    block = costs.block_seconds(mb / layout.tp, forward, float(layout.recompute))
                    own = costs.chunk_seconds(s, mb / layout.tp, forward, float(layout.recompute)) if pipelined else 0.0
                    head = costs.rest_seconds(mb / layout.tp, forward) if s == layout.pp - 1 else 0.0
                    # backward runs the chunk in reverse: the head first, the first stage's embedding last
                    if forward and own:
                        b.compute(rank, category, own)
                    if not forward and head:
                        b.compute(rank, category, head)
                    if reducing and s == layout.pp - 1:
                        reduce("head", shape.other_params / 2)
                    for index in range(per_stage[s]):
                        for half in range(2):
                            b.compute(rank, category, block / 2)
                            if not costs.tp_comm_in_compute:
                                b.collective(rank, ("tp", d, s, kind, m, index, half), "all_reduce", tp_ranks,
                                             activation, f"tp{d},{s}", "tp")
                        if reducing:
                            reduce(f"block {index}", shape.block_params)
                    if forward and head:
                        b.compute(rank, category, head)
                    if not forward and own:
                        b.compute(rank, category, own)
                    if reducing and s == 0:
                        reduce("embedding", shape.other_params / 2)
                    if forward and s < layout.pp - 1:
                        b.send(rank, ("act", d, s, t, m), activation / layout.tp, f"p2p{rank}->{rank_of(d, s + 1, t)}")
                    if not forward and s > 0:
                        b.send(rank, ("grad", d, s, t, m), activation / layout.tp, f"p2p{rank}->{rank_of(d, s - 1, t)}")
                    gap = costs.gap_seconds(s, layout.pp, forward, mb / layout.tp) if pipelined else 0.0
                    if position < len(order) - 1 and gap:
                        b.compute(rank, "host", gap)
                if buckets:
                    b.pieces[rank].append(("wait", (buckets, [], 0.0)))
                b.compute(rank, "UPDATE", costs.update_per_param * _params_on_rank(shape, layout, s, per_stage[s]))
                b.compute(rank, "host", costs.host_per_step / 2)
    graph = build_graph(b.pieces, b.ops, {r: {} for r in b.pieces}, 0.0, WhatIf())
    return graph, {"micro_batch_samples": mb, "activation_bytes": activation, "ranks": layout.ranks,
                   "stage_blocks": per_stage}


def predict_layout(costs: StepCosts, shape: ModelShape, layout: LayoutSpec) -> ReplayResult:
    """Replay one step of ``layout``: ``step_time`` is the prediction."""
    graph, _ = layout_graph(costs, shape, layout)
    return replay(graph)


def predict_from_traced(costs: StepCosts, shape: ModelShape, traced: LayoutSpec, target: LayoutSpec,
                        traced_step_s: float, target_costs: Optional[StepCosts] = None) -> float:
    """``target``'s step time as the traced run's measured ``traced_step_s`` times the re-derived step of ``target``
    over the re-derived step of ``traced``: what the re-derivation gets wrong on the traced layout itself (it rebuilds
    the step from costs, where the trace replay reproduces it) cancels, only the change is predicted.

    ``target_costs`` (default ``costs``) replay ``target``, e.g. with another partition of the blocks."""
    if traced_step_s <= 0:
        raise ValueError(f"the traced run's step time must be positive, got {traced_step_s}")
    ratio = (predict_layout(target_costs or costs, shape, target).step_time
             / predict_layout(costs, shape, traced).step_time)
    return traced_step_s * ratio
