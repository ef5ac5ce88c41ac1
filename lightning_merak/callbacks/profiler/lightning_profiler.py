"""``Trainer(profiler=MerakTraceProfiler())``: trace a few training steps on every rank, then replay them.

Lightning calls a profiler's ``start``/``stop`` around every hook; this one skips ``skip_steps``
training batches (warm-up), records the next ``steps`` on every rank (Lightning's training step,
backward and optimizer step, pipeline chunks, blocks, every collective and point-to-point op),
then times ``untraced_steps`` more batches with nothing recorded (a clock read at each end: the steps a user's
run takes untraced, which calibrations anchor on), and, while every rank is still in the same place (after those
steps, or when training ends first), aligns the ranks' clocks by round trips,
gathers the records on rank 0 and writes there the raw trace (``<filename>.json``, for
:meth:`Trace.load`), a Perfetto/Chrome trace (``<filename>.perfetto.json``) and the last traced step's timeline
(``<filename>.timeline.png``, also logged to the trainer's loggers: :mod:`.timeline`). The summary of
the critical path and exposed communication is logged, returned by :meth:`summary` and printed by
Lightning at the end of the run. The trace's meta records the run's layout and model shape
(:func:`run_meta`), from which the layout planner calibrates (:mod:`.calibration`).

On CUDA the spans are launch times: the recorder reads the wall clock without synchronising the device, so a span
can end once its kernels are queued, before they have run (device time is :mod:`lightning_merak.util.timing`'s).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_merak.callbacks.metrics.figures import log_figure
from lightning_merak.callbacks.profiler.recorder import TraceRecorder
from lightning_merak.callbacks.profiler.timeline import FIGURE_NAME as TIMELINE_FIGURE
from lightning_merak.callbacks.profiler.timeline import traced_step_figure
from lightning_merak.distributed.process_groups import collective_device
from lightning_merak.parallel.pipeline.recording import TraceError, find_trunk
from lightning_merak.planning.replay.chrome import chrome_trace, write_chrome_trace
from lightning_merak.planning.replay.summary import summarize
from lightning_merak.planning.replay.synthesize import ModelShape
from lightning_merak.planning.replay.trace import RankTrace, Span, Trace, offset_from_round_trips

__all__ = ["MerakTraceProfiler", "estimate_clock_offsets", "model_shape", "run_meta"]

log = logging.getLogger(__name__)

_STRATEGY_HOOK = re.compile(r"^\[Strategy\]\w+\.(training_step|backward)$")
_OPTIMIZER_STEP = re.compile(r"^\[LightningModule\]\w+\.optimizer_step$")
_TRAIN_END = re.compile(r"^\[LightningModule\]\w+\.on_train_end$")


def estimate_clock_offsets(rounds: int = 8) -> list[float]:
    """Every rank's offset to rank 0's ``perf_counter`` (index = rank), by NTP-style round trips over the world group.

    Rank 0 pings each rank in turn; the round trip with the shortest network time bounds the
    error by half of it (tens of microseconds on a LAN). All ranks get the list.
    """
    world, rank, device = dist.get_world_size(), dist.get_rank(), collective_device()
    offsets = torch.zeros(world, dtype=torch.float64, device=device)
    stamp = torch.zeros(2, dtype=torch.float64, device=device)
    for peer in range(1, world):
        samples = []
        for _ in range(rounds):
            if rank == 0:
                t0 = time.perf_counter()
                dist.send(torch.tensor([t0, 0.0], dtype=torch.float64, device=device), peer)
                dist.recv(stamp, peer)
                samples.append((t0, stamp[0].item(), stamp[1].item(), time.perf_counter()))
            elif rank == peer:
                dist.recv(stamp, 0)
                t1 = time.perf_counter()
                dist.send(torch.tensor([t1, time.perf_counter()], dtype=torch.float64, device=device), 0)
        if rank == 0:
            offsets[peer] = offset_from_round_trips(samples)
    dist.broadcast(offsets, 0)
    return offsets.tolist()


def model_shape(model: torch.nn.Module, seq: int) -> Optional[ModelShape]:
    """The unsplit model's blocks, parameters and hidden size, as the replay needs them (None: no blocks found).

    Split parameters are DTensors, whose ``numel`` counts the unsplit tensor: a tensor-parallel rank counts
    the whole model too.
    """
    try:
        blocks = find_trunk(model)[1]
    except TraceError:
        return None
    block_params = sum(p.numel() for p in blocks[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    hidden = getattr(getattr(model, "config", None), "hidden_size", 0)
    return ModelShape(len(blocks), block_params, max(total - len(blocks) * block_params, 0), hidden, seq)


def run_meta(module: Any) -> dict[str, Any]:
    """The traced run's layout (merak3d's degrees, or data parallelism over every rank) and, where each rank
    holds every block (one pipeline stage), the model's shape: what calibrating the planner needs to know."""
    trainer = getattr(module, "trainer", None) if module is not None else None
    strategy = getattr(trainer, "strategy", None)
    if strategy is None:
        return {}
    if hasattr(strategy, "pipeline_parallel") and hasattr(strategy, "tensor_parallel"):
        layout = {"dp": strategy.data_parallel, "pp": strategy.pipeline_parallel, "tp": strategy.tensor_parallel,
                  "micro_batches": strategy.micro_batches or 1, "overlap": strategy.tp_overlap,
                  "cp": getattr(getattr(strategy, "layout", None), "context_parallel", 1)}
    else:
        layout = {"dp": trainer.world_size, "pp": 1, "tp": 1, "micro_batches": 1, "overlap": 1}
    meta: dict[str, Any] = {"layout": layout}
    model = getattr(module, "model", None)
    shape = model_shape(model, 0) if layout["pp"] == 1 and isinstance(model, torch.nn.Module) else None
    if shape is not None:
        meta["model"] = {"blocks": shape.blocks, "block_params": shape.block_params,
                         "other_params": shape.other_params, "hidden": shape.hidden}
    return meta


