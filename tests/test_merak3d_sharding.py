"""Data-parallel sharding (ZeRO-1/2) and overlapped bucketed reduction against a single-process reference."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_merak.parallel.data.buckets import DataParallelGradients
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed
from tests.test_merak3d import STEPS, _module, _ShardedData
from tests.test_merak3d import _reference as _merak3d_reference

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks


def _reference(model_name: str, clip: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process's losses with Adam, and its weights after the last step."""
    module = _module(model_name)
    trace = _merak3d_reference(model_name, "adam", clip, module=module)
    return trace.losses, {name: p.detach().clone() for name, p in module.model.named_parameters()}


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def _train_rank(rank: int, world_size: int, model_name: str, layout: dict, clip: float | None = None,
                first_step: int = 0, last_step: int = STEPS, epochs: int = 1, save_to: str | None = None,
                resume_from: str | None = None) -> dict:
    module = _module(model_name, "adam")
    recorder = _Losses()
    strategy = Merak3DStrategy(**layout, timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder], gradient_clip_val=clip,
    )
    trainer.fit(module, datamodule=_ShardedData(first_step, last_step), ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    state = {key[len("model."):]: value for key, value in strategy.lightning_module_state_dict().items()}
    reduction: DataParallelGradients | None = strategy._data_parallel
    optimizer = strategy.optimizers[0]
    return {
        "losses": recorder.losses,
        "weights": {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
                    for name, value in state.items()},
        "optimizer_elements": sum(v.numel() for s in optimizer.state.values() for v in s.values()
                                  if isinstance(v, torch.Tensor) and v.ndim > 0),
        "early_launches": reduction.early_launches if reduction is not None else 0,
        "norm": strategy.last_gradient_norm,
    }


def _check(results: list[dict], reference: tuple[list[float], dict[str, torch.Tensor]], atol: float = 5e-5) -> None:
    """Losses within 1e-5; weights after Adam's steps (which amplify summation-order differences in small
    gradients) within ``atol`` of the reference."""
    losses, weights = reference
    for result in results:
        assert result["losses"] == pytest.approx(losses, rel=1e-5)
        for name, value in result["weights"].items():
            if name not in weights:  # a tied copy (GPT-2's lm_head): the reference lists its weight once
                continue
            torch.testing.assert_close(value, weights[name], rtol=0, atol=atol, msg=name)


def test_zero_matches_single_process_and_splits_the_optimizer_state():
    """dp=2 with small buckets, so several are reduced while the backward runs; with ZeRO-1 and ZeRO-2 each rank
    keeps Adam's state for half of the elements, and the arithmetic is plain data parallelism's, element by element
    (also when ZeRO-1's updated parameters are gathered while the next forward runs)."""
    plain = run_distributed(_train_rank, 2, args=("llama", {"data_parallel": 2, "grad_bucket_mb": 0.01}),
                            timeout_s=300)
    _check(plain, _reference("llama"))
    assert plain[0]["early_launches"] > 0
    for options in ({"data_parallel_sharding": "optimizer"}, {"data_parallel_sharding": "gradients"},
                    {"data_parallel_sharding": "optimizer", "overlap_param_gather": True}):
        sharded = {"data_parallel": 2, "grad_bucket_mb": 0.01, **options}
        results = run_distributed(_train_rank, 2, args=("llama", sharded), timeout_s=300)
        _check(results, (plain[0]["losses"], plain[0]["weights"]), atol=1e-7)
        for result in results:
            assert result["optimizer_elements"] <= plain[0]["optimizer_elements"] / 2 + 64, options
            assert result["early_launches"] > 0, options


@pytest.mark.parametrize(("model_name", "layout", "clip"), [
    ("gpt2", {"data_parallel": 2, "pipeline_parallel": 2, "data_parallel_sharding": "optimizer"}, 0.05),
    ("llama", {"data_parallel": 2, "tensor_parallel": 2, "data_parallel_sharding": "gradients"}, 0.05),
    ("llama", {"data_parallel": 4, "data_parallel_sharding": "optimizer", "data_parallel_shard_size": 2}, None),
], ids=["gpt2-pp2dp2-zero1-clip", "llama-tp2dp2-zero2-clip", "llama-dp4-hybrid2"])
def test_zero_composes_with_pipeline_tensor_parallel_clipping_and_hybrid_sharding(model_name, layout, clip):
    """GPT-2's tied embedding lives on the first and last stage (summed after the backward, so its bucket waits);
    the pipeline's micro-batch gradients are divided with the replicas; clipping counts each shard once."""
    layout = {**layout, "grad_bucket_mb": 0.01}
    results = run_distributed(_train_rank, 4, args=(model_name, layout), kwargs={"clip": clip}, timeout_s=300)
    _check(results, _reference(model_name, clip))
    assert any(result["early_launches"] > 0 for result in results)


def test_checkpoints_resume_across_sharding_modes_and_layouts(tmp_path):
    """Saved with ZeRO-1 at dp=2 after 3 steps, resumed unsharded at pp=2 and with ZeRO-2 at dp=2: Adam's state
    comes back whole, so both continue the single-process trajectory; the checkpoint exports to Hugging Face."""
    checkpoint = str(tmp_path / "zero1.ckpt")
    losses, _ = _reference("llama")
    saved = {"data_parallel": 2, "data_parallel_sharding": "optimizer", "overlap_param_gather": True}
    first = run_distributed(_train_rank, 2, args=("llama", saved), timeout_s=300,
                            kwargs={"last_step": 3, "save_to": checkpoint})
    assert first[0]["losses"] == pytest.approx(losses[:3], rel=1e-5)
    from transformers import AutoModelForCausalLM

    from lightning_merak.hf.export import export_checkpoint

    export_checkpoint(checkpoint, tmp_path / "hf")  # a sharded run's checkpoint exports as any other's
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, value in exported.state_dict().items():
        if name in first[0]["weights"]:
            assert torch.equal(value, first[0]["weights"][name]), name
    for resumed in ({"data_parallel": 1, "pipeline_parallel": 2},
                    {"data_parallel": 2, "data_parallel_sharding": "gradients"}):
        second = run_distributed(_train_rank, 2, args=("llama", resumed), timeout_s=300,
                                 kwargs={"first_step": 3, "epochs": 2, "resume_from": checkpoint})
        assert second[0]["losses"] == pytest.approx(losses[3:], rel=1e-5), resumed


def _refused_rank(rank: int, world_size: int) -> str:
    module = _module("llama", "adam")
    module.configure_optimizers = lambda: torch.optim.LBFGS(module.model.parameters())
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False,
                         strategy=Merak3DStrategy(data_parallel=2, data_parallel_sharding="optimizer", timeout_s=60),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, limit_val_batches=0)
    try:
        trainer.fit(module, datamodule=_ShardedData(0, 1))
    except ValueError as error:
        return str(error)
    return "trained"


