"""The replay benchmark's in-process measurements in the driver and its micro-batch what-ifs: a probe of the block's,
head's, prefix's and loss's call curves, the rows that predict other micro-batch counts from the traced pp2 M=2 run
(:mod:`benchmarks.replay`), and what recording a collective costs (:func:`recording_overhead_us`).

Three models are reported side by side. "probe curves": block and head calls of other sizes, the first stage's
own work (embedding and the stage's exit, forward and backward) and the last stage's loss between chunks follow the
curves the probe measured in the driver process (:func:`~lightning_merak.planning.measure.probe.probe_call_curves`),
and the
step is the traced run's measured period times the re-derived step of M over that of M=2
(:func:`~lightning_merak.planning.replay.synthesize.predict_from_traced`).
"chunk work guessed": the same without the prefix's and loss's curves, a chunk's fixed work priced at its traced
forward, again at the blocks' ratio in backward, on every stage.
"two-trace line": a block call's fixed time from the line through the dp2 and M=2 traces' median calls
(:func:`~lightning_merak.planning.replay.calibration.block_call_cost`), the re-derived step scaled by the traced run's
untraced over traced ratio.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Any, Callable, Sequence

import torch

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.planning.measure.probe import ProbedCurves, probe_call_curves
from lightning_merak.planning.replay.calibration import block_call_cost
from lightning_merak.planning.replay.engine import measured_step_time
from lightning_merak.planning.replay.refine import with_block_call_cost, with_call_curves
from lightning_merak.planning.replay.synthesize import (
    LayoutSpec,
    ModelShape,
    StepCosts,
    calibrate,
    predict_from_traced,
    predict_layout,
)
from lightning_merak.planning.replay.trace import Trace
from lightning_merak.testing.cores import pin_rank_to_core

CURVE_MODEL = ("probe curves (blocks in a row, head, first stage's prefix, loss), backward from the traced chunks, "
               "relative to the traced M=2 step")
GUESSED_MODEL = "probe curves (block, head), a chunk's fixed work at its traced forward, 2x that in backward"
GUESSED_KIND = "what-if micro-batches (chunk work guessed)"
"""The model before the prefix and loss were probed, on the same traces and curves: beside the goal's rows, out of
the maxima."""
LINE_MODEL = "two-trace line (dp2 and M=2 block calls)"
LINE_KIND = "what-if micro-batches (two-trace line)"
"""The earlier model's rows: reported beside the goal's, out of the maxima."""


def probe_sizes(samples: int, micro_batch_counts: Sequence[int]) -> tuple[int, ...]:
    """The samples per call the what-ifs need: the traced M=2 run's and each predicted count's."""
    return tuple(sorted({samples // m for m in (2, *micro_batch_counts)}))


def probe_curves(model_config: Any, vocab: int, seq: int, sizes: Sequence[int], pin: bool = False) -> ProbedCurves:
    """Block, head and prefix call curves of the benchmark's model, built and seeded as the ranks build it, on one
    thread and (``pin``) the core of the first stage's rank (:func:`~lightning_merak.testing.cores.pin_rank_to_core`),
    as the ranks run."""
    threads = torch.get_num_threads()
    allowed = os.sched_getaffinity(0) if pin and hasattr(os, "sched_getaffinity") else None
    torch.set_num_threads(1)
    if pin:
        pin_rank_to_core(0)
    try:
        torch.manual_seed(0)
        model = build_causal_lm(model_config, vocab)
        model.config.use_cache = False
        tokens = torch.randint(vocab, (max(sizes), seq), generator=torch.Generator().manual_seed(1))
        return probe_call_curves(model, tokens, sizes)
    finally:
        torch.set_num_threads(threads)
        if allowed is not None:
            os.sched_setaffinity(0, allowed)


def microbatch_rows(traces: dict[str, Trace], runs: dict[str, dict[str, Any]], layouts: dict[str, LayoutSpec],
                    counts: Sequence[int], shape: ModelShape, curves: ProbedCurves,
                    row: Callable[..., dict[str, Any]], partitioned_kind: str,
                    split_of: Callable[[StepCosts, str], StepCosts],
                    expected_split: Callable[[StepCosts, str], StepCosts],
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows predicting ``pp2_m<M>`` for every M in ``counts`` from the traced ``pp2_m2`` (and ``dp2``) runs, by both
    models, and again at each measured run's partition (``split_of``); and the costs used, for the JSON.

    The curve model's rows replay each count at the split its partitioner is expected to choose (``expected_split``,
    derived before the run); the comparison rows keep the traced run's."""
    pp_trace, pp_layout = traces["pp2_m2"], layouts["pp2_m2"]
    costs = calibrate(pp_trace, shape, pp_layout)
    curve_costs = with_call_curves(costs, pp_layout, *curves)
    guessed_costs = with_call_curves(costs, pp_layout, curves.block, curves.head)
    line_costs = with_block_call_cost(costs, pp_layout, block_call_cost(traces["dp2"], layouts["dp2"], pp_trace,
                                                                        pp_layout))
    traced_period = runs["pp2_m2"]["period_s"]
    correction = traced_period / measured_step_time(pp_trace)
    rows, partitioned = [], []
    for m in counts:
        name, what = f"pp2_m{m}", f"pp2 M={m} from M=2"
        run, layout = runs[name], layouts[name]
        contention = {"measured_cpu_wait_share": run["cpu_wait_share"]} if "cpu_wait_share" in run else {}
        rows.append(row("what-if micro-batches", what, predict_from_traced(
            curve_costs, shape, pp_layout, layout, traced_period, target_costs=expected_split(curve_costs, name)),
                        run["period_s"], call_model=CURVE_MODEL, **contention))
        rows.append(row(GUESSED_KIND, what, predict_from_traced(guessed_costs, shape, pp_layout, layout,
                                                                traced_period),
                        run["period_s"], call_model=GUESSED_MODEL, **contention))
        rows.append(row(LINE_KIND, what, predict_layout(line_costs, shape, layout).step_time * correction,
                        run["period_s"], call_model=LINE_MODEL, **contention))
        partitioned.append(row(partitioned_kind, what, predict_from_traced(
            curve_costs, shape, pp_layout, layout, traced_period, target_costs=split_of(curve_costs, name)),
            run["period_s"], call_model=CURVE_MODEL, **contention))
    return rows + partitioned, {"pp2_m2": asdict(curve_costs), "pp2_m2_two_trace_line": asdict(line_costs)}


def recording_overhead_us(calls: int = 2000) -> dict[str, float]:
    """Microseconds each recorded collective costs on top of the plain call (1-rank gloo group, tiny tensor)."""
    import torch.distributed as dist

    from lightning_merak.callbacks.profiler.recorder import TraceRecorder

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        tensor = torch.zeros(4)

        def per_call() -> float:
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(tensor)
            return (time.perf_counter() - start) / calls * 1e6

        plain = min(per_call() for _ in range(3))
        recorder = TraceRecorder(0, block_spans=False)
        recorder.install()
        try:
            recorded = min(per_call() for _ in range(3))
        finally:
            recorder.uninstall()
    finally:
        dist.destroy_process_group()
    return {"plain_call_us": plain, "recorded_call_us": recorded, "overhead_per_op_us": recorded - plain}
