"""What the default metrics cost: step time with ``TrainingMetrics`` over step time without it.

Run from the repo root::

    python -m benchmarks.observability [--quick] [--out PATH]

Each configuration trains ``merak-train``'s default model (``llama_tiny``: 4 layers, hidden 128, vocabulary 256,
16 sequences of 64 tokens per rank) on 2 gloo ranks, one torch thread each, logging every 10 steps
(``merak-train``'s ``log_every_n_steps``) to a CSV logger in both arms, so the arms differ by the callback alone.
A run's step time is rank 0's wall time from the end of step ``warmup`` to the end of the last step over the
steps between (the callback's interval logging and its gather fall inside); the metrics' clock is the last
callback, so it reads after them. The arms alternate within each repetition, their order flipping from one
repetition to the next, so a drift of the machine's speed reaches both alike. Every run of a configuration is a
fresh ``Trainer`` and a freshly built model in the same rank processes (one process group), so the arms compare
on the same processes: two launches of one arm differ by up to 10% here (where each rank lands, its heap's
layout), ten times the cost being measured. Each run with the metrics also
reports ``hook_s_per_step``, rank 0's seconds per step inside the callback's per-step hooks (the interval's
gather and logging included): the cost itself, which other load on the machine moves far less than it moves
a difference of step times.

Goal ``metrics_overhead`` (issue #50, ≤ 1.02): per configuration, the median step time with the metrics over
the median without, over the repetitions; the worst configuration's (``benchmarks.goals.worst_case``). A
configuration that failed in either arm has no figure, so the goal has none.

Figures are measured on this machine (label "measured"; CPU, gloo). A failed run makes the command exit 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from benchmarks.goals import Goal, print_goals, worst_case, write_run
from benchmarks.report import error_line, out_help, print_table

MODEL = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": False}
VOCAB, SEQ, BATCH, LOG_EVERY = 256, 64, 16, 10
CONFIGS = (("DDP dp2", "ddp", 2), ("merak3d dp2", "merak3d", 2))
"""Each configuration: its name, its strategy and its ranks."""
RUN_TIMEOUT_S = 120.0
"""Seconds one run (one Trainer) may take; a configuration's ranks get this times its runs."""

METRICS_OVERHEAD = Goal(
    "metrics_overhead", 1.02, "<=",
    "llama_tiny on 2 gloo ranks (DDPStrategy; merak3d data_parallel=2), logging every 10 steps to CSV; median "
    "over >= 3 interleaved repetitions of rank 0's mean step time after warm-up with TrainingMetrics, over the "
    "median without; worst configuration", issue=50)


@dataclass(frozen=True)
class Mode:
    repetitions: int
    steps: int
    warmup: int


QUICK = Mode(repetitions=3, steps=30, warmup=10)
FULL = Mode(repetitions=5, steps=110, warmup=10)


def step_times_rank(rank: int, world_size: int, strategy_name: str, arms: list[bool], steps: int, warmup: int,
                    out: str) -> list[dict[str, float]]:
    """One run per entry of ``arms`` (whether it has the metrics), in order, each a fresh Trainer and model:
    the mean step time after ``warmup`` steps and the seconds per step spent in the metrics' hooks over the
    same steps (every rank returns its own)."""
    return [step_time(world_size, strategy_name, with_metrics, steps, warmup, f"{out}/{run}")
            for run, with_metrics in enumerate(arms)]


