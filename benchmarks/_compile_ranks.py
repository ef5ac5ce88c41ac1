"""What each rank of ``python -m benchmarks.compile`` runs: every job in order, in one process (spawned by
``lightning_merak.testing.run_distributed``), one compute thread per rank.

A job trains a randomly initialised transformers Llama (``benchmarks._scale_ranks.Workload``, seed 0, fp32, AdamW at
a constant learning rate) with merak3d at one layout, eager or with ``compile=True``, on the same token batches.
Each step is timed from its batch's start to its end (Lightning's hooks); compile counters are read after the
warm-up steps and at the end.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

from benchmarks._scale_ranks import Workload
from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.modules.config import OptimConfig, Schedule
from lightning_merak.parallel.regional_compile import compile_counts
from lightning_merak.strategies.merak3d import Merak3DStrategy


@dataclass(frozen=True)
class Job:
    """``workload`` at merak3d ``layout`` (world size 2), ``compiled`` or eager, ``steps`` steps."""

    name: str
    workload: Workload
    layout: dict[str, Any]
    compiled: bool
    steps: int
    warmup: int


class _Clock(pl.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.step_s, self.losses = warmup, [], []
        self.after_warmup = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_s.append(time.perf_counter() - self._start)
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        if batch_idx + 1 == self.warmup:
            self.after_warmup = compile_counts()


def run_job(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    workload = job.workload
    model = AutoModelForCausalLM.from_config(workload.config())
    module = CausalLMModule(model, optim=OptimConfig(learning_rate=1e-3, lr_schedule=Schedule.constant,
                                                     warmup_steps=0))
    tokens = torch.randint(workload.vocab, (job.steps, workload.global_batch, workload.seq),
                           generator=torch.Generator().manual_seed(1))
    replicas = job.layout.get("data_parallel", 1)
    shard = workload.global_batch // replicas
    index = rank % replicas
    local = tokens[:, index * shard:(index + 1) * shard].reshape(-1, workload.seq)
    clock = _Clock(job.warmup)
    strategy = Merak3DStrategy(**job.layout, compile=job.compiled, timeout_s=900)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[clock])
    start = compile_counts()
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(local), batch_size=shard))
    later = compile_counts() - clock.after_warmup
    return {"step_s": clock.step_s, "losses": clock.losses, "warmup_counts": asdict(clock.after_warmup - start),
            "later_counts": asdict(later)}


def run_jobs(rank: int, world_size: int, jobs: list[Job]) -> list[dict[str, Any]]:
    """Every job in order on this rank; an error ends the list with its line (the driver reports it)."""
    results = []
    for job in jobs:
        try:
            results.append(run_job(rank, world_size, job))
        except Exception as error:  # one failing row must not hide the others' figures
            results.append({"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"})
            break
    return results
