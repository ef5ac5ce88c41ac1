"""What-if on layouts: re-derive every rank's work from a traced run and replay another layout (pure).

:func:`calibrate` reads, from a trace of any merak3d layout, what does not depend on the layout:
forward time per block and sample, the rest of the forward (head and loss) per sample, backward
as a multiple of forward, optimizer time per parameter, the loop's own time per step, and the
link (fixed cost per op, effective bandwidth). :func:`layout_graph` then builds the step of another
layout — data, pipeline and tensor parallel degrees, micro-batches, recomputation, any rank count
(beyond the traced machine: simulated) — as the same task graph the trace replay uses: 1F1B
order per stage (:func:`~lightning_merak.strategies.pipeline.simulate.stage_op_order`), activations
between stages, two all-reduces per block and pass under tensor parallelism, the gradient
all-reduce over data-parallel replicas.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from lightning_merak.profiler.replay import (
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
from lightning_merak.profiler.trace import Trace, comm_key, wire_bytes
from lightning_merak.strategies.pipeline.simulate import stage_op_order

__all__ = ["LayoutSpec", "ModelShape", "StepCosts", "calibrate", "layout_graph", "predict_layout"]


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
    """A layout's degrees, micro-batches and the samples each data-parallel replica trains per step."""

    dp: int
    pp: int
    tp: int
    micro_batches: int
    samples: int
    recompute: bool = False

    @property
    def ranks(self) -> int:
        return self.dp * self.pp * self.tp


@dataclass(frozen=True)
class StepCosts:
    """Layout-free costs read from a trace (seconds)."""

    block_forward_per_sample: float
    rest_forward_per_sample: float
    backward_ratio: float
    update_per_param: float
    host_per_step: float
    op_fixed_s: float
    link_bytes_per_s: float


def _rank_breakdown(trace: Trace) -> list[dict[str, float]]:
    """Per rank and step: FW, BW, UPDATE compute (their waits removed), block forward, host, and step time."""
    aligned = trace.aligned()
    steps = max(len(aligned.steps()), 1)
    result = []
    for rank in aligned.ranks:
        records = [(comm_key(rank.rank, c), c) for c in rank.comms]
        waits = [(w[0], w[1]) for w in main_thread_waits(rank.spans, records, True)]

        def busy(start: float, end: float) -> float:
            waited = sum(max(0.0, min(end, b) - max(start, a)) for a, b in waits)
            return end - start - waited

        totals = {"FW": 0.0, "BW": 0.0, "UPDATE": 0.0, "block": 0.0, "step": 0.0, "waits": 0.0}
        top = {c: min((s.depth for s in rank.spans if s.category == c), default=0) for c in ("FW", "BW", "UPDATE")}
        # Under a pipeline schedule Lightning's training step holds every chunk, forward and backward: the
        # chunks are the compute, the rest of the step (the schedule's own work) counts as the loop's.
        chunked = any(s.name.startswith("stage ") for s in rank.spans)
        for span in rank.spans:
            seconds = busy(span.start, span.end)
            if chunked and span.name.startswith("stage "):
                totals[span.category] += seconds
            elif span.category in top and span.depth == top[span.category]:
                if span.category == "UPDATE" or not chunked:
                    totals[span.category] += seconds
            elif span.category == "FW" and span.name.startswith("block"):
                totals["block"] += seconds
            elif span.category == "step":
                totals["step"] += span.end - span.start
                totals["waits"] += span.end - span.start - seconds
        totals["host"] = totals["step"] - totals["waits"] - totals["FW"] - totals["BW"] - totals["UPDATE"]
        result.append({key: value / steps for key, value in totals.items()})
    return result


