"""Overlapped tensor parallelism on an emulated cluster network: exposed communication and step time.

Run from the repo root, as root (the shaped links need network namespaces)::

    python -m benchmarks.overlap_tp [--quick] [--out PATH]

Every configuration trains a randomly initialised transformers Llama (built from its
config) with ``Merak3DStrategy(data_parallel=1, pipeline_parallel=1, tensor_parallel=N)``
through an ordinary ``pl.Trainer(...).fit`` on N gloo ranks, one compute thread each
(``torch.set_num_threads(1)`` and ``OMP_NUM_THREADS=MKL_NUM_THREADS=1``, which the sub-batch
threads need too), each rank in its own network namespace on a tbf-shaped veth link
(``lightning_merak.testing.netem``; this kernel has no sch_netem, so only the rate is emulated,
not latency). The same rank
processes train every variant in turn, each from the same seed on the same token batches:
plain TP (``tp_overlap=1``, ``tp_weight_grad_overlap=False``: nothing overlapped, the
baseline); the column groups' backward all-reduce overlapped with their weight gradients
(``wgrad``); sub-batch overlap (``tp_overlap=k``) with and without it; then
sequence-parallel TP (``sequence_parallel=True``: reduce-scatter and all-gather instead of
all-reduce; there ``wgrad`` hides the backward reduce-scatter), without overlap, with ``wgrad``,
and with both.

Each step is timed from Lightning's batch-start hook to its batch-end hook (optimizer step
included) and recorded with :func:`lightning_merak.distributed.collectives.record_communication`,
which times every tensor-parallel collective: ``exposed`` is the time a rank was blocked
waiting for one (including the wake-up after it completed, so under CPU contention it can
exceed ``busy``), ``busy`` the time at least one was in flight. Per configuration:

* ``step_ms``: median over the timed steps (warm-up steps dropped) of the slowest rank's step;
* ``exposed_fraction``: exposed / busy over the timed steps, of the worst rank: the share of
  communication that computation did not hide (target <= 30 %);
* ``exposed_of_step``: median exposed time per step of the worst rank / ``step_ms``;
  for the row without overlap this is ``comm_of_plain_step``, the communication share of its step;
* ``speedup``: ``step_ms`` without any overlap / this row's, both with or both without sequence
  parallelism (target >= 1.2x for overlapped rows where ``comm_of_plain_step`` >= 30 %, not
  applicable elsewhere); ``speedup_vs_plain_tp``: plain TP's (no overlap, no sequence
  parallelism) ``step_ms`` / this row's;
* ``cpu_ms_per_rank``: median CPU time of a rank process per step (all its threads, worst
  rank), and ``idle_cores``: the machine's idle core-seconds per second of step (rank 0's
  steps; 10 ms ticks): where no core is idle, hiding communication cannot shorten the step;
  ``page_faults_per_rank``: median minor page faults of a rank per step (worst rank);
* ``final_loss`` and ``loss_max_rel_diff``: the largest relative difference from plain TP's
  loss over all steps, which must stay at rounding level (the runs are equal in exact arithmetic).

Goals (issue #49): :data:`SPEEDUP_1GBIT_MAX`, as the issue set it: per world size at 1 Gbit/s, the best overlapped
variant's ``speedup_vs_plain_tp`` (non-default variants included), and beside it :data:`SPEEDUP_1GBIT_DEFAULT`, the
default variant's (:data:`DEFAULT_VARIANT`, what a user gets); each the worst world size. A full run: 12-15 min. Its
ceiling here, from plain TP's own measurements, is ``speedup_1gbit_bound``: with compute = ``step_ms - exposed_ms``
(the step while no rank waits on a collective) and comm = ``busy_ms`` (collectives in flight), perfect overlap gives
at most (compute + comm) / max(compute, comm). A second ceiling, ``cpu_bound``: no step is shorter than the ranks' CPU
time (compute and gloo's threads, ``cpu_ms_per_rank``) spread over the cores they share, so at most ``step_ms /
(cpu_ms_per_rank * ranks / min(ranks, cores))``; both use plain TP's figures, and overlap adds CPU time, so both are
upper bounds. ``speedup_1gbit_leg`` gives, per world size, the best variant, the default variant's speedup and both
bounds. Ranks start with the launcher's heap settings (``GLIBC_TUNABLES`` from
:func:`lightning_merak.distributed.host_memory.with_heap_tunables`), as a user's ranks do.

A timeline of one step of rank 0 (plain and overlapped, from the trace) is saved as a PNG
beside the JSON, with the overlapped step's Chrome/Perfetto trace. Everything here is
measured on this machine's CPU over an emulated network (JSON label "emulated"); nothing
is simulated. A second process on the machine (tests, another benchmark) skews the timings,
and with more ranks than cores the ranks take turns on the CPU, so plain TP's ranks already
compute while others wait.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import report
from benchmarks.goals import Goal, print_goals, worst_case, write_run
from lightning_merak.distributed.collectives import CommunicationTrace, record_communication
from lightning_merak.distributed.host_memory import with_heap_tunables
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig, OptimConfig
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing.cpu_quota import device_per_rank_quota, emulation_record
from lightning_merak.testing.netem import (
    EmulatedCluster,
    LinkSpec,
    LoopbackCluster,
    RankFailure,
    RankTimeout,
    emulation_available,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULT_MARKER = "OVERLAP_TP_RESULT "
RANK_TIMEOUT_S = 300.0
TARGET_EXPOSED_FRACTION = 0.30
TARGET_SPEEDUP = 1.2
SPEEDUP_APPLIES_FROM_COMM = 0.30
LOSS_RTOL = 1e-5
"""Largest relative loss difference from plain TP that counts as rounding (as in tests/test_overlap_tp.py)."""
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLIBC_TUNABLES": with_heap_tunables(os.environ)}
"""One compute thread in every thread of a rank: ``torch.set_num_threads`` in the rank's main thread does not
reach the sub-batch threads, whose OpenMP/MKL calls would otherwise start teams of the machine's size. The heap
settings are the launcher's, which every user's rank gets."""
PLOT_RANKS = 2
PLOT_RATE_MBIT = 500.0


@dataclass(frozen=True)
class Variant:
    """One training run of a cluster: sub-batches, the column groups' backward overlap, sequence parallelism."""

    tp_overlap: int
    weight_grad_overlap: bool
    sequence_parallel: bool = False

    @property
    def overlapped(self) -> bool:
        return self.tp_overlap > 1 or self.weight_grad_overlap

    @property
    def label(self) -> str:
        return (f"k={self.tp_overlap}" + (" wgrad" if self.weight_grad_overlap else "")
                + (" sp" if self.sequence_parallel else ""))


