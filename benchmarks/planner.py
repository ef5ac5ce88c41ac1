"""The merak3d layout planner against measurement: predicted vs measured step time per layout.

Run from the repo root::

    python -m benchmarks.planner [--quick] [--moe] [--out PATH]

Each round plans once (``plan_only=True`` with ``pipeline_parallel``, ``tensor_parallel`` and
``tp_overlap`` on ``"auto"``: the planner profiles this machine inside 2 gloo ranks and returns
its prediction for every layout of its grid), then trains every layout of the grid for a few
steps in fresh ranks (one torch thread each). A layout's measured step time is the median over
rounds of its median step (slowest rank, warm-up excluded); its predicted step time is the
median over rounds of the planner's prediction. Planning in every round puts a profile into
each stretch of time the measurements come from: on a shared machine whose speed drifts by
10–20% over minutes, one profile taken at the start predicts the machine of that moment, not
the one the later measurements ran on.

Each training run is also planned by itself, the way a user's run with ``"auto"`` is: its
data-parallel, pipeline, micro-batch and overlap degrees are fixed and ``tensor_parallel`` is
``"auto"`` (the only layout left), so the planner profiles the machine seconds before that
layout trains and predicts it. The *paired* error compares that prediction with the same
run's steps: the cost model's error without the drift between a round's profile and its
later measurements.

* prediction error = predicted / measured − 1 per layout (target |error| ≤ 10%), from the
  round's plan and, paired, from the run's own plan (median over rounds); the replay's as the
  median prediction against the median run, and paired: each round's prediction against the run
  its calibration runs bracketed (median over rounds: both sides of a pair met the same spell);
* regret = measured time per sample of the planner's pick (the layout ranked first by the
  median predictions) / the best measured − 1 (target ≤ 5%). Each data-parallel replica
  trains on the dataloader's batch, so layouts with more replicas train more samples per
  step; layouts are compared per sample.

A second predictor, the trace replayer (``planner_calibration`` with trace files), is calibrated
each round from short traced runs (:func:`calibration_groups`): a dp=2 run of the whole model, a pp=2 run where
the grid holds pipelines, and runs on the model cut to ``PROBE_LAYERS`` blocks of each tensor-parallel degree and
overlap of the grid (:mod:`lightning_merak.planning.replay.calibration`). Each calibration run *brackets* the measured
runs it prices: it is traced right before them and again right after, and the round's prediction is the mean of
the replay calibrated on the runs before and the one calibrated on the runs after. A user calibrates seconds
before training, not minutes; on this shared machine a layout's runs minutes apart differ by up to 28%, so a
calibration taken a round's length before a measured run priced the spell, not the layout. Groups run in mirrored
order in alternate rounds. Pipelines are priced at the split merak3d's autopipe will pick for their micro-batches
on the calibrated costs (:mod:`lightning_merak.planning.replay.stage_split`; rows keep it per round next to the split
each run reported). Rows carry both predictions (``predicted_s``/``error``: the cost model;
``replay_predicted_s``/``replay_error``: the replay), the summary both maxima and each predictor's pick and regret.

Goals (issue #49): ``error_max_leave_one_out`` (:data:`ERROR_GOAL`), the worst |error| over layouts of the default
planner's (``planner_calibration="analytic"``) round predictions: its profile times blocks, collectives and a toy
pipeline in ranks of their own and never a training run of any layout, so every layout's prediction is held out from
every calibration run of that layout; ``regret`` (:data:`REGRET_GOAL`) of the layout those predictions rank first. The
paired errors (a run's own plan, profiled inside that layout's run) and the replayer's (calibrated on traced runs of
the layouts it prices) are not held out: beside the goals. The replayer's own leave-one-layout-out figure
(``replay_loo_*``, :func:`held_out_groups`) prices each layout without the calibration runs of its layout.

Everything is measured on this machine; nothing is simulated except the predictions
themselves. Other load on the machine skews both. The ranks start with the glibc tunables merak3d's launcher gives
a user's ranks (:func:`~lightning_merak.distributed.host_memory.export_heap_tunables` before the forkserver they are
forked from starts; ``--default-heap`` for glibc's defaults: not a full run, so only with ``--out`` or ``--quick``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks._replay_partition import stage_blocks
from benchmarks.goals import Goal, print_goals, worst_case, write_run
from benchmarks.merak3d import Workload, _quiet_lightning, _StepTimer
from benchmarks.report import out_help, print_table
from lightning_merak.callbacks.profiler import MerakTraceProfiler, Trace
from lightning_merak.distributed.host_memory import export_heap_tunables
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import OptimConfig
from lightning_merak.planning.replay.calibration import (
    Probe,
    ReplayPredictor,
    calibrate_from_traces,
    untraced_step_time,
)
from lightning_merak.planning.replay.engine import measured_step_time
from lightning_merak.planning.replay.synthesize import LayoutSpec, ModelShape
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed
from lightning_merak.testing.distributed import DistributedRunError

REPO_ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2
RANK_TIMEOUT_S = 300.0
WORKLOAD = Workload(hidden=256, layers=4, vocab=4096, seq=64, global_batch=8)
"""``global_batch`` here is the batch of each data-parallel replica (the dataloader's batch_size)."""
ERROR_GOAL = Goal(
    "error_max_leave_one_out", 0.10, "<=",
    "|the default (analytic) planner's predicted step of a layout, median over rounds of plans profiled in ranks of "
    "their own with no run of any layout / the layout's measured median step - 1|; worst over the grid's layouts",
    issue=49)
REGRET_GOAL = Goal(
    "regret", 0.05, "<=",
    "measured time per sample of the layout the held-out predictions rank first / the best measured - 1 (layouts "
    "train different samples per step)", issue=49)
ERROR_TARGET, REGRET_TARGET = ERROR_GOAL.target, REGRET_GOAL.target
TRACE_SKIP, TRACE_STEPS, UNTRACED_STEPS = 2, 3, 8
"""The replayer's calibration runs: warm-up steps, traced steps, then untraced steps whose median anchors the
calibration. In one full run's 24 calibration runs the traced window read 0.88-1.37 of its own run's untraced median
(median 1.08), while the recorder switched on and off in alternating pairs of steps of one dp2 or pp2 run moved
them by -1.4 to +2.1%: three early steps in one spell, not the recorder, set most of the gap."""
PROBE_LAYERS = 2
"""Blocks of the tensor-parallel probe runs (the workload has 4)."""
SIDES = ("before", "after")
"""Each calibration run is traced before the measured runs it prices and again after them; one predictor per side."""


@dataclass(frozen=True)
class Mode:
    warmup: int
    steps: int
    micro_batch_choices: tuple[int, ...] | None
    overlap: str | int
    rounds: int
    """Each round plans, then measures every layout once; rounds run one after another and the
    medians count, so a slow spell of the shared machine lands on every layout and on a profile
    instead of on one of them."""


QUICK = Mode(warmup=2, steps=6, micro_batch_choices=(4,), overlap="auto", rounds=1)
FULL = Mode(warmup=3, steps=14, micro_batch_choices=None, overlap="auto", rounds=5)


class _ReplicaData(pl.LightningDataModule):
    """Every data-parallel replica reads its own ``batch``-sample slice of each step's tokens."""

    def __init__(self, workload: Workload, steps: int) -> None:
        super().__init__()
        self.workload, self.steps = workload, steps

    def train_dataloader(self) -> DataLoader:
        w = self.workload
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        replicas, rank = kwargs["num_replicas"], kwargs["rank"]
        tokens = torch.randint(w.vocab, (self.steps, w.global_batch * replicas, w.seq),
                               generator=torch.Generator().manual_seed(0))
        local = tokens[:, rank * w.global_batch:(rank + 1) * w.global_batch].reshape(-1, w.seq)
        return DataLoader(TensorDataset(local), batch_size=w.global_batch, shuffle=False)


def _layout_key(layout: dict[str, Any]) -> str:
    return "dp{dp} pp{pp} tp{tp} M{micro_batches} k{overlap}".format(**layout)


def _run_rank(rank: int, world_size: int, merak: dict[str, Any], steps: int,
              trace_dir: str | None = None, layers: int = 0) -> dict[str, Any]:
    _quiet_lightning()
    torch.manual_seed(0)
    workload = replace(WORKLOAD, layers=layers) if layers else WORKLOAD
    model = build_causal_lm(workload.model_config(), WORKLOAD.vocab)
    model.config.use_cache = False
    module = CausalLMModule(model, OptimConfig(warmup_steps=1))
    timer = _StepTimer()
    strategy = Merak3DStrategy(**merak, timeout_s=RANK_TIMEOUT_S)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[timer],
        profiler=(MerakTraceProfiler(trace_dir, skip_steps=TRACE_SKIP, steps=TRACE_STEPS, untraced_steps=UNTRACED_STEPS)
                  if trace_dir else None),
    )
    trainer.fit(module, datamodule=_ReplicaData(WORKLOAD, steps))
    partition = getattr(strategy, "partition", None)
    result: dict[str, Any] = {"step_s": timer.step_s, "layout": {
        "dp": strategy.data_parallel, "pp": strategy.pipeline_parallel, "tp": strategy.tensor_parallel,
        "micro_batches": strategy.micro_batches, "overlap": strategy.tp_overlap},
        "stage_blocks": list(stage_blocks(partition.boundaries, workload.layers)) if partition is not None else None}
    if strategy.layout_choice is not None:
        result["predicted_step_s"] = strategy.layout_choice.step_time_s
    if strategy.layout_plan is not None and rank == 0:
        result["predictions"] = [
            {"layout": {"dp": p.layout.dp, "pp": p.layout.pp, "tp": p.layout.tp,
                        "micro_batches": p.layout.micro_batches, "overlap": p.layout.overlap},
             "step_s": p.step_time_s, "samples": p.samples_per_step, "components": dict(p.components)}
            for p in strategy.layout_plan.ranked
        ]
    return result


