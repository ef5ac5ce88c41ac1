"""``data_parallel_sharding="full"`` (FSDP2 on merak3d's dp dimension) against a single-process reference."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.pipeline.stage import RankStages
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.strategies.merak3d.arguments import check_fully_shardable
from lightning_merak.testing import run_distributed
from lightning_merak.testing.causal_lm import FixedOptimizerModule

STEPS, BATCH, SEQ, VOCAB, CLIP = 4, 8, 16, 96, 0.5
LLAMA = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False})


def _batches() -> torch.Tensor:
    return torch.randint(VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(3))



def _module(adam: bool) -> FixedOptimizerModule:
    torch.manual_seed(0)
    model = build_causal_lm(LLAMA, vocab_size=VOCAB)
    model.config.use_cache = False
    return FixedOptimizerModule(model, optimizer="adam" if adam else "sgd")


def _reference(clip: float | None, adam: bool = False,
               batches: torch.Tensor | None = None) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Losses, gradient norms before clipping and final weights of one process on the whole batches."""
    module = _module(adam)
    optimizer = module.configure_optimizers()
    losses, norms = [], []
    for batch in _batches() if batches is None else batches:
        optimizer.zero_grad()
        loss = module.compute_loss((batch,))
        loss.backward()
        params = list(module.model.parameters())
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else math.inf)
        losses.append(loss.item())
        norms.append(norm.item())
        optimizer.step()
    return losses, norms, {name: param.detach().clone() for name, param in module.model.named_parameters()}


class _Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.gathered_after_validation: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.norms.append(getattr(trainer.strategy, "last_gradient_norm", None) or 0.0)  # none under DDP

    def on_validation_batch_end(self, trainer, pl_module, *args) -> None:
        """Whole parameters left registered after an evaluation forward (none when they are resharded)."""
        self.gathered_after_validation.append(
            sum(not isinstance(param, DTensor) for param in pl_module.model.parameters()))


class _ShardedData(pl.LightningDataModule):
    """Each data-parallel rank gets its slice of global batches ``first_step`` to ``last_step``; one validation
    batch runs in the sanity check, before any training step."""

    def __init__(self, first_step: int, last_step: int) -> None:
        super().__init__()
        self.first_step, self.last_step = first_step, last_step

    def _loader(self, first: int, last: int) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        shard = BATCH // kwargs["num_replicas"]
        local = _batches()[first:last, kwargs["rank"] * shard:(kwargs["rank"] + 1) * shard]
        return DataLoader(TensorDataset(local.reshape(-1, SEQ)), batch_size=shard, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.first_step, self.last_step)

    def val_dataloader(self) -> DataLoader:
        return self._loader(0, 1)