PLAIN = Variant(1, False)
PLOT_VARIANT = Variant(2, True)
"""The timeline shows rank 0's last plain and overlapped (this variant) steps of the plotted cluster."""
DEFAULT_VARIANT = Variant(1, True)
"""``Merak3DStrategy``'s defaults: ``tp_overlap=1``, ``tp_weight_grad_overlap=None`` (on outside zero bubble)."""
VARIANTS = (PLAIN, DEFAULT_VARIANT, Variant(2, False), Variant(2, True), Variant(4, True),
            Variant(1, False, True), Variant(1, True, True), Variant(2, True, True))
GOAL_RATE_MBIT = 1000.0
SPEEDUP_1GBIT_MAX = Goal(
    "speedup_1gbit_max", TARGET_SPEEDUP, ">=",
    "plain TP's step_ms / the fastest overlapped variant's (tp_overlap > 1 or weight-gradient overlap, with or "
    "without sequence parallelism), Llama hidden 256 x 4 layers, tensor_parallel = ranks, 1 Gbit/s emulated link; "
    "worst over world sizes", issue=49)
SPEEDUP_1GBIT_DEFAULT = Goal(
    "speedup_1gbit_default", TARGET_SPEEDUP, ">=",
    "plain TP's step_ms / the default variant's (Merak3DStrategy's defaults: tp_overlap=1, weight-gradient overlap "
    "on), Llama hidden 256 x 4 layers, tensor_parallel = ranks, 1 Gbit/s emulated link; worst over world sizes",
    issue=49)


