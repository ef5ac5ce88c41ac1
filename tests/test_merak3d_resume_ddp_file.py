"""merak3d resumes a Lightning DDP run's ``.ckpt`` file (#30): a user who trained with ``strategy=ddp`` moves to
``Merak3DStrategy`` and continues on the uninterrupted trajectory, Adam's moments included.

The file holds the whole model (``merak_ep``'s experts and the LoRA factors on them gathered whole, in PEFT's
layout) and each optimizer's state in torch's format; merak3d reads it memory-mapped, cuts each fused expert tensor,
expert factor and their moments to this rank's experts, keys the optimizer state by parameter name and places it on
this rank's stage and tensor-parallel shard once the layout is built. Checked: a tiny Qwen3-MoE (16 experts, top-8)
with ``merak_ep``, the same with LoRA on attention and experts, and a dense Llama."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_merak.testing import run_distributed
from lightning_merak.testing.data import ReplicaBatches
from tests import test_merak3d as dense
from tests import test_merak3d_experts_ckpt as experts
from tests import test_moe_adapters_merak3d as adapters

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks

PP2_DP2 = {"pipeline_parallel": 2, "data_parallel": 2}


@pytest.fixture(scope="module")
def ddp_experts_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """Two Adam steps of Lightning's DDP with ``merak_ep`` (ep=2) on two ranks, saved to one file."""
    path = tmp_path_factory.mktemp("ddp-experts") / "ddp-ep2.ckpt"
    reference = experts._reference()
    first = run_distributed(experts._train_rank, 2, args=(None, None, str(path), None), timeout_s=100)
    assert first[0] == pytest.approx(reference[:experts.SAVED_AT], rel=experts.LOSS_RTOL)
    return path, reference


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("world_size", "layout", "ep_size", "on_meta"), [
    (4, PP2_DP2, None, False),
    (4, {"pipeline_parallel": 1, "data_parallel": 2, "tensor_parallel": 2}, None, True),
    (4, {"pipeline_parallel": 1, "data_parallel": 4}, 2, False),
], ids=["pp2dp2-ep2", "tp2dp2-ep2-meta", "dp4-ep2"])
def test_a_ddp_experts_file_resumes_under_merak3d(ddp_experts_file: tuple[Path, list[float]], world_size: int,
                                                  layout: dict[str, int], ep_size: int | None, on_meta: bool) -> None:
    """Each rank keeps its stage's blocks and its experts of the file's whole ``[E, ...]`` tensors and moments; the
    next two losses equal the uninterrupted single-process run (a model ``configure_model`` builds on meta too)."""
    path, reference = ddp_experts_file
    results = run_distributed(experts._train_rank, world_size, args=(layout, ep_size, None, str(path), on_meta),
                              timeout_s=120)
    for losses in results:
        assert losses == pytest.approx(reference[experts.SAVED_AT:], rel=experts.LOSS_RTOL)


@pytest.mark.timeout(150)
def test_a_ddp_file_with_expert_adapters_resumes_under_merak3d(tmp_path: Path) -> None:
    """LoRA on attention and experts, Adam over the adapters alone: the file's whole expert factors (PEFT's layout)
    and their moments are sliced to each rank's experts at pp=2 × dp=2 (ep=2), on the uninterrupted trajectory."""
    path = tmp_path / "ddp-adapters.ckpt"
    losses, _, _ = adapters._reference("adam")
    first = run_distributed(adapters._train_rank, 2, args=(None, None, "adam", 0, adapters.SAVED_AT, str(path), None),
                            timeout_s=100)
    assert first[0]["losses"] == pytest.approx(losses[:adapters.SAVED_AT], rel=adapters.LOSS_RTOL)
    resumed = run_distributed(adapters._train_rank, 4, args=(PP2_DP2, None, "adam", adapters.SAVED_AT,
                                                             adapters.STEPS, None, str(path)), timeout_s=120)
    for result in resumed:
        assert result["losses"] == pytest.approx(losses[adapters.SAVED_AT:], rel=adapters.LOSS_RTOL)


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


DENSE_SAVED_AT = 3


def _dense_rank(rank: int, world_size: int, layout: dict[str, int] | None, save_to: str | None,
                resume_from: str | None) -> list[float]:
    """A dense Llama under DDP (``layout=None``, saved after ``DENSE_SAVED_AT`` steps) or resumed under merak3d
    from that file, its model built on meta by ``configure_model``; this rank's losses."""
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    module = dense._module("llama", "adam", on_meta=resume_from is not None)
    recorder = _Losses()
    strategy = "ddp" if layout is None else Merak3DStrategy(**layout, micro_batches=2, timeout_s=120)
    first, last = (DENSE_SAVED_AT, dense.STEPS) if resume_from else (0, DENSE_SAVED_AT)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=2 if resume_from else 1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder],
    )
    trainer.fit(module, datamodule=ReplicaBatches(dense._batches(), first, last), ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return recorder.losses


@pytest.mark.timeout(150)
def test_a_dense_ddp_file_resumes_at_pp2_tp2(tmp_path: Path) -> None:
    """A dense model's DDP file: the optimizer state, numbered by the DDP optimizer's parameter order, is keyed by
    name and placed on each rank's stage and tensor-parallel shard (Adam; the model built on meta)."""
    path = tmp_path / "ddp-dense.ckpt"
    reference = dense._reference("llama", optimizer_kind="adam").losses
    first = run_distributed(_dense_rank, 2, args=(None, str(path), None), timeout_s=100)
    assert first[0] == pytest.approx(reference[:DENSE_SAVED_AT], rel=1e-5)
    layout = {"pipeline_parallel": 2, "tensor_parallel": 2, "data_parallel": 1}
    for losses in run_distributed(_dense_rank, 4, args=(layout, None, str(path)), timeout_s=120):
        assert losses == pytest.approx(reference[DENSE_SAVED_AT:], rel=1e-5)
