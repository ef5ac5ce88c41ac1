"""The planner leg's jobs on one rank of ``python -m benchmarks.context_parallel``: plan context parallelism the way
a user's ``context_parallel="auto"`` run does, then train every layout it weighed, each through ``pl.Trainer``.

Both run :class:`~lightning_merak.strategies.merak3d.Merak3DStrategy` on the Llama of
:class:`~benchmarks._context_parallel_ranks.Workload` (fresh from seed 0), on the same token batches (seed 1, a
global batch of ``Job.batch`` sequences split over the layout's batch replicas, each replica's context ranks
reading the same ones), with ``CausalLMModule``'s AdamW:

* ``plan``: ``context_parallel="auto"`` and ``plan_only=True``, every other option at its default (pipeline and
  tensor parallel 1, no sharding, no recompute): the strategy profiles this model, batch and network on these
  ranks and ranks every context degree dividing the world with ``ring`` and ``all_to_all`` where the heads allow
  it, the remaining ranks data-parallel. The job returns the ranking (each layout's predicted step and the
  samples it is predicted for) and the layouts refused for memory, with the planner's reason;
* ``merak3d``: one of those layouts fixed (``context_parallel`` and ``context_attention`` given,
  ``data_parallel`` what they leave), trained ``Job.steps`` steps, each timed on every rank from a barrier before
  the batch to the end of its optimizer step. A layout the last plan refused for memory is not trained: the
  job returns the refusal.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import replace
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from benchmarks._context_parallel_ranks import MERAK3D, PLAN, Job, Workload, token_batches

PLANNED_TIMEOUT_S = 1800.0
LOSS_METRIC = "train/loss"
"""``CausalLMModule`` logs it with ``sync_dist``: the mean over the ranks."""


class _GlobalBatches(pl.LightningDataModule):
    """Each batch replica reads its slice of every global batch of ``batch`` sequences; the context ranks of one
    replica the same slice (the strategy splits each sequence). While the strategy reads its planning batch it
    reports one replica, which gets the whole global batch."""

    def __init__(self, workload: Workload, seq: int, batch: int, steps: int) -> None:
        super().__init__()
        self.tokens = token_batches(replace(workload, batch=batch), seq, steps)

    def train_dataloader(self) -> DataLoader:
        sampler = self.trainer.strategy.distributed_sampler_kwargs
        replicas, rank = sampler["num_replicas"], sampler["rank"]
        local = self.tokens.shape[1] // replicas
        mine = self.tokens[:, rank * local:(rank + 1) * local].reshape(-1, self.tokens.shape[-1])
        return DataLoader(TensorDataset(mine), batch_size=local, shuffle=False)


class _StepClock(pl.Callback):
    """Each step's wall time from a barrier of every rank before the batch to the end of its optimizer step, and
    the logged loss."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        dist.barrier()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step_s = time.perf_counter() - self._start
        self.steps.append({"step_s": step_s, "loss": float(trainer.callback_metrics[LOSS_METRIC])})


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _fit(workload: Workload, job: Job, steps: int, callbacks: list[pl.Callback], **strategy: Any) -> Any:
    """Fit the workload's Llama through merak3d with ``strategy``'s options; the trainer's strategy."""
    from transformers import AutoModelForCausalLM

    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.modules.config import OptimConfig
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    _quiet()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(workload.config())
    module = CausalLMModule(model, OptimConfig(learning_rate=workload.lr, warmup_steps=1))
    trainer = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(),
                         strategy=Merak3DStrategy(**strategy, timeout_s=PLANNED_TIMEOUT_S), max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         use_distributed_sampler=False, callbacks=callbacks)
    trainer.fit(module, datamodule=_GlobalBatches(workload, job.seq, job.batch, steps))
    return trainer.strategy


def layout_entry(layout: Any) -> dict[str, Any]:
    """A planner layout's degrees: batch replicas, context degree and method."""
    return {"dp": layout.dp, "cp": layout.cp, "method": layout.context_attention if layout.cp > 1 else None}


def run_plan(workload: Workload, job: Job) -> dict[str, Any]:
    """Plan ``context_parallel="auto"`` on this model, batch and network; the ranking and the refusals."""
    started = time.perf_counter()
    strategy = _fit(workload, job, 1, [], context_parallel="auto", plan_only=True)
    plan = strategy.layout_plan
    ranked = [{**layout_entry(p.layout), "step_s": p.step_time_s, "samples": p.samples_per_step,
               "time_per_sample_s": p.time_per_sample_s, "memory_bytes": p.memory_bytes,
               "components": dict(p.components), "other_degrees": p.layout.describe()} for p in plan.ranked]
    rejected = [{**layout_entry(layout), "reason": reason} for layout, reason in plan.rejected]
    chosen = strategy.layout
    return {"method": PLAN, "seq": job.seq, "batch": job.batch, "ranked": ranked, "rejected": rejected,
            "chosen": {"cp": chosen.context_parallel,
                       "method": chosen.context_attention if chosen.context_parallel > 1 else None},
            "plan_s": time.perf_counter() - started}


def run_merak3d(workload: Workload, job: Job, rejected: Optional[list[dict[str, Any]]]) -> dict[str, Any]:
    """Train the layout ``job`` fixes, or return the memory refusal the last plan (``rejected``) gave it."""
    cp, method = job.context_parallel, job.context_attention
    result: dict[str, Any] = {"method": MERAK3D, "seq": job.seq, "batch": job.batch, "cp": cp,
                              "context_attention": method}
    refusal = next((entry["reason"] for entry in rejected or []
                    if entry["cp"] == cp and (cp == 1 or entry["method"] == method)), None)
    if refusal is not None:
        return {**result, "refused": f"the planner refused it for memory: {refusal}"}
    clock = _StepClock()
    strategy = _fit(workload, job, job.steps, [clock], context_parallel=cp, context_attention=method or "ring")
    layout = strategy.layout
    return {**result, "steps": clock.steps, "replicas": strategy.data_parallel,
            "layout": {"context_parallel": layout.context_parallel, "context_attention": layout.context_attention,
                       "data_parallel": layout.data_parallel, "pipeline_parallel": layout.pipeline_parallel,
                       "tensor_parallel": layout.tensor_parallel}}
