"""Lightning checkpoints of an expert-parallel model keep every rank's experts (2 gloo ranks, DDP).

A run interrupted after 2 steps and resumed from its checkpoint into a model initialised
differently must continue exactly like the uninterrupted run: same losses, same expert
weights on every rank. That needs each rank's experts and their Adam state in the
checkpoint, which Lightning writes from rank 0 alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.testing import run_distributed
from tests.test_moe_layer import HIDDEN, cheap_transfer_cost_model, expert_mlp
from tests.test_moe_zero import TinyMoENet

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks or a subprocess

NUM_EXPERTS, EP_SIZE, TOTAL_STEPS, RESUME_AT = 4, 2, 4, 2
EXPERT = "net.moe.deepspeed_moe.experts.deepspeed_experts."


class _Module(pl.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        from lightning_merak.plugins.moe import MoE

        torch.manual_seed(seed)
        moe = MoE(hidden_size=HIDDEN, expert=expert_mlp(), num_experts=NUM_EXPERTS, ep_size=EP_SIZE, k=2,
                  drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False, dispatch="dropless",
                  placement="pro_prophet", alpha=0.0, cost_model=cheap_transfer_cost_model(NUM_EXPERTS // EP_SIZE))
        self.net = TinyMoENet(moe)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, target = batch
        loss = self.net(x, target)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _fit(module: _Module, rank: int, max_steps: int, ckpt_path: str | None = None) -> pl.Trainer:
    from lightning_merak.callbacks.moe.placement import MoEPlacementCallback

    generator = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.randn(1, 2, 12, HIDDEN, generator=generator), torch.randn(1, 2, 12, generator=generator))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[MoEPlacementCallback()],
    )
    trainer.fit(module, DataLoader(data, batch_size=None), ckpt_path=ckpt_path)
    return trainer


def _experts(module: _Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if k.startswith(EXPERT)}


def resume_run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    path = str(Path(directory) / "interrupted.ckpt")
    straight = _Module(seed=0)
    _fit(straight, rank, TOTAL_STEPS)
    interrupted = _Module(seed=0)
    trainer = _fit(interrupted, rank, RESUME_AT)
    trainer.save_checkpoint(path)
    resumed = _Module(seed=1)
    _fit(resumed, rank, TOTAL_STEPS, ckpt_path=path)
    saved_experts = sorted({k[len(EXPERT):].split(".")[0] for k in torch.load(path, weights_only=False)["state_dict"]
                            if k.startswith(EXPERT)})
    return {"straight": straight.losses, "interrupted": interrupted.losses, "resumed": resumed.losses,
            "straight_experts": _experts(straight), "resumed_experts": _experts(resumed),
            "saved_experts": saved_experts}


@pytest.mark.timeout(300)
def test_resume_keeps_every_ranks_experts(tmp_path: Path) -> None:
    results = run_distributed(resume_run, 2, args=(str(tmp_path),), timeout_s=240)
    for rank, result in enumerate(results):
        assert result["saved_experts"] == [str(e) for e in range(NUM_EXPERTS)], result["saved_experts"]
        assert result["interrupted"] == pytest.approx(result["straight"][:RESUME_AT], abs=1e-6)
        assert len(result["resumed"]) == TOTAL_STEPS - RESUME_AT
        assert result["resumed"] == pytest.approx(result["straight"][RESUME_AT:], abs=1e-5), f"rank {rank}"
        for name, value in result["straight_experts"].items():
            error = (result["resumed_experts"][name] - value).abs().max().item()
            assert error < 1e-5, f"rank {rank}: {name} differs by {error:.3g} after resuming"
    assert not torch.equal(results[0]["straight_experts"][EXPERT + "0.0.weight"],
                           results[1]["straight_experts"][EXPERT + "0.0.weight"]), "ranks must hold different experts"


def merak3d_resume_run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """pp=2 × dp=2, experts split over each stage's two data-parallel ranks; saved after an epoch of 2 steps, resumed
    (:func:`merak3d_resume_runs`)."""
    strategy = {"data_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 1, "micro_batches": 2,
                "partition": "uniform"}
    return merak3d_resume_runs(str(Path(directory) / "merak3d-moe"), world_size, strategy, data_rank=rank % 2)


def merak3d_resume_runs(path: str, world_size: int, strategy_kwargs: dict[str, Any],
                        data_rank: int) -> dict[str, Any]:
    """A merak3d MoE run on ``world_size`` ranks (``Merak3DStrategy(**strategy_kwargs)``) trained straight, and
    interrupted, saved to ``path`` and resumed into a model initialised otherwise, on data-parallel rank
    ``data_rank``'s batches.

    The uninterrupted run trains one epoch of all steps; the interrupted one an epoch of the first steps,
    and the resumed one continues with the rest as its second epoch (a constant learning rate, so
    epochs of other lengths train alike)."""
    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from lightning_merak.strategies.merak3d import Merak3DStrategy
    from tests.test_moe_lightning import BATCH, OPTIM, STEPS, _batches, _model, _Recorder, local_experts

    config = ProphetMoEConfig(ep_size=2, aux_loss_coef=0.0, dispatch="dropless", placement="none")
    data = _batches(data_rank)

    def fit(seed: int, first_step: int, last_step: int, epochs: int = 1, ckpt_path: str | None = None) -> tuple:
        module = _AdamModule(config.apply(_model(seed)), OPTIM)
        recorder = _Recorder()
        strategy = Merak3DStrategy(**strategy_kwargs, timeout_s=150)
        trainer = pl.Trainer(
            accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=epochs, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
            callbacks=[recorder, config.build_callbacks()[0]],
        )
        loader = DataLoader(TensorDataset(data[first_step * BATCH:last_step * BATCH]), batch_size=BATCH)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return trainer, recorder.losses, local_experts(strategy)

    _, straight, straight_experts = fit(0, 0, STEPS)
    trainer, interrupted, _ = fit(0, 0, RESUME_AT)
    trainer.save_checkpoint(path)
    _, resumed, resumed_experts = fit(1, RESUME_AT, STEPS, epochs=2, ckpt_path=path)
    from torch.distributed.checkpoint import FileSystemReader

    saved = sorted(FileSystemReader(path).read_metadata().state_dict_metadata)
    return {"straight": straight, "interrupted": interrupted, "resumed": resumed, "saved": saved,
            "straight_experts": straight_experts, "resumed_experts": resumed_experts}


def assert_resumed_like_straight(results: list[dict[str, Any]]) -> None:
    """Every rank's resumed losses and experts (:func:`merak3d_resume_runs`) equal the uninterrupted run's."""
    from tests.test_moe_lightning import STEPS

    for rank, result in enumerate(results):
        assert result["interrupted"] == pytest.approx(result["straight"][:RESUME_AT], rel=1e-6)
        assert len(result["resumed"]) == STEPS - RESUME_AT
        assert result["resumed"] == pytest.approx(result["straight"][RESUME_AT:], rel=1e-5), f"rank {rank}"
        assert set(result["resumed_experts"]) == set(result["straight_experts"])
        for key, value in result["straight_experts"].items():
            error = (result["resumed_experts"][key] - value).abs().max().item()
            assert error < 1e-5, f"rank {rank}: expert {key} differs by {error:.3g} after resuming"


def _AdamModule(model: torch.nn.Module, optim: Any) -> pl.LightningModule:
    """Adam at a constant rate: moments to restore, and no schedule tied to the run's length."""
    from lightning_merak.modules.causal_lm import CausalLMModule

    class AdamModule(CausalLMModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.model.parameters(), lr=3e-3)

    return AdamModule(model, optim)


@pytest.mark.timeout(400)
def test_merak3d_checkpoint_keeps_every_ranks_experts(tmp_path: Path) -> None:
    """merak3d writes each rank's experts under their global numbers, and resuming picks each rank's own back."""

    results = run_distributed(merak3d_resume_run, 4, args=(str(tmp_path),), timeout_s=360)
    expert_keys = [key for key in results[0]["saved"] if key.startswith("model.") and "deepspeed_experts." in key]
    numbers = sorted({int(key.split("deepspeed_experts.")[1].split(".")[0]) for key in expert_keys})
    assert numbers == [0, 1, 2, 3], f"the checkpoint must hold all 4 experts of every layer, found {numbers}"
    assert any(key.startswith("optim.") and "deepspeed_experts.3." in key for key in results[0]["saved"]), \
        "expert optimizer state of the second EP rank is missing"
    assert_resumed_like_straight(results)