def _full_weights(strategy: Merak3DStrategy, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    weights = {}
    for name, param in model.named_parameters():
        original = model.original_name(name) if isinstance(model, RankStages) else name
        full = param.full_tensor() if isinstance(param, DTensor) else param
        weights[original] = strategy.to_original_layout(original, full).detach().clone()
    return weights


def _train_rank(rank: int, world_size: int, layout: dict, first_step: int = 0, last_step: int = STEPS,
                epochs: int = 1, clip: float | None = None, save_to: str | None = None,
                resume_from: str | None = None, adam: bool = False) -> dict:
    module = _module(adam)
    recorder = _Recorder()
    strategy = Merak3DStrategy(**layout, timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
        limit_val_batches=1, val_check_interval=None, check_val_every_n_epoch=100, use_distributed_sampler=False,
        callbacks=[recorder], gradient_clip_val=clip,
    )
    trainer.fit(module, datamodule=_ShardedData(first_step, last_step), ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    params = list(module.model.parameters())  # this rank's stages; a DTensor's numel() is its whole tensor's
    held = sum((param.to_local() if isinstance(param, DTensor) else param).numel() for param in params)
    return {"losses": recorder.losses, "norms": recorder.norms, "gathered": recorder.gathered_after_validation,
            "held": held / sum(p.numel() for p in params),
            "weights": _full_weights(strategy, module.model)}


def _run(layout: dict, world_size: int, **kwargs) -> list[dict]:
    return run_distributed(_train_rank, world_size, args=(layout,), kwargs=kwargs, timeout_s=240)


def _world(layout: dict) -> int:
    return math.prod(layout.get(key, 1) for key in ("data_parallel", "pipeline_parallel", "tensor_parallel"))


def _assert_matches(results: list[dict], reference: tuple, steps: slice = slice(None), atol: float = 1e-5) -> None:
    losses, norms, weights = reference
    gathered: dict[str, torch.Tensor] = {}
    for result in results:
        assert result["losses"] == pytest.approx(losses[steps], abs=1e-5)
        gathered.update(result["weights"])
    assert gathered.keys() == weights.keys()
    for name, expected in weights.items():
        torch.testing.assert_close(gathered[name], expected, atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.distributed
def test_full_sharding_matches_single_process_at_dp2():
    """Two ranks each hold half of every parameter (and of its gradient and optimizer state), also after the
    sanity check's forward without gradients."""
    results = _run({"data_parallel": 2, "data_parallel_sharding": "full"}, 2)
    _assert_matches(results, _reference(None))
    for result in results:
        assert result["held"] == pytest.approx(0.5, abs=0.02)
        assert result["gathered"] == [0]


@pytest.mark.distributed
def test_full_sharding_with_tensor_parallel_clips_by_the_whole_norm():
    """dp=2 × tp=2: blocks split over tp, then every parameter sharded over dp (2-D DTensors); clipping sums the
    squares over the dp shards, the tp shards, and counts the tp-replicated norms once."""
    reference = _reference(CLIP)
    results = _run({"data_parallel": 2, "tensor_parallel": 2, "pipeline_parallel": 1,
                    "data_parallel_sharding": "full"}, 4, clip=CLIP)
    _assert_matches(results, reference)
    for result in results:
        assert result["norms"] == pytest.approx(reference[1], rel=1e-5)
        assert 0.25 <= result["held"] < 0.3  # a quarter of the split tensors, half of the norms


@pytest.mark.distributed
def test_full_sharding_with_pipeline_parallel_matches_single_process():
    """pp=2 × dp=2, 1F1B: each stage's gradients are reduce-scattered once, after its last micro-batch."""
    reference = _reference(CLIP)
    results = _run({"data_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 1,
                    "data_parallel_sharding": "full"}, 4, clip=CLIP)
    _assert_matches(results, reference)
    for result in results:
        assert result["norms"] == pytest.approx(reference[1], rel=1e-5)
        assert result["held"] == pytest.approx(0.5, abs=0.02)


@pytest.mark.distributed
def test_hybrid_sharding_shards_in_pairs_and_replicates_across():
    """dp=4 with shard groups of 2 (HSDP): each rank holds half of every parameter."""
    reference = _reference(CLIP)
    results = _run({"data_parallel": 4, "data_parallel_sharding": "full", "data_parallel_shard_size": 2}, 4,
                   clip=CLIP)
    _assert_matches(results, reference)
    for result in results:
        assert result["norms"] == pytest.approx(reference[1], rel=1e-5)
        assert result["held"] == pytest.approx(0.5, abs=0.02)


@pytest.mark.distributed
def test_checkpoints_resume_across_sharding_modes_and_layouts(tmp_path):
    """Saved fully sharded at dp=2 × tp=2 (2-D DTensors) and resumed unsharded at pp=2, and saved unsharded at
    dp=2 and resumed fully sharded at dp=2 × tp=2: both continue the single-process trajectory (weights and Adam
    state). Adam turns the tensor-parallel split's rounding (~1e-7 in the gradients) into ~5e-5 in a few small
    weights, with or without sharding."""
    reference = _reference(None, adam=True)
    half = STEPS // 2
    for index, (saved, resumed) in enumerate([
        ({"data_parallel": 2, "tensor_parallel": 2, "data_parallel_sharding": "full"},
         {"data_parallel": 1, "pipeline_parallel": 2}),
        ({"data_parallel": 2}, {"data_parallel": 2, "tensor_parallel": 2, "data_parallel_sharding": "full"}),
    ]):
        checkpoint = str(tmp_path / f"saved{index}.ckpt")
        first = _run(saved, _world(saved), last_step=half, save_to=checkpoint, adam=True)
        assert first[0]["losses"] == pytest.approx(reference[0][:half], abs=1e-5)
        second = _run(resumed, _world(resumed), first_step=half, epochs=2, resume_from=checkpoint, adam=True)
        _assert_matches(second, reference, slice(half, None), atol=1e-4)


@pytest.mark.parametrize(("arguments", "reason"), [
    ({"pipeline_parallel": 2, "schedule": "shifted_critical_path"}, "cool-down forwards"),
    ({"tensor_parallel": 2, "tp_overlap": 2}, "threads of their own"),
    ({"tensor_parallel": 2, "tp_overlap": "auto"}, "set tp_overlap=1"),
])
def test_full_sharding_refuses_what_fsdp2_cannot_run(arguments, reason):
    with pytest.raises(ValueError, match=reason):
        Merak3DStrategy(data_parallel=2, data_parallel_sharding="full", **arguments)


def test_full_sharding_refuses_key_value_heads_shared_by_tensor_ranks():
    model = build_causal_lm(LLAMA, vocab_size=VOCAB)  # 2 key/value heads
    check_fully_shardable(model, 2)
    with pytest.raises(ValueError, match="tensor_parallel <= 2"):
        check_fully_shardable(model, 4)
