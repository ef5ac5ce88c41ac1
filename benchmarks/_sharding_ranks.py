"""What one rank of ``python -m benchmarks.sharding`` runs: a list of jobs, one after another, in one process.

The driver starts every rank of a cluster with ``python -m benchmarks._sharding_ranks JOBS OUT_DIR``
(``JOBS`` a JSON file of :class:`Job` entries). Each rank runs the jobs in order and writes one
result file per job, ``OUT_DIR/<index>-<rank>.json``, as soon as it has it, so a failure loses
only the job that failed (the driver restarts the cluster on the jobs after it).

Running a cluster's jobs in one process saves the imports of a fresh process per job (about
ten seconds on two cores with four ranks). Memory is measured per job all the same: before each
job the rank collects garbage, returns free heap pages to the system (glibc ``malloc_trim``) and
resets its peak resident size (``/proc/self/clear_refs``); a job's figure is ``VmHWM`` at its end
minus ``VmRSS`` at its start. What a kind of job sets up once per process (lazy imports, DeepSpeed's
accelerator) is left to a short warm-up job of that kind, run first and not reported.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from transformers import AutoModelForCausalLM

from benchmarks._scale_ranks import Workload, _holdings, _quiet, _TokenData
from benchmarks.merak3d import FullyShardedLM
from benchmarks.report import proc_status_mb
from lightning_merak.distributed.deepspeed_comm import init_deepspeed_comm
from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.modules.config import OptimConfig
from lightning_merak.parallel.data.skipped_communication import gradient_communication_skipped

RANK_TIMEOUT_S = 300.0
NO_CLIPPING = 0.0
"""DeepSpeed's ``gradient_clipping`` for its baselines: DeepSpeed clips at 1.0 by default, the Lightning runs (merak3d,
DDP, FSDP2) at their default do not, so none clips; all run in fp32 (DeepSpeed's default without fp16/bf16)."""
LOSS_METRIC = "train/loss"
"""Logged with ``sync_dist``: the global batch's loss on every rank, whatever the layout."""


@dataclass(frozen=True)
class Job:
    """One training run on every rank of the cluster.

    ``kind``: ``merak3d`` (with ``mode`` its ``data_parallel_sharding``, ``layout`` its degrees, ``auto`` where
    planned, and ``recompute``), ``ddp`` (Lightning's DDPStrategy), ``fsdp2`` (Lightning's ModelParallelStrategy,
    ``fully_shard`` per decoder layer; ``checkpointing``: transformers' gradient checkpointing on every decoder
    layer) or ``zero`` (DeepSpeed ZeRO stage ``stage`` through ``deepspeed.initialize``, fp32, no clipping: the
    others do not clip). ``bucket_mb``: the gradient bucket (merak3d's ``grad_bucket_mb``, DDP's ``bucket_cap_mb``,
    DeepSpeed's reduce bucket); ``None`` leaves each at its own default. ``skip_grad_comm`` runs merak3d's step with
    its gradient collectives removed (``gradient_communication_skipped``).
    ``meta_init`` builds no whole model on any rank (merak3d: ``configure_model``; FSDP2:
    ``init_module(empty_init=True)``); otherwise every rank builds the same seeded model, so losses compare.
    ``ladder`` (decoder layers, ascending) turns the job into a search: the largest rung whose worst
    rank stays within ``cap_mb`` above its baseline, by bisection (a planned merak3d layout gets ``cap_mb`` as its
    ``memory_limit``).
    """

    name: str
    kind: str
    workload: dict[str, int]
    steps: int
    mode: str = "none"
    layout: dict[str, int | str] = field(default_factory=dict)
    overlap: bool = True
    param_gather_overlap: Optional[bool] = None
    bucket_mb: Optional[float] = None
    skip_grad_comm: bool = False
    recompute: str = "none"
    checkpointing: bool = False
    stage: int = 0
    meta_init: bool = False
    ladder: tuple[int, ...] = ()
    cap_mb: float = 0.0


# Memory ------------------------------------------------------------------------------------


def _reset_memory() -> float:
    """Release what earlier jobs left and restart the peak count; the resident size now (MiB)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return proc_status_mb("VmRSS")


def _storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct local storages behind ``tensors`` (a gradient view of a flat buffer counts the buffer)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _storage_bytes(value for state in optimizer.state.values() for value in state.values()
                          if isinstance(value, torch.Tensor))


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


class _Recorder(pl.Callback):
    """Per step: wall time, the global loss, and the gradient bytes alive when the optimizer steps."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.losses: list[float] = []
        self.grad_bytes = 0
        self._start = 0.0

    @contextlib.contextmanager
    def watching(self, module: nn.Module) -> Iterator[None]:
        """Inside: count gradients right before every optimizer step (after the strategy reduced them). A global
        hook, because a strategy may build its optimizer late (merak3d on its first batch) or wrap it (DeepSpeed)."""
        def count(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            grads = [p.grad for p in [*module.parameters(), *_optimizer_params(optimizer)]]
            self.grad_bytes = max(self.grad_bytes, _storage_bytes(grads))

        handle = register_optimizer_step_pre_hook(count)
        try:
            yield
        finally:
            handle.remove()

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.step_s.append(time.perf_counter() - self._start)
        self.losses.append(float(trainer.callback_metrics[LOSS_METRIC]))


# Jobs --------------------------------------------------------------------------------------


def strategy_for(job: Job, world_size: int) -> Any:
    """The Lightning strategy ``job`` trains with on ``world_size`` ranks."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_merak.strategies.merak3d import Merak3DStrategy

    if job.kind == "merak3d":
        planned = "auto" in job.layout.values()
        return Merak3DStrategy(**job.layout, timeout_s=RANK_TIMEOUT_S,
                               data_parallel_sharding=job.mode, overlap_grad_reduce=job.overlap,
                               overlap_param_gather=job.param_gather_overlap, grad_bucket_mb=job.bucket_mb,
                               recompute=job.recompute, memory_limit=job.cap_mb * 2**20 if planned else None)
    if job.kind == "ddp":
        buckets = {} if job.bucket_mb is None else {"bucket_cap_mb": job.bucket_mb}
        return DDPStrategy(timeout=timedelta(seconds=RANK_TIMEOUT_S), **buckets)
    if job.kind == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1,
                                     timeout=timedelta(seconds=RANK_TIMEOUT_S))
    raise ValueError(f"unknown job kind {job.kind!r}")


def _checkpointed(model: nn.Module, job: Job) -> nn.Module:
    """``model`` with transformers' gradient checkpointing on every decoder layer when ``job`` asks for it (what a
    Lightning user of FSDP2 turns on to fit a larger model)."""
    if job.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _lightning_job(job: Job, workload: Workload) -> dict[str, Any]:
    """Fit ``job`` through ``pl.Trainer``; its steps, losses and what this rank holds."""
    torch.manual_seed(0)
    optim = OptimConfig(warmup_steps=1)
    recorder = _Recorder()
    world_size = dist.get_world_size()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy_for(job, world_size),
                         max_steps=job.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         use_distributed_sampler=False, callbacks=[recorder])
    config = workload.config()
    if job.meta_init and job.kind == "merak3d":
        module: CausalLMModule = CausalLMModule(None, optim,
                                                model_factory=lambda: AutoModelForCausalLM.from_config(config))
    elif job.meta_init and job.kind == "fsdp2":
        with trainer.init_module(empty_init=True):
            module = FullyShardedLM(_checkpointed(AutoModelForCausalLM.from_config(config), job), optim)
    else:
        model = _checkpointed(AutoModelForCausalLM.from_config(config), job)
        module = (FullyShardedLM if job.kind == "fsdp2" else CausalLMModule)(model, optim)
    skipping = gradient_communication_skipped() if job.skip_grad_comm else contextlib.nullcontext()
    with recorder.watching(module), skipping:
        trainer.fit(module, datamodule=_TokenData(workload, job.steps))
    named = list(module.model.named_parameters())
    strategy = trainer.strategy
    stats = getattr(strategy, "reduction_stats", None)
    result = {"step_s": recorder.step_s, "losses": recorder.losses, "grad_bytes": recorder.grad_bytes,
              "param_bytes": _storage_bytes(p for _, p in named),
              "optimizer_bytes": _optimizer_state_bytes(trainer.optimizers[0]),
              "reduction_stats": dict(stats) if stats else None, **_holdings(named)}
    replicas = strategy.distributed_sampler_kwargs["num_replicas"]
    if job.kind == "merak3d":
        layout = strategy.layout
        result.update(pipeline_rank=strategy.pipeline_rank, pipeline_parallel=strategy.pipeline_parallel,
                      data_parallel=strategy.data_parallel, micro_batches=strategy.micro_batches,
                      plan={"pipeline_parallel": layout.pipeline_parallel, "data_parallel": layout.data_parallel,
                            "tensor_parallel": layout.tensor_parallel, "micro_batches": layout.micro_batches,
                            "sharding": layout.data_parallel_sharding, "recompute": layout.recompute})
    else:
        result.update(pipeline_rank=0, pipeline_parallel=1, data_parallel=replicas, micro_batches=1)
    result["local_batch"] = workload.global_batch // replicas
    return result


def deepspeed_config(job: Job, local_batch: int) -> dict[str, Any]:
    """DeepSpeed's config for ``job``: fp32 (no fp16/bf16 section), no clipping, ZeRO stage ``job.stage`` with the
    reduce bucket ``job.bucket_mb`` (fp32 elements) where given."""
    buckets = {} if job.bucket_mb is None else {"reduce_bucket_size": int(job.bucket_mb * 2**20 / 4)}
    return {"train_micro_batch_size_per_gpu": local_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": NO_CLIPPING,
            "zero_optimization": {"stage": job.stage, "overlap_comm": job.overlap, **buckets},
            "steps_per_print": 10**9}


def _zero_job(job: Job, workload: Workload) -> dict[str, Any]:
    """DeepSpeed ZeRO-1/2 driven directly (Lightning's DeepSpeedStrategy refuses CPU) on the same model, data,
    optimizer and schedule."""
    import deepspeed

    from benchmarks._scale_ranks import _tokens

    rank, world_size = dist.get_rank(), dist.get_world_size()
    local = workload.global_batch // world_size
    ds_config = deepspeed_config(job, local)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(workload.config())
    # the optimizer and learning-rate schedule the Lightning runs use, so that the losses compare too
    # total_steps: the Lightning runs' schedule ends at max_steps = job.steps
    optimizers = CausalLMModule(model, OptimConfig(warmup_steps=1, total_steps=job.steps)).configure_optimizers()
    init_deepspeed_comm()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizers["optimizer"], config=ds_config,
                                      lr_scheduler=optimizers["lr_scheduler"]["scheduler"], dist_init_required=False)
    inner = engine.optimizer.optimizer
    recorder = _Recorder()
    tokens = _tokens(workload, job.steps, rank, world_size)
    with recorder.watching(model):
        for step in range(job.steps):
            start = time.perf_counter()
            ids = tokens[step * local:(step + 1) * local]
            logits = engine(ids).logits
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                               ids[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            recorder.step_s.append(time.perf_counter() - start)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            recorder.losses.append(float(mean) / world_size)
    named = list(model.named_parameters())
    return {"step_s": recorder.step_s, "losses": recorder.losses, "grad_bytes": recorder.grad_bytes,
            "param_bytes": _storage_bytes(p for _, p in named), "optimizer_bytes": _optimizer_state_bytes(inner),
            "reduction_stats": None, "pipeline_rank": 0, "pipeline_parallel": 1, "data_parallel": world_size,
            "micro_batches": 1, "local_batch": local, **_holdings(named)}


def _measured(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    baseline = _reset_memory()
    started = time.perf_counter()
    result = run()
    result.update(baseline_mb=baseline, peak_mb=proc_status_mb("VmHWM"), wall_s=time.perf_counter() - started)
    result["used_mb"] = result["peak_mb"] - baseline
    return result


def _worst_used_mb(result: dict[str, Any]) -> float:
    used = torch.tensor([result["used_mb"]], dtype=torch.float64)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    return float(used)


def run_job(job: Job) -> dict[str, Any]:
    """One job on this rank; with a ladder, every attempt of the bisection and the rung it settled on."""
    workload = Workload(**job.workload)
    run = _zero_job if job.kind == "zero" else _lightning_job
    if not job.ladder:
        return _measured(lambda: run(job, workload))
    fits, fails = -1, len(job.ladder)  # ladder[fits] fitted under the cap, ladder[fails] did not
    attempts = []
    while fails - fits > 1:
        middle = (fits + fails) // 2
        rung = replace(workload, layers=job.ladder[middle])
        result = _measured(lambda: run(job, rung))
        worst = _worst_used_mb(result)
        attempts.append({"layers": rung.layers, "params": rung.parameters(), "used_mb": result["used_mb"],
                         "worst_used_mb": worst, "param_bytes": result["param_bytes"], "fits": worst <= job.cap_mb,
                         "plan": result.get("plan")})
        fits, fails = (middle, fails) if worst <= job.cap_mb else (fits, middle)
    return {"attempts": attempts, "largest_layers": job.ladder[fits] if fits >= 0 else None}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jobs", type=Path, help="JSON list of jobs (Job fields), with their indices")
    parser.add_argument("out_dir", type=Path, help="where each job's result goes, as INDEX-RANK.json")
    args = parser.parse_args(argv)
    entries = json.loads(args.jobs.read_text())
    torch.set_num_threads(1)
    _quiet()
    os.environ["LOCAL_RANK"] = os.environ["RANK"]  # the launcher started every rank: Lightning joins them
    if any(entry["job"]["kind"] == "zero" for entry in entries):
        import deepspeed  # noqa: F401  (imported before any baseline is taken)
    dist.init_process_group("gloo", timeout=timedelta(seconds=RANK_TIMEOUT_S))
    rank = dist.get_rank()
    for entry in entries:
        job = Job(**{**entry["job"], "ladder": tuple(entry["job"]["ladder"])})
        print(f"rank {rank}: job {entry['index']} {job.name}", file=sys.stderr, flush=True)
        (args.out_dir / f"current-{rank}").write_text(str(entry["index"]))  # which job a failure stopped
        result = run_job(job)
        if entry["index"] >= 0:  # a negative index is a warm-up, whose result nobody reads
            (args.out_dir / f"{entry['index']}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


def job_entries(jobs: list[tuple[int, Job]]) -> list[dict[str, Any]]:
    """The JSON the rank program reads: each job with its index in the driver's list, after one short warm-up
    job (index < 0) per kind of job, so that what a kind sets up once per process (lazy imports, gloo
    buffers, DeepSpeed's accelerator) is not charged to the first measured job of that kind."""
    warmups: dict[str, Job] = {}
    for _, job in jobs:
        workload = {**job.workload, "layers": job.ladder[0]} if job.ladder else job.workload
        warmups.setdefault(job.kind, replace(job, name=f"warm-up {job.kind}", workload=workload, steps=2, ladder=()))
    entries = [(-1 - i, job) for i, job in enumerate(warmups.values())] + list(jobs)
    return [{"index": index, "job": asdict(job)} for index, job in entries]


if __name__ == "__main__":
    sys.exit(main())
