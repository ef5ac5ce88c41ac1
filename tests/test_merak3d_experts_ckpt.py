"""Sharded checkpoints of ``merak_ep`` experts under merak3d (#30 item 4): saved at pp=2 × dp=2 with each stage's
experts over its two data-parallel ranks, every fused expert tensor is stored whole ([E, ...]) under its unsplit
name, and runs resumed at dp=2, at pp=2 × dp=2 with one rank holding every expert (ep=1) and at tp=2 × dp=2
continue the uninterrupted single-process trajectory, Adam's moments included; so does Lightning's DDP with
``merak_ep``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.modules.config import OptimConfig
from lightning_merak.testing import run_distributed
from lightning_merak.testing.data import ReplicaBatches

STEPS, SAVED_AT, BATCH, SEQ, VOCAB, LR = 4, 2, 8, 8, 128, 0.01
FAMILY = "qwen3_moe"  # 16 experts, top-8
LOSS_RTOL = 1e-6


def _model() -> torch.nn.Module:
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    model = tiny_moe_model(FAMILY, hidden=32, layers=2, vocab=VOCAB, seed=0)
    model.config.use_cache = False
    return model


def _batches() -> torch.Tensor:
    return torch.randint(3, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(5))


class _AdamModule(CausalLMModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=LR)


def _reference() -> list[float]:
    """The uninterrupted run: the unswapped model (transformers' own expert loop) on the whole batches."""
    module = _AdamModule(_model())
    optimizer = module.configure_optimizers()
    losses = []
    for batch in _batches():
        optimizer.zero_grad()
        loss = module.compute_loss((batch,))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def _train_rank(rank: int, world_size: int, layout: dict[str, int] | None, ep_size: int | None, save_to: str | None,
                resume_from: str | None, on_meta: bool = False) -> list[float]:
    """Steps ``0..SAVED_AT`` then a save, or (``resume_from``) the rest after resuming; this rank's losses.
    ``layout=None``: Lightning's DDP instead of merak3d; ``on_meta``: the model built by ``configure_model`` (on
    the meta device under merak3d), cut to this rank's experts before the checkpoint is read."""
    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    config = OptimConfig()
    module = _AdamModule(None, config, model_factory=_model) if on_meta else _AdamModule(_model(), config)
    recorder = _Losses()
    strategy = "ddp" if layout is None else Merak3DStrategy(**{"tensor_parallel": 1, **layout}, micro_batches=2,
                                                            partition="uniform", timeout_s=120)
    first, last = (SAVED_AT, STEPS) if resume_from else (0, SAVED_AT)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=2 if resume_from else 1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[ExpertParallelCallback(ep_size=ep_size, log_every_n_steps=1), recorder],
    )
    trainer.fit(module, datamodule=ReplicaBatches(_batches(), first, last), ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return recorder.losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """A checkpoint written at pp=2 × dp=2 (experts over each stage's two data-parallel ranks) after two steps."""
    path = tmp_path_factory.mktemp("experts") / "pp2dp2-ep2.ckpt"
    results = run_distributed(_train_rank, 4, args=({"pipeline_parallel": 2, "data_parallel": 2}, None, str(path),
                                                    None), timeout_s=100)
    reference = _reference()
    for losses in results:
        assert losses == pytest.approx(reference[:SAVED_AT], rel=LOSS_RTOL)
    return path, reference


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_fused_experts_are_saved_whole_under_their_unsplit_names(saved: tuple[Path, list[float]]) -> None:
    """Each expert group wrote its slice at its global offset: the checkpoint holds [E, ...] tensors (and Adam's
    moments of them) whose contents are the union of the ranks' experts."""
    from torch.distributed.checkpoint import FileSystemReader

    path, _ = saved
    model = _model()
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    experts = [name for name, _ in model.named_parameters() if name.endswith(("gate_up_proj", "down_proj"))]
    assert experts
    for name in experts:
        shape = tuple(dict(model.named_parameters())[name].shape)
        saved = metadata[f"model.model.{name}"]  # DCP's flattened key of state["model"]["model.<name>"]
        assert tuple(saved.size) == shape, name
        assert tuple(metadata[f"optim.0/{name}/exp_avg_sq"].size) == shape, name
        chunks = saved.chunks
        assert sorted(chunk.offsets[0] for chunk in chunks) == [0, shape[0] // 2], f"{name}: replicas written once"


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world_size", "layout", "ep_size", "on_meta"), [
    (2, {"pipeline_parallel": 1, "data_parallel": 2}, None, False),
    (2, {"pipeline_parallel": 1, "data_parallel": 2}, None, True),
    (4, {"pipeline_parallel": 2, "data_parallel": 2}, 1, False),
    (4, {"pipeline_parallel": 1, "data_parallel": 2, "tensor_parallel": 2}, None, False),
    (2, None, None, False),
], ids=["dp2-ep2", "dp2-ep2-meta", "pp2dp2-ep1", "tp2dp2-ep2", "ddp-ep2"])
def test_resumed_in_another_layout_continues_the_uninterrupted_run(saved: tuple[Path, list[float]], world_size: int,
                                                                   layout: dict[str, int] | None,
                                                                   ep_size: int | None, on_meta: bool) -> None:
    path, reference = saved
    results = run_distributed(_train_rank, world_size, args=(layout, ep_size, None, str(path), on_meta),
                              timeout_s=100)
    for losses in results:
        assert losses == pytest.approx(reference[SAVED_AT:], rel=LOSS_RTOL)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_ddp_checkpoint_holds_every_expert_and_resumes(tmp_path: Path) -> None:
    """Under DDP rank 0 writes the file: the callback gathers each fused expert tensor (and Adam's moments) whole
    first, and each rank keeps its own experts when the file is read back."""
    path = tmp_path / "ddp.ckpt"
    reference = _reference()
    first = run_distributed(_train_rank, 2, args=(None, None, str(path), None), timeout_s=100)
    assert first[0] == pytest.approx(reference[:SAVED_AT], rel=LOSS_RTOL)
    from lightning_merak.checkpoint.safe_load import load_torch_file

    saved = load_torch_file(path)
    whole = dict(_model().named_parameters())["model.layers.0.mlp.experts.gate_up_proj"].shape
    assert saved["state_dict"]["model.model.layers.0.mlp.experts.gate_up_proj"].shape == whole
    assert any(entry["exp_avg"].shape == whole for entry in saved["optimizer_states"][0]["state"].values())
    resumed = run_distributed(_train_rank, 2, args=(None, None, None, str(path)), timeout_s=100)
    for losses in resumed:
        assert losses == pytest.approx(reference[SAVED_AT:], rel=LOSS_RTOL)