@dataclass(frozen=True)
class Workload:
    """A Llama, its token batches (the same on every rank: dp = 1) and the steps it trains."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int
    batch: int
    steps: int
    warmup: int

    def model_config(self) -> ModelConfig:
        return ModelConfig(name="llama", model_type="llama", config={
            "hidden_size": self.hidden, "intermediate_size": self.hidden * 8 // 3 // 8 * 8,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads, "num_key_value_heads": self.heads,
            "tie_word_embeddings": False,
        })

    def describe(self) -> str:
        return (f"llama hidden {self.hidden}, {self.layers} layers, {self.heads} heads, vocab {self.vocab}, "
                f"seq {self.seq}, batch {self.batch}, {self.steps} steps ({self.warmup} warm-up)")


@dataclass(frozen=True)
class Mode:
    """Which configurations run: every world size x link rate, each with every variant."""

    workload: Workload
    world_sizes: tuple[int, ...]
    rates_mbit: tuple[float, ...]
    variants: tuple[Variant, ...]


MODEL = {"hidden": 256, "layers": 4, "heads": 8, "vocab": 512, "seq": 128, "batch": 8}
RATES_MBIT = (1000.0, 500.0, 200.0)
QUICK = Mode(Workload(**MODEL, steps=6, warmup=2), world_sizes=(2,), rates_mbit=RATES_MBIT, variants=VARIANTS)
FULL = Mode(Workload(**MODEL, steps=12, warmup=3), world_sizes=(2, 4), rates_mbit=RATES_MBIT, variants=VARIANTS)


def network_name(rate_mbit: float | None) -> str:
    if rate_mbit is None:
        return "loopback"
    return f"{rate_mbit / 1000:g}Gbit" if rate_mbit >= 1000 else f"{rate_mbit:g}Mbit"


# Inside a rank ---------------------------------------------------------------------------


def _quiet_lightning() -> None:
    """Keep Lightning's banners and deprecation chatter out of the rank's output."""
    warnings.filterwarnings("ignore", module="lightning")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)


def machine_idle_s() -> float:
    """Idle (and I/O-wait) time summed over the machine's cores since boot, from ``/proc/stat`` (10 ms ticks)."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = stat.readline().split()
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


