"""The GPU leg of ``python -m benchmarks.sharding --device cuda``: every precision on one GPU.

One GPU is lent at most, and NCCL refuses two ranks on one device, so no data-parallel degree above 1
(and so no sharding mode) can run there. What one GPU shows is the precision half of issue #29 on the
kernels it is about: for each of ``32-true``, ``bf16-mixed``, ``bf16-true``, ``16-mixed`` and
``transformer-engine`` (refused, with Lightning's reason, where Transformer Engine is not installed),
merak3d (data_parallel=1, the same seeded model) and Lightning's own single-device training run the
same steps with gradient clipping at 1.0; the rows give the largest relative difference of their losses,
merak3d's step time and CUDA allocator peak over Lightning's, and the dtype the optimizer steps in
(fp32 master weights under the mixed modes). GPU kernels are not bitwise reproducible (atomics in the
embedding's and attention's backward), even with torch's deterministic algorithms asked for (as here,
warn-only: attention has no deterministic backward), so Lightning runs twice and its own run-to-run
difference (``lightning_rerun_rel_diff``) is the floor merak3d's difference is read against.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.report import cuda_device_name, error_line, print_table, write_json
from lightning_merak.testing import run_distributed
from lightning_merak.testing.distributed import DistributedRunError

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "transformer-engine")
STRATEGIES = ("merak3d", "lightning", "lightning rerun")
HIDDEN, LAYERS, VOCAB, SEQ, BATCH = 1024, 8, 32000, 512, 8
QUICK_STEPS, FULL_STEPS = 10, 30
ACCELERATOR = "cuda"
LOSS_GOAL = {"32-true": 1e-5}
"""Equality goal per precision (fp32 only: the low-precision modes' rounding differs with any kernel order); met
when merak3d's difference is within it or within Lightning's own run-to-run difference."""


def _synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        _synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *args: Any) -> None:
        _synchronize()
        self.step_s.append(time.perf_counter() - self._start)
        self.losses.append(float(outputs["loss"]))


def train_rank(rank: int, world_size: int, strategy_name: str, precision: str, steps: int) -> dict[str, Any]:
    """``steps`` steps of a seeded Llama under ``strategy_name`` at ``precision`` on this GPU."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.modules.config import OptimConfig
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=HIDDEN * 8 // 3 // 8 * 8, num_hidden_layers=LAYERS,
                         num_attention_heads=HIDDEN // 64, num_key_value_heads=HIDDEN // 64, vocab_size=VOCAB,
                         max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False)
    module = CausalLMModule(AutoModelForCausalLM.from_config(config), OptimConfig(warmup_steps=2))
    tokens = torch.randint(VOCAB, (steps * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    recorder = _Recorder()
    strategy: Any = Merak3DStrategy(data_parallel=1) if strategy_name == "merak3d" else "auto"
    trainer = pl.Trainer(accelerator=ACCELERATOR, devices=1, strategy=strategy, precision=precision, max_steps=steps,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         use_distributed_sampler=False, callbacks=[recorder])
    if ACCELERATOR == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=BATCH))
    optimizer = trainer.optimizers[0]
    step_s = recorder.step_s[2:] or recorder.step_s
    return {"losses": recorder.losses, "step_s": sorted(step_s)[len(step_s) // 2],
            "peak_mb": torch.cuda.max_memory_allocated() / 2**20 if ACCELERATOR == "cuda" else 1.0,
            "optimizer_dtype": str(optimizer.param_groups[0]["params"][0].dtype).removeprefix("torch."),
            "model_dtype": str(next(module.model.parameters()).dtype).removeprefix("torch.")}


def _max_rel_diff(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))



def gpu_main(out: Path, quick: bool) -> int:
    """Run the precision matrix on one GPU and write ``out``; 1 when a run failed that is not a refusal."""
    device_name = cuda_device_name()
    started = time.perf_counter()
    steps = QUICK_STEPS if quick else FULL_STEPS
    print(f"GPU leg on {device_name}: Llama hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}, batch {BATCH} × {SEQ}, "
          f"{steps} steps per run", flush=True)
    rows, failed = [], []
    for precision in PRECISIONS:
        runs: dict[str, Any] = {}
        for name in STRATEGIES:
            try:
                (runs[name],) = run_distributed(train_rank, 1, args=(name, precision, steps), timeout_s=600,
                                                backend="nccl", env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
            except DistributedRunError as error:
                runs[name] = error_line(error)
        ours, theirs, again = runs["merak3d"], runs["lightning"], runs["lightning rerun"]
        row: dict[str, Any] = {"precision": precision}
        if isinstance(theirs, str):  # Lightning itself cannot run this precision here: a refusal, not a failure
            row.update(refused=theirs, error=None if isinstance(ours, str) else "merak3d ran what Lightning refused")
        elif isinstance(ours, str):
            row.update(error=ours)
        else:
            diff = _max_rel_diff(ours["losses"], theirs["losses"])
            floor = None if isinstance(again, str) else _max_rel_diff(again["losses"], theirs["losses"])
            goal = LOSS_GOAL.get(precision)
            row.update(loss_max_rel_diff=diff, lightning_rerun_rel_diff=floor, final_loss=ours["losses"][-1],
                       step_over_lightning=ours["step_s"] / theirs["step_s"],
                       peak_over_lightning=ours["peak_mb"] / theirs["peak_mb"], peak_mb=ours["peak_mb"],
                       optimizer_dtype=ours["optimizer_dtype"], model_dtype=ours["model_dtype"],
                       lightning_optimizer_dtype=theirs["optimizer_dtype"], error=None,
                       loss_goal_met=None if goal is None else diff <= max(goal, floor or 0.0))
        if row.get("error"):
            failed.append(precision)
        rows.append(row)
        print(f"  {row}", flush=True)
    print_table(rows, ["precision", "loss_max_rel_diff", "lightning_rerun_rel_diff", "final_loss",
                       "step_over_lightning", "peak_over_lightning", "optimizer_dtype", "model_dtype", "refused",
                       "error"])
    wall = time.perf_counter() - started
    path = write_json(out, rows, label="measured", benchmark="sharding", quick=quick, device=device_name,
                      steps=steps, workload=f"llama hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}, "
                      f"batch {BATCH} x {SEQ}", not_run="data_parallel > 1 and every sharding mode: one GPU lent, "
                      "and NCCL refuses two ranks on one device", wall_s=round(wall, 1))
    print(f"wrote {path} in {wall:.0f} s")
    return 1 if failed else 0
