"""Every precision Lightning offers on this machine, at every layout, with the data-parallel sharding modes,
against a single-process run in the same precision.

On CPU Lightning runs ``16-mixed`` as ``bf16-mixed`` (fp16 autocast needs a GPU), and a loss-scaling precision
is refused with a sharded optimizer (tests/test_data_parallel_core.py); ``transformer-engine`` needs a GPU.
"""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl
import pytest
import torch

from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed
from tests.test_merak3d import _batches, _make_optimizer, _module, _ShardedData
from tests.test_merak3d_sharding import _Losses

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks

STEPS = 3
LOSS_RTOL = {"32-true": 1e-5, "bf16-mixed": 2e-2, "bf16-true": 2e-2}
LAYOUTS = {
    "dp2": {"data_parallel": 2},
    "pp2dp2": {"data_parallel": 2, "pipeline_parallel": 2},
    "tp2dp2": {"data_parallel": 2, "tensor_parallel": 2},
    "pp2tp2": {"pipeline_parallel": 2, "tensor_parallel": 2},
}
# each precision meets each layout once, and each sharding mode at every layout with replicas; FSDP2 twice
CASES = [
    ("32-true", "dp2", "gradients"), ("32-true", "pp2dp2", "optimizer"), ("32-true", "tp2dp2", "none"),
    ("32-true", "pp2tp2", "none"),
    ("bf16-mixed", "dp2", "optimizer"), ("bf16-mixed", "pp2dp2", "none"), ("bf16-mixed", "tp2dp2", "gradients"),
    ("bf16-mixed", "pp2tp2", "none"),
    ("bf16-true", "dp2", "none"), ("bf16-true", "pp2dp2", "gradients"), ("bf16-true", "tp2dp2", "optimizer"),
    ("bf16-true", "pp2tp2", "none"),
    ("bf16-mixed", "tp2dp2", "full"), ("bf16-true", "pp2dp2", "full"),
]


def _reference(precision: str) -> list[float]:
    module = _module("llama")
    if precision == "bf16-true":
        module.model.to(torch.bfloat16)
    optimizer = _make_optimizer(module.model.parameters(), "adam")
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed"
                else contextlib.nullcontext())
    losses = []
    for batch in _batches()[:STEPS]:
        optimizer.zero_grad()
        with autocast:
            loss = module.compute_loss((batch,))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses


def _train_rank(rank: int, world_size: int, precision: str, layout: dict) -> dict:
    module = _module("llama", "adam")
    recorder = _Losses()
    strategy = Merak3DStrategy(**layout, timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, precision=precision, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder],
    )
    trainer.fit(module, datamodule=_ShardedData(0, STEPS))
    dtypes = {str(param.dtype) for group in strategy.optimizers[0].param_groups for param in group["params"]}
    return {"losses": recorder.losses, "dtypes": dtypes}


@pytest.mark.parametrize(("precision", "layout", "sharding"), CASES, ids=["-".join(case) for case in CASES])
def test_precision_at_layout_with_sharding_trains_like_one_process(precision, layout, sharding):
    options = {**LAYOUTS[layout], "data_parallel_sharding": sharding}
    results = run_distributed(_train_rank, 4 if layout != "dp2" else 2, args=(precision, options), timeout_s=300)
    expected = _reference(precision)
    master = "torch.bfloat16" if precision == "bf16-true" else "torch.float32"
    for result in results:
        assert result["losses"] == pytest.approx(expected, rel=LOSS_RTOL[precision])
        assert result["dtypes"] == {master}, "the optimizer steps weights in the precision's master dtype"