class StepRecorder(pl.Callback):
    """Wall time, CPU time, loss and tensor-parallel collectives of every training step (optimizer step included).

    ``cpu_s`` is the rank process's CPU time (every thread: compute, sub-batches, gloo) and
    ``machine_idle_s`` the idle core time of the whole machine during the step: overlap can
    only hide communication behind computation while a core is free to compute.
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.last_events: list[dict[str, float]] = []
        self._recording = contextlib.ExitStack()
        self._trace: CommunicationTrace | None = None
        self._start = self._start_cpu = self._start_idle = 0.0
        self._start_faults = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._trace = self._recording.enter_context(record_communication())
        self._start_idle, self._start_cpu = machine_idle_s(), time.process_time()
        self._start_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step_s = time.perf_counter() - self._start
        cpu_s, idle_s = time.process_time() - self._start_cpu, machine_idle_s() - self._start_idle
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self._start_faults
        self._recording.close()
        trace = self._trace
        assert trace is not None
        self.steps.append({"step_s": step_s, "exposed_s": trace.exposed_s, "busy_s": trace.busy_s,
                           "collectives": len(trace.events), "loss": float(outputs["loss"]),
                           "cpu_s": cpu_s, "machine_idle_s": idle_s, "page_faults": faults})
        self.last_events = [{key: value if key in ("sub_batch", "op") else value - self._start
                             for key, value in event.items()}
                            for event in trace.events]


def _train(workload: Workload, world_size: int, variant: Variant) -> dict[str, Any]:
    """Train ``workload`` with tensor_parallel = world size and ``variant``; per-step figures of this rank."""
    torch.manual_seed(0)
    model = build_causal_lm(workload.model_config(), workload.vocab)
    module = CausalLMModule(model, OptimConfig(warmup_steps=1))
    tokens = torch.randint(workload.vocab, (workload.steps * workload.batch, workload.seq),
                           generator=torch.Generator().manual_seed(1))
    recorder = StepRecorder()
    strategy = Merak3DStrategy(data_parallel=1, pipeline_parallel=1, tensor_parallel=world_size,
                               tp_overlap=variant.tp_overlap, tp_weight_grad_overlap=variant.weight_grad_overlap,
                               sequence_parallel=variant.sequence_parallel, timeout_s=RANK_TIMEOUT_S)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=workload.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder],
    )
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(tokens), batch_size=workload.batch))
    return {**asdict(variant), "steps": recorder.steps, "last_step_events": recorder.last_events,
            "last_step_s": recorder.steps[-1]["step_s"]}


def rank_main(workload: Workload, variants: Sequence[Variant]) -> None:
    """One rank of a cluster: train every variant in turn; print the results as one JSON line.

    The launcher starts every rank itself, so Lightning is told so (``LOCAL_RANK``) and joins them.
    """
    torch.set_num_threads(1)
    _quiet_lightning()
    world_size = int(os.environ["WORLD_SIZE"])
    os.environ["LOCAL_RANK"] = os.environ["RANK"]
    results = [_train(workload, world_size, variant) for variant in variants]
    print(RESULT_MARKER + json.dumps(results), flush=True)


def rank_argv(workload: Workload, variants: Sequence[Variant]) -> list[str]:
    """Command line running :func:`rank_main` in a rank process."""
    return [sys.executable, "-m", "benchmarks.overlap_tp", "--rank", "--workload", json.dumps(asdict(workload)),
            "--variants", json.dumps([asdict(variant) for variant in variants])]


# Driver ----------------------------------------------------------------------------------


def parse_rank_output(stdout: str) -> list[dict[str, Any]]:
    """The results a rank printed (the last line carrying RESULT_MARKER)."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        raise ValueError(f"rank printed no line starting with {RESULT_MARKER!r}; stdout tail:\n{stdout[-2000:]}")
    return json.loads(lines[-1][len(RESULT_MARKER):])


def check_configuration(workload: Workload, world_size: int, variants: Sequence[Variant]) -> None:
    """Refuse, before any rank starts, a configuration the strategy would reject or the report could not judge."""
    if not variants or variants[0] != PLAIN:
        raise ValueError(f"variants must start with {PLAIN} (plain TP, the baseline), got {tuple(variants)}")
    sequence = [variant for variant in variants if variant.sequence_parallel]
    if sequence and Variant(1, False, True) not in sequence:
        raise ValueError("sequence-parallel variants need Variant(1, False, True), their baseline without overlap")
    if sequence and workload.seq % world_size:
        raise ValueError(f"{world_size} ranks do not divide seq={workload.seq}, which sequence parallelism splits; "
                         "change the sequence length")
    for variant in variants:
        if workload.batch % variant.tp_overlap:
            raise ValueError(f"tp_overlap={variant.tp_overlap} does not divide the batch of {workload.batch}; "
                             "choose divisors of it")
    intermediate = workload.hidden * 8 // 3 // 8 * 8
    for name, value in (("heads", workload.heads), ("hidden", workload.hidden), ("intermediate", intermediate)):
        if value % world_size:
            raise ValueError(f"{world_size} ranks (tensor_parallel) do not divide {name}={value}; change the model")
    if workload.steps <= workload.warmup:
        raise ValueError(f"steps={workload.steps} must exceed warmup={workload.warmup}")


