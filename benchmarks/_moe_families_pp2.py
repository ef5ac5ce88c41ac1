"""One gloo rank of ``benchmarks.moe_families``' pp=2 × ep=2 leg (4 ranks): merak3d training per family.

Per family, three runs of ``Merak3DStrategy(pipeline_parallel=2, data_parallel=2)`` on the same batches with
plain SGD: ``default`` is the unswapped model as a user gets it (every expert on both data-parallel ranks of a
stage, averaged like any weight; ``experts_implementation`` left to transformers, the one it picked recorded),
``eager`` the same with transformers' expert loop (the exactness reference), ``ours`` is ``merak_ep`` at its
defaults with each stage's experts spread over its two data-parallel ranks. Equality: the largest difference of
each step's loss from ``eager`` (the losses after the first step follow from the gradients). Time: each step
from ``on_train_batch_start`` to
``on_train_batch_end`` (forward, backward, reductions, optimizer step), the build's first steps left out.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks._moe_families_ranks import each_family
from lightning_merak.testing.data import ReplicaBatches

OVERRIDES = {"deepseek_v2": {"first_k_dense_replace": 0}, "deepseek_v3": {"first_k_dense_replace": 0}}
"""Every block a MoE block, so both stages hold experts."""


class _Steps(pl.Callback):
    def __init__(self, implementation: str) -> None:
        self.implementation = implementation  # the model's as built, before merak_ep swaps its own in
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def variant_model(family: str, variant: str, size: dict[str, int]) -> torch.nn.Module:
    """The model a variant starts from: ``default`` leaves ``experts_implementation`` to transformers (what a user
    runs), ``eager`` and ``ours`` (before ``merak_ep`` swaps in) start from transformers' expert loop."""
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    model = tiny_moe_model(family, hidden=size["hidden"], layers=size["layers"], vocab=size["vocab"],
                           experts_implementation=None if variant == "default" else "eager",
                           **OVERRIDES.get(family, {}))
    model.config.use_cache = False
    return model


def _fit(family: str, variant: str, size: dict[str, int], batches: torch.Tensor) -> _Steps:
    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    class SGDModule(CausalLMModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.model.parameters(), lr=0.1)

    model = variant_model(family, variant, size)
    steps = _Steps(model.config._experts_implementation)
    callbacks: list[pl.Callback] = [steps] + ([ExpertParallelCallback(log_every_n_steps=10**9)]
                                              if variant == "ours" else [])
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=Merak3DStrategy(data_parallel=2, pipeline_parallel=2,
                                                               micro_batches=2, timeout_s=300),
        max_steps=batches.shape[0], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=callbacks)
    trainer.fit(SGDModule(model),
                datamodule=ReplicaBatches(batches, 0, batches.shape[0]))
    return steps


def run_family(family: str, size: dict[str, int], warmup: int, steps: int) -> dict[str, Any]:
    """Loss differences from ``eager`` and step times (ms, this rank) of each variant of one family."""
    batches = torch.randint(3, size["vocab"], (warmup + steps, 2 * size["batch"], size["seq"]),
                            generator=torch.Generator().manual_seed(7))
    runs = {variant: _fit(family, variant, size, batches) for variant in ("eager", "default", "ours")}
    eager = runs["eager"].losses
    return {
        "family": family,
        "loss_diff": max(abs(a - b) for a, b in zip(runs["ours"].losses, eager)),
        "default_loss_diff": max(abs(a - b) for a, b in zip(runs["default"].losses, eager)),
        "default_implementation": runs["default"].implementation,
        "step_ms": {v: statistics.median(r.seconds[warmup:]) * 1e3 for v, r in runs.items()},
        "step_min_ms": {v: min(r.seconds[warmup:]) * 1e3 for v, r in runs.items()},
    }


def run_all(rank: int, world: int, families: list[str], size: dict[str, int], warmup: int,
            steps: int) -> list[dict[str, Any]]:
    """Every family in order on this rank at pp=2 × ep=2."""
    return each_family(families, lambda family: run_family(family, size, warmup, steps))
