"""merak3d's ``recompute="full"`` with either MoE option at pipeline_parallel=1 × data_parallel=2 (2 gloo ranks)
trains like one process on the union of the data-parallel batches: the swapped DeepSpeed-MoE layer's exchange
and merak_ep's grouped experts both run a backward inside a recomputed block (``torch.autograd.grad`` in the
exchange's backward; the grouped-matmul probe on the first forward)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.testing import run_distributed, snapshot_gradients
from tests.test_moe_lightning import BATCH, STEPS, _batches, _LoggedLoss, _model, _sgd_module, local_experts


class _Gradients(pl.Callback):
    """Per step: this rank's gradients by unsplit name, and each merak_ep experts module's slice of experts."""

    def __init__(self) -> None:
        self.gradients: list[dict[str, torch.Tensor]] = []
        self.slices: dict[str, range] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE
        from lightning_merak.testing import layout_gradients

        self.gradients.append(layout_gradients(trainer.strategy, pl_module.model))
        for name, module in pl_module.model.named_modules():
            shard = getattr(module, SHARD_ATTRIBUTE, None)
            if shard is not None:
                for tensor, _ in module.named_parameters(recurse=False):
                    self.slices[f"{name}.{tensor}"] = shard.experts


def _train(rank: int, world_size: int, experts: str) -> dict[str, Any]:
    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    config = ProphetMoEConfig(ep_size=2, aux_loss_coef=0.0, log_every_n_steps=1, experts=experts)
    module = _sgd_module(config.apply(_model()))
    losses, gradients = _LoggedLoss(), _Gradients()
    strategy = Merak3DStrategy(data_parallel=2, pipeline_parallel=1, recompute="full", timeout_s=150)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, gradient_clip_val=None,
        callbacks=[losses, gradients, *config.build_callbacks()],
    )
    trainer.fit(module, DataLoader(TensorDataset(_batches(rank)), batch_size=BATCH))
    return {"losses": losses.losses, "gradients": gradients.gradients, "slices": gradients.slices,
            "experts": local_experts(strategy) if experts == "deepspeed" else {}}


def _reference() -> tuple[list[float], list[dict[str, torch.Tensor]], dict[tuple[int, int], torch.Tensor]]:
    """One process on the union of both ranks' batches: losses, gradients per step, and the trained gate/up weight of
    each (layer, expert)."""
    module = _sgd_module(_model())
    optimizer = module.configure_optimizers()
    data = [_batches(rank) for rank in range(2)]
    losses, gradients = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = module.compute_loss((torch.cat([d[step * BATCH:(step + 1) * BATCH] for d in data]),))
        loss.backward()
        losses.append(loss.item())
        gradients.append(snapshot_gradients(module.model))
        optimizer.step()
    blocks = [m for m in module.model.modules() if hasattr(getattr(m, "experts", None), "gate_up_proj")]
    experts = {(i, e): block.experts.gate_up_proj[e].detach().clone()
               for i, block in enumerate(blocks) for e in range(block.experts.gate_up_proj.shape[0])}
    return losses, gradients, experts


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("experts", ["deepspeed", "merak_ep"])
def test_recomputed_moe_blocks_train_like_one_process(experts: str) -> None:
    """Losses and every gradient both runs name alike (merak_ep: each rank's experts too) per step; the swapped
    DeepSpeed layer's experts by their trained weights."""
    results = run_distributed(_train, 2, args=(experts,), timeout_s=240)
    losses, gradients, trained = _reference()
    compared: set[str] = set()
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(losses, rel=1e-6), (rank, result["losses"], losses)
        for step, (ours, want) in enumerate(zip(result["gradients"], gradients, strict=True)):
            for name, grad in ours.items():
                if name not in want:
                    continue
                expected = want[name][result["slices"][name]] if name in result["slices"] else want[name]
                error = (grad - expected).abs().max().item()
                assert error <= 1e-6 + 1e-5 * expected.abs().max().item(), f"rank {rank} step {step} {name}: {error}"
                compared.add(name)
        for key, weight in result["experts"].items():
            torch.testing.assert_close(weight, trained[key], rtol=1e-5, atol=1e-6, msg=f"rank {rank} expert {key}")
    experts_compared = ({name for name in compared if "experts" in name} if experts == "merak_ep"
                        else {key for result in results for key in result["experts"]})
    assert experts_compared and len(compared) > 10, sorted(compared)