def measure(world_size: int, rate_mbit: float | None, workload: Workload,
            variants: Sequence[Variant]) -> list[list[dict[str, Any]]]:
    """Run one cluster (loopback when ``rate_mbit`` is None); results per rank, per variant."""
    check_configuration(workload, world_size, variants)
    quota = device_per_rank_quota(world_size)  # one device per rank at more ranks than cores
    cluster = (LoopbackCluster(world_size, cpu_quota=quota) if rate_mbit is None
               else EmulatedCluster(world_size, LinkSpec(rate_mbit=rate_mbit), cpu_quota=quota))
    with cluster:
        results = cluster.run(rank_argv(workload, variants), timeout_s=RANK_TIMEOUT_S, extra_env=RANK_ENV,
                              cwd=REPO_ROOT)
    return [parse_rank_output(result.stdout) for result in results]


def _relative_difference(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-30)


def summarise(world_size: int, network: str, ranks: Sequence[Sequence[dict[str, Any]]],
              warmup: int) -> list[dict[str, Any]]:
    """Report rows of one cluster from its ranks' results, plain TP (the first variant) first.

    Every sequence-parallel variant needs the sequence-parallel run without overlap as its baseline.
    """
    rows: list[dict[str, Any]] = []
    for per_rank in zip(*ranks):
        timed = [rank["steps"][warmup:] for rank in per_rank]
        slowest = [max(step["step_s"] for step in steps) for steps in zip(*timed)]
        step_s = statistics.median(slowest)
        exposed_fraction = max(
            sum(step["exposed_s"] for step in steps) / max(sum(step["busy_s"] for step in steps), 1e-30)
            for steps in timed
        )
        exposed_s = max(statistics.median(step["exposed_s"] for step in steps) for steps in timed)
        busy_s = max(statistics.median(step["busy_s"] for step in steps) for steps in timed)
        losses = [step["loss"] for step in per_rank[0]["steps"]]
        cpu_s = max(statistics.median(step["cpu_s"] for step in steps) for steps in timed)
        idle_cores = (sum(step["machine_idle_s"] for step in timed[0])
                      / max(sum(step["step_s"] for step in timed[0]), 1e-30))
        rows.append({
            "ranks": world_size, "network": network, "tp_overlap": per_rank[0]["tp_overlap"],
            "weight_grad_overlap": per_rank[0]["weight_grad_overlap"],
            "sequence_parallel": per_rank[0]["sequence_parallel"],
            "step_ms": step_s * 1e3, "exposed_ms": exposed_s * 1e3, "busy_ms": busy_s * 1e3,
            "exposed_fraction": exposed_fraction, "exposed_of_step": exposed_s / step_s,
            "collectives_per_step": per_rank[0]["steps"][-1]["collectives"],
            "cpu_ms_per_rank": cpu_s * 1e3, "idle_cores": idle_cores,
            "page_faults_per_rank": max(statistics.median(step["page_faults"] for step in steps) for steps in timed),
            "final_loss": losses[-1], "losses": losses, "timed_steps": len(slowest),
        })
    plain = rows[0]
    unoverlapped = {row["sequence_parallel"]: row for row in rows
                    if row["tp_overlap"] == 1 and not row["weight_grad_overlap"]}
    for row in rows:
        baseline = unoverlapped[row["sequence_parallel"]]
        row["comm_of_plain_step"] = baseline["exposed_of_step"]
        row["speedup"] = baseline["step_ms"] / row["step_ms"]
        row["speedup_vs_plain_tp"] = plain["step_ms"] / row["step_ms"]
        row["loss_max_rel_diff"] = max(_relative_difference(value, reference)
                                       for value, reference in zip(row["losses"], plain["losses"]))
        row.update(judge(row))
    return rows


def judge(row: dict[str, Any]) -> dict[str, str]:
    """PASS/FAIL of a row against the issue's targets ("-" for plain TP, "n/a" where none applies).

    Rows without overlap are judged on equal losses only.
    """
    loss_equal = "PASS" if row["loss_max_rel_diff"] <= LOSS_RTOL else "FAIL"
    if row["tp_overlap"] == 1 and not row["weight_grad_overlap"]:
        return {"exposed_target": "-", "speedup_target": "-",
                "loss_equal": loss_equal if row["sequence_parallel"] else "-"}
    exposed = "PASS" if row["exposed_fraction"] <= TARGET_EXPOSED_FRACTION else "FAIL"
    if row["comm_of_plain_step"] < SPEEDUP_APPLIES_FROM_COMM:
        speedup = "n/a"
    else:
        speedup = "PASS" if row["speedup"] >= TARGET_SPEEDUP else "FAIL"
    return {"exposed_target": exposed, "speedup_target": speedup, "loss_equal": loss_equal}