def _check_directory(dirpath: Path) -> None:
    """Refuse a ``dirpath`` that is (or lies under) an existing file: the trace would only fail to be written
    after the traced steps ran."""
    existing = next((path for path in (dirpath, *dirpath.parents) if path.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is" if existing == dirpath else f"lies under {str(existing)!r}, which is"
        raise ValueError(
            f"dirpath={str(dirpath)!r} {where} an existing file, not a directory: the trace files are written "
            "into dirpath; pass a directory (created if missing), or None for the trainer's log directory"
        )


class MerakTraceProfiler(Profiler):
    """Trace ``steps`` training steps after ``skip_steps`` on every rank; rank 0 writes and summarizes them.

    ``block_spans`` times each block of the model's largest ``ModuleList`` (one forward hook pair
    per block while recording). ``untraced_steps``: batches after the window timed without recording (a clock read
    each); the trace's meta holds each one's slowest rank (``untraced_step_s``), and the trace is written after them
    (or when training ends first; 0: right after the window). The planner's calibration anchors on their median
    (:func:`~lightning_merak.planning.replay.calibration.untraced_step_time`): a few traced steps early in a run are
    a noisy
    stand-in for its steady steps on a shared machine. The trace is written under ``dirpath`` (default: the
    trainer's log directory).
    """

    def __init__(self, dirpath: Optional[Union[str, Path]] = None, filename: str = "merak_trace",
                 skip_steps: int = 2, steps: int = 3, block_spans: bool = True, untraced_steps: int = 8) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.skip_steps, self.steps, self.block_spans = skip_steps, steps, block_spans
        self.untraced_steps = untraced_steps
        self.trace: Optional[Trace] = None
        """The gathered trace (rank 0, once written: after the window and the untraced steps)."""
        self.paths: dict[str, Path] = {}
        self._summary = ""
        self._batch = -1
        self._recorder: Optional[TraceRecorder] = None
        self._open: dict[str, list[Span]] = {}
        self._last_backward_end: Optional[float] = None
        self._finished = False
        self._recorded: Optional[RankTrace] = None
        """This rank's record once the window closed, until it is written (:meth:`_finish`)."""
        self._untraced_s: list[float] = []
        self._untraced_start: Optional[float] = None
        self._fitting = False
        """Whether a fit runs, so that teardown tells a window left unwritten (once: ``__del__`` tears down too)."""
        # last: Profiler.__del__ tears down a refused profiler too, reading the state above
        for name, count, lowest, meaning in (("steps", steps, 1, "steps traced"),
                                             ("skip_steps", skip_steps, 0, "warm-up steps before the trace"),
                                             ("untraced_steps", untraced_steps, 0, "steps timed after the trace")):
            if not isinstance(count, int) or isinstance(count, bool) or count < lowest:
                raise ValueError(f"{name}={count!r} must be an integer >= {lowest} ({meaning})")
        if dirpath is not None:
            _check_directory(Path(dirpath))

    def setup(self, stage: str, local_rank: Optional[int] = None, log_dir: Optional[str] = None) -> None:
        """Lightning's setup; for a fit whose ``max_steps`` ends before the traced window, a warning naming the fix
        (the run would otherwise end with no trace and no word)."""
        super().setup(stage, local_rank, log_dir)
        self._fitting = stage == "fit"
        trainer = getattr(getattr(self, "_lightning_module", None), "trainer", None)
        max_steps = getattr(trainer, "max_steps", -1)
        batches = max_steps * getattr(trainer, "accumulate_grad_batches", 1)  # the window counts training batches
        if self._fitting and max_steps >= 0 and batches < self.skip_steps + self.steps:
            rank_zero_warn(f"MerakTraceProfiler traces training batches {self.skip_steps} to "
                           f"{self.skip_steps + self.steps - 1} (skip_steps={self.skip_steps}, steps={self.steps}), "
                           f"but max_steps={max_steps} ends the run after {batches} batches, so no trace will be "
                           "written; lower skip_steps or steps, or raise max_steps")

    def _recording(self) -> bool:
        return self._recorder is not None

    def start(self, action_name: str) -> None:
        if action_name == "run_training_batch" and self._recorded is not None:
            self._untraced_start = time.perf_counter()
            return
        if self._recorded is not None and _TRAIN_END.match(action_name):
            self._finish()  # training ended before every untraced step was timed
            return
        if action_name == "run_training_batch":
            self._batch += 1
            if self._batch == self.skip_steps and not self._finished:
                rank = dist.get_rank() if dist.is_initialized() else 0
                self._recorder = TraceRecorder(rank, self.block_spans)
                self._recorder.install()
            if self._recorder is not None:
                self._last_backward_end = None
                self._open.setdefault(action_name, []).append(self._recorder.begin_step(self._batch - self.skip_steps))
            return
        if self._recorder is None:
            return
        match = _STRATEGY_HOOK.match(action_name)
        if match:
            category = "FW" if match.group(1) == "training_step" else "BW"
            self._open.setdefault(action_name, []).append(self._recorder.open_span(match.group(1), category))
        elif _OPTIMIZER_STEP.match(action_name):
            self._open.setdefault(action_name, []).append(self._recorder.open_span("optimizer_step", "UPDATE"))

    def stop(self, action_name: str) -> None:
        if action_name == "run_training_batch" and self._untraced_start is not None:
            self._untraced_s.append(time.perf_counter() - self._untraced_start)
            self._untraced_start = None
            if len(self._untraced_s) >= self.untraced_steps:
                self._finish()
            return
        recorder = self._recorder
        stack = self._open.get(action_name)
        if recorder is None or not stack:
            return
        span = stack.pop()
        if span.category == "UPDATE":
            # The optimizer step runs the closure (training step and backward): its own work starts after them.
            span.start = max(span.start, self._last_backward_end or span.start)
        recorder.close_span(span)
        if span.category == "BW":
            self._last_backward_end = span.end
        if action_name == "run_training_batch" and span.step == self.steps - 1:
            self._recorded = recorder.finish()
            self._recorder, self._finished = None, True
            if self.untraced_steps == 0:
                self._finish()

    def _finish(self) -> None:
        """Align clocks, gather the records and untraced step times on rank 0, write and summarize (every rank
        takes part)."""
        recorded, untraced = self._recorded, self._untraced_s
        if recorded is None:
            return
        self._recorded, self._untraced_start = None, None
        if dist.is_initialized():
            offsets = estimate_clock_offsets()
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (recorded, untraced))
            if dist.get_rank() != 0:
                return
            ranks = sorted((trace for trace, _ in gathered), key=lambda r: r.rank)
            untraced = [max(step) for step in zip(*(steps for _, steps in gathered))]
        else:
            offsets, ranks = [0.0], [recorded]
        meta = run_meta(getattr(self, "_lightning_module", None))
        if untraced:
            meta["untraced_step_s"] = untraced
        self.trace = Trace(ranks, offsets, {"skip_steps": self.skip_steps, "steps": self.steps, **meta})
        directory = Path(self.dirpath or ".")
        self.paths = {"trace": self.trace.save(directory / f"{self.filename}.json"),
                      "perfetto": write_chrome_trace(chrome_trace(self.trace),
                                                     directory / f"{self.filename}.perfetto.json")}
        self._draw_timeline(directory)
        self._summary = summarize(self.trace)
        log.info("%s", self._summary)

    def _draw_timeline(self, directory: Path) -> None:
        """Rank 0: the last traced step's timeline as ``<filename>.timeline.png``, and to the trainer's loggers."""
        if self.trace is None or not self.trace.steps():
            return
        figure = traced_step_figure(self.trace)
        self.paths["timeline"] = directory / f"{self.filename}.timeline.png"
        figure.savefig(self.paths["timeline"], dpi=110)
        trainer = getattr(getattr(self, "_lightning_module", None), "trainer", None)
        if trainer is not None:
            log_figure(trainer, TIMELINE_FIGURE, figure, trainer.global_step, already_saved=self.paths["timeline"])

    def summary(self) -> str:
        return self._summary

    def teardown(self, stage: Optional[str]) -> None:
        """Uninstall the recorder; after a fit that ended before its window was written, a warning saying so."""
        if self._fitting and not self._finished:
            rank_zero_warn(f"MerakTraceProfiler wrote no trace: training ended after {self._batch + 1} training "
                           f"batches, before the traced window (skip_steps={self.skip_steps}, steps={self.steps}) "
                           "was complete; lower skip_steps or steps, or train for more batches")
        self._fitting = False
        if self._recorder is not None:
            self._recorder.uninstall()
            self._recorder = None
        self._recorded = None  # a window that training left unwritten: its peers may be gone, no collective
        super().teardown(stage)
