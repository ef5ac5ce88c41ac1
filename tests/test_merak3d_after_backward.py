"""What ``on_after_backward`` sees and changes under merak3d at dp=2 with a loss scaler, against one process.

From the second step on the hooks see the gradients averaged over the replicas, as under Lightning's DDP, and a
callback's change to them is what every rank steps; an overflow only one rank finds (there, after the average)
skips the step on every rank (:mod:`lightning_merak.parallel.data.agreed_overflow`). On CPU a ``GradScaler`` needs
the plugin spelled out (Lightning turns ``precision="16-mixed"`` into bf16 there).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed
from tests.test_merak3d import _batches, _module, _ShardedData

STEPS = 4
INF_STEP, ZEROED_STEP = 1, 2
WATCHED = "layers.0.self_attn.q_proj.weight"


class _Meddler(pl.Callback):
    """Puts an inf into ``inf_rank``'s gradient at ``INF_STEP``, zeroes every gradient at ``ZEROED_STEP``, and
    records the watched gradient it saw and the weights after each step."""

    def __init__(self, inf_rank: int) -> None:
        self.inf_rank = inf_rank
        self.seen: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        grads = {name: param.grad for name, param in pl_module.model.named_parameters() if param.grad is not None}
        self.seen.append(next(grad for name, grad in grads.items() if name.endswith(WATCHED)).clone())
        if trainer.global_step == INF_STEP and trainer.global_rank == self.inf_rank:
            grads[next(iter(grads))].view(-1)[0] = float("inf")
        if trainer.global_step == ZEROED_STEP:
            for grad in grads.values():
                grad.zero_()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.weights.append(torch.cat([param.detach().flatten() for param in pl_module.model.parameters()]))


def _scaled_precision() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def _train_rank(rank: int, world_size: int) -> dict:
    module, meddler = _module("llama"), _Meddler(inf_rank=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(data_parallel=2, timeout_s=120),
        plugins=[_scaled_precision()], max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        use_distributed_sampler=False, callbacks=[meddler],
    )
    trainer.fit(module, datamodule=_ShardedData(0, STEPS))
    return {"seen": meddler.seen, "weights": meddler.weights, "scale": trainer.precision_plugin.scaler.get_scale()}


def _reference() -> dict:
    """One process on the whole batches, the same meddling (its inf on the one rank there is)."""
    module = _module("llama")
    optimizer = torch.optim.SGD(module.model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu")
    params = dict(module.model.named_parameters())
    seen, weights = [], []
    for step, batch in enumerate(_batches()[:STEPS]):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = module.compute_loss((batch,))
        scaler.scale(loss).backward()
        seen.append(params[f"model.{WATCHED}"].grad.clone())
        if step == INF_STEP:
            next(iter(params.values())).grad.view(-1)[0] = float("inf")
        if step == ZEROED_STEP:
            optimizer.zero_grad(set_to_none=False)
        scaler.step(optimizer)
        scaler.update()
        weights.append(torch.cat([param.detach().flatten() for param in module.model.parameters()]))
    return {"seen": seen, "weights": weights, "scale": scaler.get_scale()}


@pytest.mark.distributed
def test_after_backward_hooks_change_the_averaged_gradients_every_rank_steps() -> None:
    results = run_distributed(_train_rank, 2, timeout_s=300)
    expected = _reference()
    for result in results:
        assert result["scale"] == expected["scale"], "the overflow one rank found skipped the step on every rank"
        for step in range(1, STEPS):  # the first step's hooks still see each rank's own gradients (names pending)
            torch.testing.assert_close(result["seen"][step], expected["seen"][step], rtol=2e-2, atol=2e-2)
        for step in range(STEPS):
            torch.testing.assert_close(result["weights"][step], expected["weights"][step], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(results[0]["weights"][-1], results[1]["weights"][-1], rtol=0, atol=0)