def calibrate(trace: Trace, shape: ModelShape, layout: LayoutSpec) -> StepCosts:
    """The layout-free costs of ``trace``, a run of ``layout`` on a model of ``shape``.

    Ranks are ordered data-parallel outermost, then pipeline stage, then tensor-parallel rank.
    """
    per_rank = _rank_breakdown(trace)
    blocks_local = shape.blocks / layout.pp
    block_fw, rest_fw, ratio, update, host = [], [], [], [], []
    for rank, totals in enumerate(per_rank):
        stage = (rank // layout.tp) % layout.pp
        block_fw.append(totals["block"] * layout.tp / (blocks_local * layout.samples))
        if stage == layout.pp - 1:
            rest_fw.append(max(totals["FW"] - totals["block"], 0.0) * layout.tp / layout.samples)
        if totals["FW"] > 0:
            ratio.append(totals["BW"] / totals["FW"])
        update.append(totals["UPDATE"] / _params_on_rank(shape, layout, stage))
        host.append(totals["host"])
    fixed = estimate_fixed_cost(comm_ops(trace.aligned()))
    bandwidth = estimate_bandwidth(trace)
    if bandwidth is None:
        raise ValueError("the trace has no op large enough to estimate the link's bandwidth; trace a layout with "
                         "data or pipeline parallelism on more than 32 KiB per op")
    return StepCosts(statistics.mean(block_fw), statistics.mean(rest_fw) if rest_fw else 0.0,
                     statistics.mean(ratio) if ratio else 2.0, statistics.mean(update), statistics.mean(host),
                     fixed, bandwidth)


def _params_on_rank(shape: ModelShape, layout: LayoutSpec, stage: int) -> float:
    """Parameters a rank holds: its stage's blocks, the rest split between first and last stage, over tp."""
    blocks = shape.blocks / layout.pp * shape.block_params
    rest = shape.other_params * ((stage == 0) + (stage == layout.pp - 1)) / 2
    return (blocks + rest) / layout.tp


class _Builder:
    """Every rank's pieces and the ops between them, for :func:`~lightning_merak.profiler.replay.build_graph`."""

    def __init__(self, costs: StepCosts) -> None:
        self.costs = costs
        self.pieces: dict[int, list[tuple[str, Any]]] = {}
        self.ops: dict[tuple, CommOp] = {}

    def compute(self, rank: int, category: str, seconds: float) -> None:
        self.pieces[rank].append(("compute", (category, seconds)))

    def op(self, key: tuple, name: str, ranks: list[int], nbytes: float, channel: str, group_size: int) -> None:
        if key not in self.ops:
            wire = wire_bytes(name, int(nbytes), group_size)
            fixed = self.costs.op_fixed_s * max(group_size - 1, 1)
            self.ops[key] = CommOp(key, name, channel, wire, fixed + wire / self.costs.link_bytes_per_s, 0.0,
                                   {r: None for r in ranks})

    def send(self, rank: int, key: tuple, nbytes: float, channel: str) -> None:
        """An activation or gradient sent to the next or previous stage, whose receive was posted at the step's
        start (the receiver waits for it where it needs it)."""
        self.op(key, "send", [rank], nbytes, channel, 2)
        self.pieces[rank].append(("launch", key))

    def collective(self, rank: int, key: tuple, name: str, ranks: list[int], nbytes: float, channel: str) -> None:
        """A blocking collective: the rank waits for it where it issues it."""
        if len(ranks) > 1:
            self.op(key, name, ranks, nbytes, channel, len(ranks))
            self.pieces[rank].append(("wait", ([key], [key], 0.0)))


def layout_graph(costs: StepCosts, shape: ModelShape, layout: LayoutSpec) -> tuple[TaskGraph, dict[str, Any]]:
    """The task graph of one step of ``layout`` with ``costs``; and what it assumed (for reports)."""
    b = _Builder(costs)
    mb = layout.samples / layout.micro_batches
    activation = mb * shape.seq * shape.hidden * shape.bytes_per_element
    blocks_local = shape.blocks / layout.pp

    def rank_of(d: int, s: int, t: int) -> int:
        return (d * layout.pp + s) * layout.tp + t

    for d in range(layout.dp):
        for s in range(layout.pp):
            for t in range(layout.tp):
                rank = rank_of(d, s, t)
                b.pieces[rank] = []
                b.compute(rank, "host", costs.host_per_step / 2)
                tp_ranks = [rank_of(d, s, u) for u in range(layout.tp)]
                for kind, m in stage_op_order(s, layout.pp, layout.micro_batches, "1f1b"):
                    forward = kind == "F"
                    if forward and s > 0:
                        b.pieces[rank].append(("wait", ([("act", d, s - 1, t, m)], [], 0.0)))
                    if not forward and s < layout.pp - 1:
                        b.pieces[rank].append(("wait", ([("grad", d, s + 1, t, m)], [], 0.0)))
                    factor = 1.0 if forward else costs.backward_ratio + (1.0 if layout.recompute else 0.0)
                    block = costs.block_forward_per_sample * mb / layout.tp * factor
                    for index in range(int(round(blocks_local))):
                        for half in range(2):
                            b.compute(rank, "FW" if forward else "BW", block / 2)
                            b.collective(rank, ("tp", d, s, kind, m, index, half), "all_reduce", tp_ranks, activation,
                                         f"tp{d},{s}")
                    if s == layout.pp - 1:
                        b.compute(rank, "FW" if forward else "BW",
                                  costs.rest_forward_per_sample * mb / layout.tp * factor)
                    if forward and s < layout.pp - 1:
                        b.send(rank, ("act", d, s, t, m), activation / layout.tp, f"p2p{rank}->{rank_of(d, s + 1, t)}")
                    if not forward and s > 0:
                        b.send(rank, ("grad", d, s, t, m), activation / layout.tp, f"p2p{rank}->{rank_of(d, s - 1, t)}")
                dp_ranks = [rank_of(e, s, t) for e in range(layout.dp)]
                b.collective(rank, ("dp", s, t), "all_reduce", dp_ranks,
                             _params_on_rank(shape, layout, s) * shape.bytes_per_element, f"dp{s},{t}")
                b.compute(rank, "UPDATE", costs.update_per_param * _params_on_rank(shape, layout, s))
                b.compute(rank, "host", costs.host_per_step / 2)
    graph = build_graph(b.pieces, b.ops, {r: {} for r in b.pieces}, 0.0, WhatIf())
    return graph, {"micro_batch_samples": mb, "activation_bytes": activation, "ranks": layout.ranks}


def predict_layout(costs: StepCosts, shape: ModelShape, layout: LayoutSpec) -> ReplayResult:
    """Replay one step of ``layout``: ``step_time`` is the prediction."""
    graph, _ = layout_graph(costs, shape, layout)
    return replay(graph)