def failed_rows(world_size: int, network: str, variants: Sequence[Variant], error: Exception) -> list[dict[str, Any]]:
    """Rows of a cluster that did not finish, with the line that says why."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((line for line in reversed(lines) if "Error" in line), lines[0] if lines else type(error).__name__)
    return [{"ranks": world_size, "network": network, **asdict(variant), "error": reason} for variant in variants]


def row_variant(row: dict[str, Any]) -> Variant:
    return Variant(row["tp_overlap"], row["weight_grad_overlap"], row["sequence_parallel"])


def overlap_bound(plain: dict[str, Any]) -> float:
    """The most any overlap can speed up plain TP's step: (compute + comm) / max(compute, comm).

    Compute is the part of the step no rank waited on a collective; comm is the time collectives were in flight.
    """
    compute_ms, comm_ms = plain["step_ms"] - plain["exposed_ms"], plain["busy_ms"]
    return (compute_ms + comm_ms) / max(compute_ms, comm_ms, 1e-30)


def cpu_bound(plain: dict[str, Any], cores: int) -> float:
    """The most any overlap can speed up plain TP's step when the ranks' CPU time is all that remains."""
    ranks = plain["ranks"]
    return plain["step_ms"] / max(plain["cpu_ms_per_rank"] * ranks / min(ranks, cores), 1e-30)


def speedup_goals(rows: Sequence[dict[str, Any]], cores: int
                  ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """:data:`SPEEDUP_1GBIT_MAX` and :data:`SPEEDUP_1GBIT_DEFAULT` over the world sizes at 1 Gbit/s (a world size
    whose cluster failed has no figure, so neither goal has one), and per world size its variants and bounds."""
    network = network_name(GOAL_RATE_MBIT)
    clusters: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["network"] == network:
            clusters.setdefault(f"{row['ranks']} ranks, {network}", []).append(row)
    best_by_size: dict[str, float | None] = {}
    default_by_size: dict[str, float | None] = {}
    leg: dict[str, dict[str, Any]] = {}
    for name, cluster in clusters.items():
        if any("error" in row for row in cluster):
            best_by_size[name] = default_by_size[name] = None
            leg[name] = {"error": cluster[0]["error"]}
            continue
        by_variant = {row_variant(row): row for row in cluster}
        fastest = max((row for row in cluster if row_variant(row).overlapped),
                      key=lambda row: row["speedup_vs_plain_tp"])
        plain = by_variant[PLAIN]
        default = by_variant.get(DEFAULT_VARIANT)
        best_by_size[name] = fastest["speedup_vs_plain_tp"]
        default_by_size[name] = None if default is None else default["speedup_vs_plain_tp"]
        leg[name] = {"best_variant": row_variant(fastest).label, "best_speedup": fastest["speedup_vs_plain_tp"],
                     "default_variant": DEFAULT_VARIANT.label, "default_speedup": default_by_size[name],
                     "compute_ms": plain["step_ms"] - plain["exposed_ms"], "comm_ms": plain["busy_ms"],
                     "bound": overlap_bound(plain), "cpu_ms_per_rank": plain["cpu_ms_per_rank"],
                     "cpu_bound": cpu_bound(plain, cores), "idle_cores": plain["idle_cores"]}
    ceilings = {name: (entry["bound"], entry["cpu_bound"]) for name, entry in leg.items() if "bound" in entry}
    note = "; ".join(f"{name}: ceiling {bound:.3g}x from compute/comm, {cpu:.3g}x from CPU time"
                     for name, (bound, cpu) in ceilings.items()) or None
    return [worst_case(SPEEDUP_1GBIT_MAX, best_by_size, note=note),
            worst_case(SPEEDUP_1GBIT_DEFAULT, default_by_size, note=note)], leg


def plot_steps(plain_events: list[dict[str, float]], plain_step_s: float, overlapped_events: list[dict[str, float]],
               overlapped_step_s: float, path: Path, title: str) -> Path:
    """Rank 0's last plain and overlapped steps on one time axis: wire lane and sub-batch lanes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    wire, wait = "#4c72b0", "#c44e52"
    panels = [("plain TP (tp_overlap=1, no weight-gradient overlap)", plain_events, plain_step_s),
              (f"overlapped TP ({PLOT_VARIANT.label})", overlapped_events, overlapped_step_s)]
    figure = Figure(figsize=(12.0, 5.5))
    FigureCanvasAgg(figure)
    axes_list = figure.subplots(2, 1, sharex=True)
    for axes, (label, events, step_s) in zip(axes_list, panels):
        lanes = sorted({int(event["sub_batch"]) for event in events})
        rows = {lane: len(lanes) - position for position, lane in enumerate(lanes)}
        for event in events:
            in_flight = (event["launch"] * 1e3, (event["complete"] - event["launch"]) * 1e3)
            blocked = (event["wait_start"] * 1e3, (event["wait_end"] - event["wait_start"]) * 1e3)
            axes.broken_barh([in_flight], (len(lanes) + 0.6, 0.8), facecolors=wire, alpha=0.5, edgecolors="none")
            axes.broken_barh([blocked], (rows[int(event["sub_batch"])] - 0.4, 0.8), facecolors=wait,
                             edgecolors="none")
        axes.axvline(step_s * 1e3, color="black", linewidth=1)
        axes.set_yticks([len(lanes) + 1, *rows.values()], ["wire", *(f"sub-batch {lane}" for lane in rows)])
        exposed = sum(event["wait_end"] - event["wait_start"] for event in events)
        axes.set_title(f"{label}: step {step_s * 1e3:.0f} ms, exposed waits {exposed * 1e3:.0f} ms", fontsize=10)
    axes_list[-1].set_xlabel("time since the step started (ms); black line: step end")
    legend = [Patch(color=wire, alpha=0.5, label="collective in flight"),
              Patch(color=wait, label="exposed wait (blocked on it)")]
    axes_list[0].legend(handles=legend, loc="upper right", fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=110)
    return path


