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
    from lightning_merak.plugins.moe.callback import MoEPlacementCallback

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