def step_time(world_size: int, strategy_name: str, with_metrics: bool, steps: int, warmup: int,
              out: str) -> dict[str, float]:
    """Train ``steps`` steps in this rank's process; see :func:`step_times_rank`."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.callbacks import TrainingMetrics
    from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
    from lightning_merak.modules.config import ModelConfig
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    class StepClock(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.ends.append(time.perf_counter())

    class TimedMetrics(TrainingMetrics):
        """The metrics, with the time in their per-step hooks summed from the end of step ``warmup`` on."""

        def __init__(self) -> None:
            super().__init__()
            self.hook_s = 0.0

        def _timed(self, hook: Any, *args: Any) -> None:
            start = time.perf_counter()
            hook(*args)
            if len(clock.ends) >= warmup:
                self.hook_s += time.perf_counter() - start

        def on_before_optimizer_step(self, *args: Any) -> None:
            self._timed(super().on_before_optimizer_step, *args)

        def on_train_batch_end(self, *args: Any) -> None:
            self._timed(super().on_train_batch_end, *args)

    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(name="llama_tiny", model_type="llama", config=dict(MODEL)), vocab_size=VOCAB)
    model.config.use_cache = False
    strategy = (DDPStrategy(process_group_backend="gloo") if strategy_name == "ddp"
                else Merak3DStrategy(data_parallel=world_size))
    clock = StepClock()
    metrics = TimedMetrics()
    tokens = torch.randint(VOCAB, (steps * BATCH * world_size, SEQ), generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps,
                         logger=CSVLogger(out, name=f"{strategy_name}-{with_metrics}"), log_every_n_steps=LOG_EVERY,
                         callbacks=[*([metrics] if with_metrics else []), clock],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(CausalLMModule(model), DataLoader(TensorDataset(tokens), batch_size=BATCH))
    window = clock.ends[warmup - 1:]
    return {"step_s": (window[-1] - window[0]) / (len(window) - 1), "hook_s": metrics.hook_s / (len(window) - 1)}


def measure(mode: Mode) -> list[dict[str, Any]]:
    """Every configuration in both arms, ``mode.repetitions`` times, the arms' order flipping each repetition,
    all of a configuration's runs in one set of rank processes."""
    from benchmarks.observability import step_times_rank as rank_fn  # by module name: ranks unpickle it by name
    from lightning_merak.testing import run_distributed

    order = [(repetition, with_metrics) for repetition in range(mode.repetitions)
             for with_metrics in ((False, True) if repetition % 2 == 0 else (True, False))]
    rows = []
    for name, strategy, ranks in CONFIGS:
        timed: list[Optional[dict[str, float]]] = [None] * len(order)
        error = None
        with tempfile.TemporaryDirectory(prefix="merak-observability-") as out:
            try:
                arguments = (strategy, [with_metrics for _, with_metrics in order], mode.steps, mode.warmup, out)
                timed = list(run_distributed(rank_fn, ranks, args=arguments,
                                             timeout_s=RUN_TIMEOUT_S * len(order))[0])
            except Exception as failure:  # a failed run is a result: it leaves its configuration no figure
                error = error_line(failure)
        for (repetition, with_metrics), run in zip(order, timed):
            row: dict[str, Any] = {"config": name, "metrics": with_metrics, "repetition": repetition,
                                   "step_s": None if run is None else run["step_s"],
                                   "hook_s_per_step": run["hook_s"] if run is not None and with_metrics else None,
                                   "error": error}
            print(f"  {name}, metrics {'on' if with_metrics else 'off'}, repetition {repetition}: "
                  f"{row['step_s'] if error is None else error}", flush=True)
            rows.append(row)
    return rows


def overhead_by_config(rows: Sequence[Mapping[str, Any]]) -> dict[str, Optional[float]]:
    """Per configuration: median step time with the metrics over the median without (``None`` where a run of
    either arm failed or an arm has no run)."""
    by_config: dict[str, Optional[float]] = {}
    for name in dict.fromkeys(row["config"] for row in rows):
        arms = {flag: [row for row in rows if row["config"] == name and row["metrics"] is flag]
                for flag in (False, True)}
        if any(not runs or any(row["step_s"] is None for row in runs) for runs in arms.values()):
            by_config[name] = None
            continue
        without, with_metrics = (statistics.median(row["step_s"] for row in arms[flag]) for flag in (False, True))
        by_config[name] = with_metrics / without
    return by_config


def goal_records(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [worst_case(METRICS_OVERHEAD, overhead_by_config(rows))]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    parser.add_argument("--out", type=Path, help=out_help("observability"))
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else FULL
    started = time.perf_counter()
    print(f"metrics overhead: {', '.join(name for name, _, _ in CONFIGS)}; {mode.repetitions} repetitions of "
          f"{mode.steps} steps ({mode.warmup} warm-up), logging every {LOG_EVERY}", flush=True)
    rows = measure(mode)
    goals = goal_records(rows)
    print_table(rows, ["config", "metrics", "repetition", "step_s", "hook_s_per_step", "error"])
    print_goals(goals)
    wall_s = time.perf_counter() - started
    out = write_run("observability", rows, "measured", goals, args.quick, out=args.out, benchmark="observability",
                    mode="quick" if args.quick else "full", backend="gloo", threads_per_rank=1, steps=mode.steps,
                    warmup_steps=mode.warmup, repetitions=mode.repetitions, log_every_n_steps=LOG_EVERY,
                    overhead_by_config=overhead_by_config(rows), wall_s=round(wall_s, 1))
    print(f"\nwrote {out} in {wall_s:.0f} s")
    failed = [row for row in rows if row["error"] is not None]
    for row in failed:
        print(f"observability: {row['config']} (metrics {row['metrics']}) failed: {row['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