def _plan(mode: Mode) -> list[dict[str, Any]]:
    merak = {"pipeline_parallel": "auto", "tensor_parallel": "auto", "tp_overlap": mode.overlap,
             "plan_only": True, "micro_batches": mode.micro_batch_choices[0] if mode.micro_batch_choices else None}
    ranks = run_distributed(_run_rank, WORLD_SIZE, args=(merak, 2), timeout_s=RANK_TIMEOUT_S, threads_per_rank=1)
    return ranks[0]["predictions"]


def _traced_run(merak: dict[str, Any], layers: int = 0) -> Trace:
    """A short traced run of ``merak``'s layout (the workload cut to ``layers`` blocks if given): its trace, with
    the run's :data:`UNTRACED_STEPS` untraced steps after the window, which its calibration anchors on."""
    steps = TRACE_SKIP + TRACE_STEPS + UNTRACED_STEPS
    with tempfile.TemporaryDirectory(prefix="merak-planner-trace-") as trace_dir:
        run_distributed(_run_rank, WORLD_SIZE, args=(merak, steps, trace_dir, layers), timeout_s=RANK_TIMEOUT_S,
                        threads_per_rank=1)
        return Trace.load(Path(trace_dir) / "merak_trace.json")


@functools.cache
def _shape(layers: int) -> ModelShape:
    """The shape of the workload's model cut to ``layers`` blocks (built once per block count)."""
    workload = replace(WORKLOAD, layers=layers)
    model = build_causal_lm(workload.model_config(), workload.vocab)
    blocks = model.model.layers
    block_params = sum(p.numel() for p in blocks[0].parameters())
    return ModelShape(len(blocks), block_params, sum(p.numel() for p in model.parameters())
                      - len(blocks) * block_params, workload.hidden, workload.seq)