COLUMNS = ["ranks", "network", "tp_overlap", "weight_grad_overlap", "sequence_parallel", "step_ms", "exposed_ms",
           "busy_ms", "exposed_fraction", "exposed_of_step", "comm_of_plain_step", "speedup", "speedup_vs_plain_tp",
           "cpu_ms_per_rank", "idle_cores", "page_faults_per_rank", "final_loss", "loss_max_rel_diff",
           "exposed_target", "speedup_target", "loss_equal", "error"]


def main(argv: Sequence[str] | None = None) -> int:
    """Benchmark entry point; exit status 0 when every configuration ran with equal losses, 1 otherwise,
    2 when the host cannot emulate the network."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"2 ranks only, {QUICK.workload.steps} steps per run (under 3 minutes)")
    parser.add_argument("--out", type=Path, help=report.out_help("overlap_tp"))
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--variants", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        rank_main(Workload(**json.loads(args.workload)), [Variant(**fields) for fields in json.loads(args.variants)])
        return 0
    result_path = args.out or report.default_out("overlap_tp", args.quick)

    if not emulation_available():
        return 2
    mode = QUICK if args.quick else FULL
    workload = mode.workload
    for world_size in mode.world_sizes:
        check_configuration(workload, world_size, mode.variants)
    started = time.monotonic()
    print(f"{workload.describe()}; variants {', '.join(variant.label for variant in mode.variants)}; "
          f"emulated links {mode.rates_mbit} Mbit/s", flush=True)
    rows: list[dict[str, Any]] = []
    step_events: dict[tuple[int, str, Variant], tuple[list[dict[str, Any]], float]] = {}
    for world_size in mode.world_sizes:
        for rate in mode.rates_mbit:
            network = network_name(rate)
            run_started = time.monotonic()
            try:
                ranks = measure(world_size, rate, workload, mode.variants)
            except (RankFailure, RankTimeout, ValueError) as error:
                rows += failed_rows(world_size, network, mode.variants, error)
                print(f"  {world_size} ranks, {network}: failed ({error.__class__.__name__})", flush=True)
                continue
            cluster_rows = summarise(world_size, network, ranks, workload.warmup)
            rows += cluster_rows
            for variant, result in zip(mode.variants, ranks[0]):
                step_events[(world_size, network, variant)] = (result["last_step_events"], result["last_step_s"])
            steps = ", ".join(f"{variant.label} {row['step_ms']:.0f} ms"
                              for variant, row in zip(mode.variants, cluster_rows))
            print(f"  {world_size} ranks, {network}: {steps} ({time.monotonic() - run_started:.0f} s)", flush=True)

    print(f"\nOverlapped vs plain tensor parallelism (emulated network, measured; {workload.describe()})")
    report.print_table(rows, COLUMNS)
    print(f"targets: exposed_fraction <= {TARGET_EXPOSED_FRACTION:.0%}; speedup >= {TARGET_SPEEDUP}x where "
          f"comm_of_plain_step >= {SPEEDUP_APPLIES_FROM_COMM:.0%} (overlapped rows); losses equal to plain TP "
          f"within {LOSS_RTOL:g}; speedup is against the same mode (with or without sequence parallelism) without "
          "any overlap (tp_overlap=1, weight_grad_overlap=False)")

    timeline = result_path.with_name(f"{result_path.stem}_timeline.png")
    chrome = result_path.with_name(f"{result_path.stem}_trace.json")
    network = network_name(PLOT_RATE_MBIT)
    plotted = all((PLOT_RANKS, network, variant) in step_events for variant in (PLAIN, PLOT_VARIANT))
    if plotted:
        plain, overlapped = (step_events[(PLOT_RANKS, network, variant)] for variant in (PLAIN, PLOT_VARIANT))
        plot_steps(*plain, *overlapped, timeline,
                   f"rank 0 of {PLOT_RANKS}, {network} emulated link, last training step (measured)")
        chrome.write_text(json.dumps(CommunicationTrace(events=overlapped[0]).chrome_trace()) + "\n")
    wall_s = round(time.monotonic() - started, 1)
    targets = {"exposed_fraction_max": TARGET_EXPOSED_FRACTION, "speedup_min": TARGET_SPEEDUP,
               "speedup_applies_from_comm_of_plain_step": SPEEDUP_APPLIES_FROM_COMM, "loss_rtol": LOSS_RTOL}
    goals, leg = speedup_goals(rows, len(os.sched_getaffinity(0)))
    print_goals(goals)
    bounds = [entry["bound"] for entry in leg.values() if "bound" in entry]
    out = write_run(
        "overlap_tp", rows, "emulated", goals, quick=args.quick, out=args.out, benchmark="overlap_tp",
        backend="gloo", threads_per_rank=1, rank_env=RANK_ENV, workload=asdict(workload),
        default_variant=DEFAULT_VARIANT.label, speedup_1gbit_bound=min(bounds, default=None),
        rank_cpu={n: emulation_record(device_per_rank_quota(n), n) for n in mode.world_sizes}, speedup_1gbit_leg=leg,
        layout="data_parallel=1, pipeline_parallel=1, tensor_parallel=ranks", targets=targets,
        network_note="tbf rate shaping on veth links; no latency emulation (no sch_netem)",
        timeline_png=timeline.name if plotted else None, chrome_trace=chrome.name if plotted else None,
        gpu_leg="not run: this benchmark's runs are CPU/gloo on an emulated network", wall_s=wall_s,
    )
    print(f"wrote {out}" + (f", {timeline.name} and {chrome.name}" if plotted else "") + f" in {wall_s:.0f} s")
    failed = any("error" in row or row.get("loss_equal") == "FAIL" for row in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