def test_an_optimizer_that_is_not_elementwise_is_refused_by_name():
    for result in run_distributed(_refused_rank, 2, timeout_s=120):
        assert "LBFGS does not update element by element" in result


def _adapter_rank(rank: int, world_size: int, sharding: str) -> dict:
    from lightning_merak.cli.options.adapter import QBaRAAdapterConfig, Quantization

    module = _module("llama", "adam")
    module.model = QBaRAAdapterConfig(quantization=Quantization.nf4, r=2, target_modules=("q_proj", "v_proj")).apply(
        module.model)
    recorder = _Losses()
    strategy = Merak3DStrategy(data_parallel=2, data_parallel_sharding=sharding, timeout_s=120)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, limit_val_batches=0, callbacks=[recorder])
    trainer.fit(module, datamodule=_ShardedData(0, 3))
    optimizer = strategy.optimizers[0]
    return {"losses": recorder.losses,
            "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "optimizer_params": sum(p.numel() for group in optimizer.param_groups for p in group["params"]
                                    if p.requires_grad),  # the frozen base stays in its group, never stepped
            "quantized_frozen": not any(p.requires_grad for n, p in module.named_parameters() if "base_layer" in n)}


def test_adapters_shard_only_their_trainable_parameters():
    """Q-BaRA on an NF4 base: the frozen quantized weights stay out of the buckets and the optimizer; ZeRO-1 splits
    the trainable parameters (adapters and everything left trainable) over the replicas, with the same losses."""
    plain = run_distributed(_adapter_rank, 2, args=("none",), timeout_s=300)
    sharded = run_distributed(_adapter_rank, 2, args=("optimizer",), timeout_s=300)
    for result in sharded:
        assert result["losses"] == pytest.approx(plain[0]["losses"], rel=1e-5)
        assert result["quantized_frozen"]
        assert plain[0]["optimizer_params"] == result["trainable"]
        assert result["optimizer_params"] <= result["trainable"] / 2 + 64


def _validated_first_rank(rank: int, world_size: int) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    from tests.test_merak3d import SEQ, _batches

    module = _module("llama", "adam")
    recorder = _Losses()
    strategy = Merak3DStrategy(data_parallel=2, data_parallel_sharding="optimizer", timeout_s=120)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=1, use_distributed_sampler=False,
                         callbacks=[recorder])
    trainer.validate(module, dataloaders=DataLoader(TensorDataset(_batches()[0, :4].reshape(-1, SEQ)), batch_size=4))
    trainer.fit(module, datamodule=_ShardedData(0, STEPS))
    optimizer = strategy.optimizers[0]
    return {"losses": recorder.losses,
            "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "optimizer_elements": sum(v.numel() for s in optimizer.state.values() for v in s.values()
                                      if isinstance(v, torch.Tensor) and v.ndim > 0)}


def test_a_layout_built_by_validate_shards_the_optimizers_fit_creates():
    """The layout is built in ``validate``; ``fit`` then makes new optimizers, which are sharded all the same."""
    losses, _ = _reference("llama")
    for result in run_distributed(_validated_first_rank, 2, timeout_s=300):
        assert result["losses"] == pytest.approx(losses, rel=1e-5)
        assert result["optimizer_elements"] <= result["trainable"] + 64  # Adam's two moments of half the elements