def _calibration_run(name: str, trace: Trace) -> dict[str, Any]:
    """What a calibration run's steps read: the traced window's step and the untraced steps after it."""
    return {"run": name, "traced_step_s": measured_step_time(trace),
            "untraced_steps_s": list(trace.meta.get("untraced_step_s", [])),
            "untraced_median_s": untraced_step_time(trace)}


class CalibrationGroup(NamedTuple):
    """One traced calibration run and the layouts of the grid whose replay rests on it
    (:meth:`~lightning_merak.planning.replay.calibration.TraceCalibration.costs_for`)."""

    name: str
    merak: dict[str, Any]
    layers: int
    """Blocks of the traced model (0: the whole workload)."""
    spec: LayoutSpec
    layouts: list[str]
    """:func:`_layout_key` of every layout it prices; the base group (first) also lends its links and block calls
    to the others."""


def calibration_groups(plan: list[dict[str, Any]]) -> list[CalibrationGroup]:
    """The calibration runs a round of ``plan`` traces, base first: a dp=2 run of the whole model (prices every
    layout at tp=1 without a pipeline); where ``plan`` holds pipelines, a pp=2 run of the whole model at the middle
    of their micro-batch counts (a dp trace has no chunks, gaps or sends, and its block calls hold one size: with the
    pipeline's calls they give a call's fixed time, which more micro-batches pay more often); a run on the workload
    cut to :data:`PROBE_LAYERS` blocks of every tensor-parallel degree and overlap in ``plan`` (the
    vocabulary-parallel head, sub-batches, the blocks' collectives), which prices that degree and overlap at any
    pipeline depth."""
    keys = {_layout_key(p["layout"]): p["layout"] for p in plan}
    groups = [CalibrationGroup("dp2", {"data_parallel": 2, "pipeline_parallel": 1, "tensor_parallel": 1}, 0,
                               LayoutSpec(2, 1, 1, 1, WORKLOAD.global_batch),
                               [k for k, layout in keys.items() if layout["pp"] == 1 and layout["tp"] == 1])]
    pipelines = [k for k, layout in keys.items() if layout["pp"] > 1 and layout["tp"] == 1]
    if pipelines:
        counts = sorted(keys[k]["micro_batches"] for k in pipelines)
        micro_batches = counts[(len(counts) - 1) // 2]
        groups.append(CalibrationGroup(
            f"pp2 M{micro_batches}", {"data_parallel": WORLD_SIZE // 2, "pipeline_parallel": 2, "tensor_parallel": 1,
                                      "micro_batches": micro_batches}, 0,
            LayoutSpec(WORLD_SIZE // 2, 2, 1, micro_batches, WORKLOAD.global_batch), pipelines))
    for tp, overlap in sorted({(layout["tp"], layout["overlap"]) for layout in keys.values() if layout["tp"] > 1}):
        groups.append(CalibrationGroup(
            f"tp{tp} k{overlap} probe", {"data_parallel": WORLD_SIZE // tp, "pipeline_parallel": 1,
                                         "tensor_parallel": tp, "tp_overlap": overlap}, PROBE_LAYERS,
            LayoutSpec(WORLD_SIZE // tp, 1, tp, 1, WORKLOAD.global_batch, overlap=overlap),
            [k for k, layout in keys.items() if layout["tp"] == tp and layout["overlap"] == overlap]))
    return groups


def _predictor(groups: list[CalibrationGroup], traces: dict[str, Trace]) -> ReplayPredictor:
    """A replay predictor from one trace of every group (by name): the base group's calibrates, the others are probes.
    Every cost set is anchored on the median of its run's untraced steps
    (:func:`~lightning_merak.planning.replay.calibration.calibrate_from_traces`). Sharding is not modelled (no layout of
    the grid shards)."""
    base, *others = groups
    probes = [Probe(traces[g.name], _shape(g.layers or WORKLOAD.layers), g.spec) for g in others]
    return ReplayPredictor(calibrate_from_traces(traces[base.name], _shape(WORKLOAD.layers), base.spec, probes))


def _replay_spec(layout: dict[str, Any]) -> LayoutSpec:
    return LayoutSpec(layout["dp"], layout["pp"], layout["tp"], layout["micro_batches"] or 1, WORKLOAD.global_batch,
                      overlap=layout["overlap"])


def _replay_predictions(plan: list[dict[str, Any]], predictors: list[ReplayPredictor]) -> dict[str, float]:
    """The replay's step time for every layout of ``plan``: the median over ``predictors``."""
    return {_layout_key(p["layout"]): statistics.median(predictor.step_time(_replay_spec(p["layout"]))
                                                        for predictor in predictors) for p in plan}


def held_out_groups(groups: list[CalibrationGroup], layout_key: str) -> list[CalibrationGroup] | None:
    """The calibration groups a leave-one-layout-out replay of ``layout_key`` rests on: every group whose traced
    run is not of that layout (a probe of the cut model at that layout is one), the first whole-model run as the
    base; None where no whole-model run is left to calibrate on."""
    kept = [g for g in groups if _layout_key(_spec_layout(g.spec)) != layout_key]
    bases = [g for g in kept if g.layers == 0]
    return [bases[0], *(g for g in kept if g is not bases[0])] if bases else None


def _spec_layout(spec: LayoutSpec) -> dict[str, int]:
    return {"dp": spec.dp, "pp": spec.pp, "tp": spec.tp, "micro_batches": spec.micro_batches, "overlap": spec.overlap}


def _held_out_replay(plan: list[dict[str, Any]], groups: list[CalibrationGroup],
                     traces: dict[str, dict[str, Trace]]) -> dict[str, float | None]:
    """Every layout's replay from the calibration runs of other layouts (:func:`held_out_groups`), the median over
    both sides' traces; None where they cannot price it (no whole-model run left, or the calibration refuses)."""
    predictions: dict[str, float | None] = {}
    for p in plan:
        key = _layout_key(p["layout"])
        kept = held_out_groups(groups, key)
        try:
            predictions[key] = None if kept is None else statistics.median(
                _predictor(kept, traces[side]).step_time(_replay_spec(p["layout"])) for side in SIDES)
        except ValueError:
            predictions[key] = None
    return predictions


def _replay_splits(plan: list[dict[str, Any]], predictor: ReplayPredictor) -> dict[str, list[int] | None]:
    """The blocks per stage ``predictor`` prices every pipelined layout of ``plan`` at: autopipe's pick on its
    calibrated costs (:meth:`~lightning_merak.planning.replay.calibration.ReplayPredictor.stage_blocks`); None
    unpipelined. The benchmark reports the predictor calibrated before the runs (the one after may pick another)."""
    return {_layout_key(p["layout"]): list(predictor.stage_blocks(_replay_spec(p["layout"]))) or None for p in plan}


def split_agreement(rows: list[dict[str, Any]]) -> float | None:
    """The share of measured pipeline runs whose split (autopipe's at the run's start) is the one the replay priced
    them at in the same round (``stage_blocks_rounds`` and ``replay_stage_blocks_rounds`` both list the rounds whose
    run finished); None without pipelined runs."""
    pairs = [(run, priced) for row in rows
             for run, priced in zip(row.get("stage_blocks_rounds", []), row.get("replay_stage_blocks_rounds", []))
             if run is not None and priced is not None]
    return sum(run == priced for run, priced in pairs) / len(pairs) if pairs else None


class Measured(NamedTuple):
    """One training run of a layout: its median step, the prediction of the run's own plan, and its pipeline's
    blocks per stage (autopipe's choice at start-up; None unpipelined)."""

    step_s: float
    predicted_s: float
    stage_blocks: list[int] | None = None


def _measure(layout: dict[str, Any], mode: Mode) -> Measured | str:
    """Train ``layout``, planned by its own run (only ``tensor_parallel`` is ``"auto"``, and one layout is left)."""
    merak = {"data_parallel": layout["dp"], "pipeline_parallel": layout["pp"], "tensor_parallel": "auto",
             "tp_overlap": layout["overlap"]}
    if layout["pp"] > 1:
        merak["micro_batches"] = layout["micro_batches"]
    try:
        ranks = run_distributed(_run_rank, WORLD_SIZE, args=(merak, mode.steps), timeout_s=RANK_TIMEOUT_S,
                                threads_per_rank=1)
    except DistributedRunError as error:
        return str(error).strip().splitlines()[-1]
    if ranks[0]["layout"] != layout:
        raise RuntimeError(f"the run planned {ranks[0]['layout']} instead of {layout}")
    slowest = [max(steps) for steps in zip(*(rank["step_s"] for rank in ranks))]
    return Measured(statistics.median(slowest[mode.warmup:] or slowest), ranks[0]["predicted_step_s"],
                    ranks[0]["stage_blocks"])


def _outcome(run: Measured | str) -> str:
    if isinstance(run, str):
        return f"failed: {run}"
    return f"measured {run.step_s * 1e3:.0f} ms (its own plan predicted {run.predicted_s * 1e3:.0f} ms)"


def combine_rounds(plans: list[list[dict[str, Any]]], measured: list[list[Measured | str]]) -> list[dict[str, Any]]:
    """One row per layout from every round's predictions and measurements, ranked by median predicted time per sample.

    ``plans[r]`` is round r's prediction list (any order); ``measured[r][i]`` is round r's run
    of ``plans[0][i]``'s layout, or the error text of a failed run. The components shown are
    those of the round whose prediction is the median one. The paired error is the median over
    rounds of each run's own prediction against its own steps.
    """
    keys = [_layout_key(p["layout"]) for p in plans[0]]
    by_round = [{_layout_key(p["layout"]): p for p in plan} for plan in plans]
    for round_index, plan in enumerate(by_round):
        if set(plan) != set(keys):
            raise ValueError(f"round {round_index + 1} planned other layouts than round 1: "
                             f"{sorted(set(plan) ^ set(keys))}")
    rows = []
    for index, key in enumerate(keys):
        predictions = sorted((plan[key] for plan in by_round), key=lambda p: p["step_s"])
        middle = predictions[(len(predictions) - 1) // 2]
        runs = [round_runs[index] for round_runs in measured]
        failures = [run for run in runs if isinstance(run, str)]
        done = [run for run in runs if isinstance(run, Measured)]
        step = failures[0] if failures else statistics.median(run.step_s for run in done)
        row = {"layout": key, "samples": middle["samples"],
               "predicted_s": statistics.median(p["step_s"] for p in predictions), "measured_s": step,
               "predicted_rounds_s": [plan[key]["step_s"] for plan in by_round],
               "measured_rounds_s": [run.step_s for run in done],
               "paired_predicted_rounds_s": [run.predicted_s for run in done],
               "stage_blocks_rounds": [run.stage_blocks for run in done],
               "predicted_components_s": middle["components"]}
        if isinstance(step, float):
            row["error"] = row["predicted_s"] / step - 1.0
            row["paired_error"] = statistics.median(run.predicted_s / run.step_s - 1.0 for run in done)
            row["measured_per_sample_ms"] = 1e3 * step / row["samples"]
        rows.append(row)
    return sorted(rows, key=lambda row: row["predicted_s"] / row["samples"])


def regret_of(rows: list[dict[str, Any]], predicted: str = "predicted_s") -> tuple[dict[str, Any], float | None]:
    """The layout ranked first by ``predicted`` seconds per sample and its regret: its measured time per sample over
    the best measured layout's, less one (None where the pick or every layout failed, or it has no prediction)."""
    priced = [row for row in rows if row.get(predicted) is not None]
    pick = min(priced, key=lambda row: row[predicted] / row["samples"]) if priced else rows[0]
    measured = [row for row in rows if "error" in row]
    if "error" not in pick or pick.get(predicted) is None or not measured:
        return pick, None
    best = min(row["measured_per_sample_ms"] for row in measured)
    return pick, pick["measured_per_sample_ms"] / best - 1.0


def planner_goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This run's :data:`ERROR_GOAL` (every layout; a failed one leaves no figure) and :data:`REGRET_GOAL`, from
    :func:`combine_rounds`' rows."""
    pick, regret = regret_of(rows)
    return [worst_case(ERROR_GOAL, {row["layout"]: abs(row["error"]) if "error" in row else None for row in rows}),
            worst_case(REGRET_GOAL, {pick["layout"]: regret}, note="one figure: the pick's")]


def prepare_rank_heap(default_heap: bool, environ: MutableMapping[str, str] = os.environ) -> str:
    """Give the ranks started from now on (they inherit ``environ``) the glibc tunables merak3d's launcher gives a
    user's ranks, unless ``default_heap``; what they run on, for the JSON."""
    if default_heap:
        return "glibc defaults"
    export_heap_tunables(environ)
    return environ.get("GLIBC_TUNABLES", "glibc defaults (not Linux)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and a smaller grid (under 3 minutes)")
    parser.add_argument("--out", type=Path, help=out_help("planner"))
    parser.add_argument("--default-heap", action="store_true",
                        help="run the ranks on glibc's default heap (default: the tunables merak3d's launcher "
                             "gives a user's ranks)")
    parser.add_argument("--moe", action="store_true",
                        help="instead: merak_ep's predicted vs measured step at dp2 and pp2 x dp2 "
                             "(benchmarks/_planner_moe.py; default out planner_moe[.quick].json)")
    args = parser.parse_args(argv)
    if args.default_heap and not (args.quick or args.out):
        parser.error("--default-heap runs the ranks off a user's heap: not a full run; add --out PATH (or --quick)")
    rank_heap = prepare_rank_heap(args.default_heap)  # before the forkserver the ranks are forked from starts
    if args.moe:
        from benchmarks._planner_moe import main as moe_main

        return moe_main(args.quick, args.out)
    mode = QUICK if args.quick else FULL
    started = time.perf_counter()
    print(f"planner benchmark: {WORKLOAD.describe()} per replica, {WORLD_SIZE} gloo ranks "
          f"({'quick' if args.quick else 'full'}, {mode.rounds} round{'s' * (mode.rounds > 1)})", flush=True)
    plans: list[list[dict[str, Any]]] = []
    measured: list[list[Measured | str]] = []
    replayed: list[dict[str, float]] = []
    replayed_held_out: list[dict[str, float | None]] = []
    replay_splits: list[dict[str, list[int] | None]] = []
    calibrations: list[dict[str, Any]] = []
    calibration_runs: list[list[dict[str, Any]]] = []
    for round_index in range(mode.rounds):
        plans.append(_plan(mode))
        groups = calibration_groups(plans[-1])
        print(f"  round {round_index + 1}/{mode.rounds}: planned {len(plans[-1])} layouts, picked "
              f"{_layout_key(plans[-1][0]['layout'])} ({time.perf_counter() - started:.0f} s)", flush=True)
        by_key = {_layout_key(p["layout"]): p for p in plans[-1]}
        traces: dict[str, dict[str, Trace]] = {side: {} for side in SIDES}
        runs: dict[str, Measured | str] = {}
        calibration_runs.append([])
        for group in groups if round_index % 2 == 0 else groups[::-1]:
            before = _traced_run(group.merak, group.layers)
            for key in group.layouts:
                runs[key] = _measure(by_key[key]["layout"], mode)
                print(f"  round {round_index + 1}/{mode.rounds} {key}: predicted {by_key[key]['step_s'] * 1e3:.0f} ms, "
                      f"{_outcome(runs[key])}", flush=True)
            after = _traced_run(group.merak, group.layers)
            for side, trace in zip(SIDES, (before, after)):
                traces[side][group.name] = trace
                calibration_runs[-1].append(_calibration_run(f"{group.name} {side}", trace))
        predictors = [_predictor(groups, traces[side]) for side in SIDES]
        calibrations.append([predictor.calibration.describe() for predictor in predictors])
        replayed.append(_replay_predictions(plans[-1], predictors))
        replayed_held_out.append(_held_out_replay(plans[-1], groups, traces))
        replay_splits.append(_replay_splits(plans[-1], predictors[0]))
        measured.append([runs[_layout_key(reference["layout"])] for reference in plans[0]])
    rows = combine_rounds(plans, measured)
    for row in rows:
        row["replay_predicted_rounds_s"] = [round_[row["layout"]] for round_ in replayed]
        row["replay_predicted_s"] = statistics.median(row["replay_predicted_rounds_s"])
        held_out = [round_[row["layout"]] for round_ in replayed_held_out]
        row["replay_loo_predicted_rounds_s"] = held_out
        row["replay_loo_predicted_s"] = None if None in held_out else statistics.median(held_out)  # type: ignore
        column = [_layout_key(p["layout"]) for p in plans[0]].index(row["layout"])
        row["replay_stage_blocks_rounds"] = [splits[row["layout"]] for splits, runs in zip(replay_splits, measured)
                                             if isinstance(runs[column], Measured)]  # as stage_blocks_rounds
        if "error" in row:
            row["replay_error"] = row["replay_predicted_s"] / row["measured_s"] - 1.0
            row["replay_error_rounds"] = [predicted / runs[column].step_s - 1.0 for predicted, runs in
                                          zip(row["replay_predicted_rounds_s"], measured)
                                          if isinstance(runs[column], Measured)]
            row["replay_paired_error"] = statistics.median(row["replay_error_rounds"])
            if row["replay_loo_predicted_s"] is not None:
                row["replay_loo_error"] = row["replay_loo_predicted_s"] / row["measured_s"] - 1.0
    measured_rows = [row for row in rows if "error" in row]
    best = min(measured_rows, key=lambda row: row["measured_per_sample_ms"])
    errors = [abs(row["error"]) for row in measured_rows]
    (pick, regret), (replay_pick, replay_regret) = regret_of(rows), regret_of(rows, "replay_predicted_s")
    loo_pick, loo_regret = regret_of(rows, "replay_loo_predicted_s")
    loo_errors = [abs(row["replay_loo_error"]) if "replay_loo_error" in row else None for row in measured_rows]
    goals = planner_goals(rows)
    print("\nPlanner predictions (ranked by median predicted time per sample) vs measured steps")
    print_table(
        [{"layout": r["layout"], "samples/step": r["samples"], "predicted ms": round(r["predicted_s"] * 1e3, 1),
          "measured ms": round(r["measured_s"] * 1e3, 1) if "error" in r else r["measured_s"],
          "error": f"{100 * r['error']:+.1f}%" if "error" in r else "-",
          "paired error": f"{100 * r['paired_error']:+.1f}%" if "error" in r else "-",
          "replay ms": round(r["replay_predicted_s"] * 1e3, 1),
          "replay error": f"{100 * r['replay_error']:+.1f}%" if "error" in r else "-",
          "replay paired": f"{100 * r['replay_paired_error']:+.1f}%" if "error" in r else "-",
          "ms/sample": round(r["measured_per_sample_ms"], 2) if "error" in r else "-"} for r in rows],
    )
    paired_errors = [abs(row["paired_error"]) for row in measured_rows]
    replay_errors = [abs(row["replay_error"]) for row in measured_rows]
    replay_paired_errors = [abs(row["replay_paired_error"]) for row in measured_rows]
    summary = {
        "mean_abs_replay_error": statistics.mean(replay_errors), "max_abs_replay_error": max(replay_errors),
        "replay_error_target_met": max(replay_errors) <= ERROR_TARGET,
        "mean_abs_replay_paired_error": statistics.mean(replay_paired_errors),
        "max_abs_replay_paired_error": max(replay_paired_errors),
        "replay_paired_error_target_met": max(replay_paired_errors) <= ERROR_TARGET,
        "mean_abs_error": statistics.mean(errors), "max_abs_error": max(errors),
        "mean_abs_paired_error": statistics.mean(paired_errors), "max_abs_paired_error": max(paired_errors),
        "pick": pick["layout"], "picks_per_round": [_layout_key(plan[0]["layout"]) for plan in plans],
        "best_measured": best["layout"], "regret": regret,
        "error_target_met": max(errors) <= ERROR_TARGET,
        "paired_error_target_met": max(paired_errors) <= ERROR_TARGET,
        "regret_target_met": regret is not None and regret <= REGRET_TARGET,
        "replay_pick": replay_pick["layout"], "replay_regret": replay_regret,
        "replay_split_agreement": split_agreement(rows),
        "max_abs_replay_loo_error": None if None in loo_errors else max(loo_errors),  # type: ignore[type-var]
        "replay_loo_errors": dict(zip((row["layout"] for row in measured_rows), loo_errors)),
        "replay_loo_pick": loo_pick["layout"], "replay_loo_regret": loo_regret,
    }
    print(f"prediction error: mean {100 * summary['mean_abs_error']:.1f}%, max {100 * summary['max_abs_error']:.1f}% "
          f"(target ≤ {100 * ERROR_TARGET:.0f}%: {'PASS' if summary['error_target_met'] else 'FAIL'}); "
          f"paired with each run's own plan: mean {100 * summary['mean_abs_paired_error']:.1f}%, "
          f"max {100 * summary['max_abs_paired_error']:.1f}% "
          f"({'PASS' if summary['paired_error_target_met'] else 'FAIL'})")
    print(f"regret: pick {pick['layout']} vs best measured {best['layout']}: "
          f"{100 * regret:.1f}% (target ≤ {100 * REGRET_TARGET:.0f}%: "
          f"{'PASS' if summary['regret_target_met'] else 'FAIL'})" if regret is not None else "regret: pick failed")
    print(f"replayer (traced dp2 and pp2 runs, {PROBE_LAYERS}-block tp probes, each before and after the runs it "
          f"prices): medians mean {100 * summary['mean_abs_replay_error']:.1f}%, "
          f"max {100 * summary['max_abs_replay_error']:.1f}% "
          f"({'PASS' if summary['replay_error_target_met'] else 'FAIL'}); "
          f"paired by round mean {100 * summary['mean_abs_replay_paired_error']:.1f}%, "
          f"max {100 * summary['max_abs_replay_paired_error']:.1f}% "
          f"({'PASS' if summary['replay_paired_error_target_met'] else 'FAIL'}); "
          f"its pick {replay_pick['layout']}, regret "
          + (f"{100 * replay_regret:.1f}%" if replay_regret is not None else "- (pick failed)")
          + (f"; priced pipelines at their runs' split in {100 * summary['replay_split_agreement']:.0f}% of runs"
             if summary["replay_split_agreement"] is not None else ""))
    loo_max = summary["max_abs_replay_loo_error"]
    print("replayer leave-one-layout-out (no calibration run of the layout it prices): max |error| "
          + ("-" if loo_max is None else f"{100 * loo_max:.1f}%") + ", regret "
          + ("-" if loo_regret is None else f"{100 * loo_regret:.1f}%") + " (not goals: not the default predictor)")
    print_goals(goals)
    out = write_run("planner", rows, "measured", goals, args.quick, out=args.out,
               predictions="the planner's cost model from its own profile: one planning run per round "
                           "(error), and each training run's own plan (paired_error); the trace replayer "
                           "calibrated per round on traced dp2 and pp2 runs and traced probes of each "
                           f"tensor-parallel degree and overlap ({PROBE_LAYERS} blocks), each traced right before "
                           "and again right after the measured runs it prices, each cost set anchored on the median "
                           "of its run's untraced steps after the window, the mean of the predictions calibrated "
                           "before and after; replay_error: its median over rounds against the measured median, "
                           "replay_paired_error: the median over rounds of each round's prediction against the run "
                           "it bracketed; pipelines priced at the split autopipe picks on the "
                           "calibrated costs for their micro-batches (replay_stage_blocks_rounds, against the runs' "
                           "own stage_blocks_rounds); replay_loo_*: the replayer calibrated without the runs of the "
                           "layout it prices (held_out_groups)",
               calibrations=calibrations, calibration_runs=calibration_runs, untraced_steps=UNTRACED_STEPS,
               probe_layers=PROBE_LAYERS, calibration_sides=list(SIDES), rounds=mode.rounds, rank_heap=rank_heap,
               workload=WORKLOAD.describe() + " per replica", world_size=WORLD_SIZE,
               mode="quick" if args.quick else "full", summary=summary, wall_s=time.perf_counter() - started)
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s)")
    failed = [row for row in rows if "error" not in row]
    sys.stderr.writelines(f"planner: {row['layout']} failed: {row['measured_s']}\n" for row in failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
