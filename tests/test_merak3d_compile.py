"""``Merak3DStrategy(compile=True)`` at the layouts it composes with, on 2 gloo ranks, against the eager single-process
model: fp32 losses within 1e-5 over 10 steps (inductor on CPU), no graph break and no recompilation after the
first step. One launch runs every case (its processes keep inductor's compiled kernels between them)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.parallel.regional_compile import compile_counts
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed
from lightning_merak.testing.compare import module_losses
from tests.test_merak3d import VOCAB, _module
from tests.test_merak3d_sharding import _Losses
from tests.test_regional_compile import OPTIMIZER

pytestmark = pytest.mark.distributed  # gloo ranks; inductor starts its C++ compiler

STEPS, BATCH, SEQ = 10, 8, 16
CASES = {
    "dp2-optimizer-recompute": {"data_parallel": 2, "data_parallel_sharding": "optimizer", "recompute": "full"},
    "pp2-gradients": {"data_parallel": 1, "pipeline_parallel": 2, "data_parallel_sharding": "gradients"},
    "tp2-sequence_parallel": {"data_parallel": 1, "tensor_parallel": 2, "sequence_parallel": True},
}


def _batches() -> torch.Tensor:
    return torch.randint(VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _reference() -> list[float]:
    return module_losses(_module("llama", OPTIMIZER), [(batch,) for batch in _batches()])


def _train_cases(rank: int, world_size: int) -> dict[str, dict]:
    results = {}
    for name, layout in CASES.items():
        module, recorder = _module("llama", OPTIMIZER), _Losses()
        strategy = Merak3DStrategy(**layout, compile=True, timeout_s=300)
        trainer = pl.Trainer(
            accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder],
        )
        replicas = layout["data_parallel"]
        shard = BATCH // replicas
        local = _batches()[:, (rank % replicas) * shard:(rank % replicas + 1) * shard].reshape(-1, SEQ)
        first_step = compile_counts()
        counts = None

        class AfterFirstStep(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                nonlocal counts
                if batch_idx == 0:
                    counts = compile_counts()

        trainer.callbacks.append(AfterFirstStep())
        trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(local), batch_size=shard))
        compiled = [forward for block in strategy.local_blocks.values()
                    for forward in [block.forward.forward if strategy.recompute != "none" else block.forward]]
        results[name] = {"losses": recorder.losses, "first": counts - first_step,
                         "later": compile_counts() - counts,
                         "eager": [forward.eager_reason for forward in compiled]}
    return results


def test_compiled_blocks_train_like_the_eager_model_at_every_layout():
    expected = _reference()
    per_rank = run_distributed(_train_cases, 2, timeout_s=540)
    for name in CASES:
        # A measured AutoPipe cut may leave a pipeline stage only the embedding or the head: count blocks over ranks.
        reasons = [reason for results in per_rank for reason in results[name]["eager"]]
        assert reasons and not any(reasons), f"{name}: every block compiled whole"
    for results in per_rank:
        for name, result in results.items():
            assert result["losses"] == pytest.approx(expected, rel=1e-5), name
            assert result["first"].graph_breaks == 0, name
            assert result["later"].graphs == 0 and result["later"].recompiles == 0, f"{name}: nothing compiled again"
