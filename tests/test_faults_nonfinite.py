"""Issue #27 item 5: a non-finite loss or gradient skips the step on every rank (or stops every rank)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.nonfinite import NonFiniteError, NonFiniteGuard
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig, OptimConfig
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed

STEPS = 4


class _Regression(pl.LightningModule):
    """A linear model whose loss turns NaN on rank ``nan_rank`` at step ``nan_step``."""

    def __init__(self, nan_rank: int, nan_step: int) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.nan_rank, self.nan_step = nan_rank, nan_step

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        features, target = batch
        loss = F.mse_loss(self.layer(features), target)
        if self.global_rank == self.nan_rank and batch_idx == self.nan_step:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)


class _Snapshots(pl.Callback):
    """This rank's parameters after every step; with ``poison``, NaN in one gradient on one rank and step."""

    def __init__(self, poison: tuple[int, int] | None = None) -> None:
        self.poison = poison
        self.parameters: list[dict[str, torch.Tensor]] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.poison == (trainer.global_rank, trainer.global_step):
            first = next(p for p in pl_module.parameters() if p.grad is not None)
            first.grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        self.parameters.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})


def ddp_run(rank: int, world_size: int, action: str) -> dict[str, object]:
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    guard, snapshots = NonFiniteGuard(action), _Snapshots()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[guard, snapshots])
    try:
        trainer.fit(_Regression(nan_rank=1, nan_step=2), DataLoader(data, batch_size=4))
    except NonFiniteError as error:
        return {"error": str(error), "steps": len(snapshots.parameters)}
    return {"skipped": guard.skipped, "parameters": snapshots.parameters}


def _assert_only_step_skipped(parameters: list[dict[str, torch.Tensor]], skipped_step: int) -> None:
    for step in range(1, len(parameters)):
        for name, value in parameters[step].items():
            assert torch.isfinite(value).all(), (step, name)
            moved = not torch.equal(value, parameters[step - 1][name])
            assert moved == (step != skipped_step), (step, name)


@pytest.mark.distributed
def test_nan_loss_on_one_rank_skips_the_step_on_every_rank() -> None:
    results = run_distributed(ddp_run, world_size=2, args=("skip",), timeout_s=90)
    for result in results:
        assert result["skipped"] == 1
        _assert_only_step_skipped(result["parameters"], skipped_step=2)
    for name, value in results[0]["parameters"][-1].items():
        torch.testing.assert_close(value, results[1]["parameters"][-1][name], rtol=0, atol=0)


@pytest.mark.distributed
def test_stop_raises_on_every_rank_naming_the_step() -> None:
    results = run_distributed(ddp_run, world_size=2, args=("stop",), timeout_s=90)
    for result in results:
        assert "step 2: non-finite loss" in result["error"] and result["steps"] == 2


VOCAB, SEQ = 64, 8
LLAMA = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False})


class _SGDModule(CausalLMModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


def _fit_merak3d(module: pl.LightningModule, strategy: Merak3DStrategy, world_size: int,
                 callbacks: list[pl.Callback]) -> None:
    """``STEPS`` steps of ``module`` under ``strategy`` on the same token batches (every rank reads them all)."""
    tokens = torch.randint(VOCAB, (STEPS * 4, SEQ), generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, max_steps=STEPS, logger=False, enable_checkpointing=False,
        strategy=strategy, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))


def pipeline_run(rank: int, world_size: int) -> dict[str, object]:
    """merak3d pp=2: an infinite gradient on the first stage only (rank 0) at step 1."""
    torch.manual_seed(0)
    module = _SGDModule(build_causal_lm(LLAMA, vocab_size=VOCAB))
    guard, snapshots = NonFiniteGuard("skip"), _Snapshots(poison=(0, 1))
    _fit_merak3d(module, Merak3DStrategy(data_parallel=1, pipeline_parallel=2, tensor_parallel=1, timeout_s=120),
                 world_size, [guard, snapshots])
    return {"skipped": guard.skipped, "parameters": snapshots.parameters}


@pytest.mark.distributed
def test_gradient_not_finite_on_one_pipeline_stage_skips_every_stage() -> None:
    for result in run_distributed(pipeline_run, world_size=2, timeout_s=120):
        assert result["skipped"] == 1
        _assert_only_step_skipped(result["parameters"], skipped_step=1)


class _NaNLossModule(CausalLMModule):
    """Muon's module whose loss turns NaN on rank 1 at step 1."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if (self.global_rank, self.global_step) == (1, 1) else loss


class _OptimizerSnapshots(pl.Callback):
    """After every step: what the optimizer steps on this rank (its parameters: ZeRO's slices) and its state."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        optimizer = trainer.optimizers[0]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.steps.append([p.detach().clone() for p in params] + [
            value.clone() for p in params for value in optimizer.state.get(p, {}).values()])


def zero_muon_run(rank: int, world_size: int, sharding: str) -> dict[str, object]:
    """merak3d dp=2 with ZeRO slices of Muon's matrices: a NaN loss on rank 1 at step 1."""
    torch.manual_seed(0)
    module = _NaNLossModule(build_causal_lm(LLAMA, vocab_size=VOCAB),
                            OptimConfig(name="muon", warmup_steps=0, newton_schulz_dtype="float32"))
    guard, snapshots = NonFiniteGuard("skip"), _OptimizerSnapshots()
    _fit_merak3d(module, Merak3DStrategy(data_parallel=2, data_parallel_sharding=sharding, timeout_s=120),
                 world_size, [guard, snapshots])
    return {"skipped": guard.skipped, "steps": snapshots.steps}


@pytest.mark.distributed
def test_a_skipped_step_leaves_zero_sliced_muon_matrices_on_every_rank() -> None:
    """Muon under ZeRO-1 puts each matrix together from the ranks' slices every step: a step whose gradients the
    guard dropped on every rank leaves the slices and the optimizer state as they were, and the next step steps."""
    for result in run_distributed(zero_muon_run, world_size=2, args=("optimizer",), timeout_s=180):
        assert result["skipped"] == 1
        before, skipped, after = result["steps"][0:3]
        assert all(torch.equal(old, new) for old, new in zip(before, skipped))
        assert not all(torch.equal(old, new) for old, new in zip(skipped, after))
        assert all(torch.isfinite(value).all() for value in result["steps"][-1])


def test_options_are_checked_before_training() -> None:
    with pytest.raises(ValueError, match="'skip' or 'stop'"):
        NonFiniteGuard("ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_skipped"):
        NonFiniteGuard(max_skipped=0)
