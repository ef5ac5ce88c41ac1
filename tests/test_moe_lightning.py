"""A Mixtral-style tiny model, swapped to our MoE (ep_size=2), trains under Lightning DDP on 2 gloo
ranks, and under merak3d with pipeline_parallel=2 × data_parallel=2 on 4, exactly like the original
single-process model on the union of the data-parallel ranks' batches.

The README's `merak-train model=mixtral_tiny moe=prophet` (2 processes, merak3d, the load heatmap
in the log dir) runs in tests/test_readme.py."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.modules.config import ModelConfig, OptimConfig
from lightning_merak.testing import run_distributed

STEPS, BATCH, SEQ, VOCAB = 5, 4, 16, 64
MODEL = ModelConfig(name="mixtral_test", model_type="mixtral", config=dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False))
OPTIM = OptimConfig(learning_rate=3e-3, warmup_steps=2, total_steps=STEPS)


def _model(seed: int = 0) -> torch.nn.Module:
    from lightning_merak.modules.causal_lm import build_causal_lm

    torch.manual_seed(seed)
    return build_causal_lm(MODEL, VOCAB)


def _batches(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=generator)


class _Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def train_swapped(rank: int, world_size: int, options: dict[str, Any]) -> dict[str, Any]:
    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.plugins.moe.block_replacement import SwappedSparseBlock

    config = ProphetMoEConfig(ep_size=2, aux_loss_coef=0.0, log_every_n_steps=1, **options)
    model = config.apply(_model())
    module = CausalLMModule(model, OPTIM)
    recorder = _Recorder()
    moe_callback = config.build_callbacks()[0]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, gradient_clip_val=None, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[recorder, moe_callback],
    )
    trainer.fit(module, DataLoader(TensorDataset(_batches(rank)), batch_size=BATCH))
    blocks = [m for m in model.modules() if isinstance(m, SwappedSparseBlock)]
    return {
        "losses": recorder.losses,
        "dense": model.model.layers[0].self_attn.q_proj.weight.detach().clone(),
        "expert": blocks[0].moe.deepspeed_moe.experts.deepspeed_experts[0].gate_up.weight.detach().clone(),
        "history": moe_callback.history[0][1],
        "logged": sorted(k for k in trainer.callback_metrics if k.startswith("moe/")),
    }


def _train_on_union(module: pl.LightningModule, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                    clip: float | None = None, norms: list[float] | None = None) -> list[float]:
    """Losses of one process trained on the union of the two data-parallel ranks' batches.

    With ``clip``, gradients are clipped to that norm and the norms before clipping appended to ``norms``.
    """
    data = [_batches(rank) for rank in range(2)]
    losses = []
    for step in range(STEPS):
        batch = torch.cat([d[step * BATCH:(step + 1) * BATCH] for d in data])
        optimizer.zero_grad()
        loss = module.compute_loss((batch,))
        loss.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(module.model.parameters(), clip)
            assert norm > clip, (
                f"step {step}: gradient norm {norm:.3g} <= {clip}; the clipping test would prove nothing"
            )
            if norms is not None:
                norms.append(float(norm))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def _reference_losses() -> list[float]:
    from lightning_merak.modules.causal_lm import CausalLMModule

    module = CausalLMModule(_model(), OPTIM)
    setup = module.configure_optimizers()
    return _train_on_union(module, setup["optimizer"], setup["lr_scheduler"]["scheduler"])


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_mixtral_tiny_trains_like_the_original_under_lightning_ddp() -> None:
    options = dict(dispatch="dropless", placement="auto", lancet_chunks="2")
    results = run_distributed(train_swapped, 2, args=(options,), timeout_s=200)
    reference = _reference_losses()
    mean_losses = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert len(mean_losses) == STEPS
    for step, (ours, expected) in enumerate(zip(mean_losses, reference)):
        assert abs(ours - expected) < 1e-4 * abs(expected), f"step {step}: {ours} vs reference {expected}"
    assert torch.equal(results[0]["dense"], results[1]["dense"]), "dense parameters diverged across ranks"
    assert not torch.equal(results[0]["expert"], results[1]["expert"]), "each EP rank must hold different experts"
    assert len(results[0]["history"]) == STEPS
    assert {"moe/layer0/rb", "moe/layer0/maxvio", "moe/layer0/aux_loss", "moe/layer0/plan_kind",
            "moe/layer0/plan_from_previous_step", "moe/layer0/measured_ms", "moe/layer0/corrected_ms",
            "moe/layer0/explored"} <= set(results[0]["logged"])


class _LoggedLoss(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.gradient_norms: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        norm = getattr(trainer.strategy, "last_gradient_norm", None)
        if norm is not None:
            self.gradient_norms.append(norm)


SGD_LR = 1.0


def _sgd_module(model: torch.nn.Module) -> pl.LightningModule:
    """Plain SGD: a wrongly scaled expert gradient changes the trajectory (Adam would hide it)."""
    from lightning_merak.modules.causal_lm import CausalLMModule

    class SGDModule(CausalLMModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.model.parameters(), lr=SGD_LR)

    return SGDModule(model, OPTIM)


def train_merak3d(rank: int, world_size: int, options: dict[str, Any], clip: float | None = None,
                  sharding: str = "none", ep_size: int = 2) -> dict[str, Any]:
    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    config = ProphetMoEConfig(ep_size=ep_size, aux_loss_coef=0.0, log_every_n_steps=1, **options)
    module = _sgd_module(config.apply(_model()))
    recorder, moe_callback = _LoggedLoss(), config.build_callbacks()[0]
    strategy = Merak3DStrategy(data_parallel=2, pipeline_parallel=2, tensor_parallel=1, micro_batches=2,
                               partition="uniform", data_parallel_sharding=sharding, timeout_s=150)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder, moe_callback],
        gradient_clip_val=clip,
    )
    data_rank = rank % 2  # mesh (pp, dp, tp) = (2, 2, 1): rank = 2·pp + dp
    trainer.fit(module, DataLoader(TensorDataset(_batches(data_rank)), batch_size=BATCH))
    local = [layer for layer in moe_callback._layers if layer.stats]
    return {"losses": recorder.losses, "gradient_norms": recorder.gradient_norms,
            "ep_ranks": [layer.groups.ep_ranks for layer in local], "experts": local_experts(strategy),
            "sampler_rank": strategy.distributed_sampler_kwargs["rank"]}


def local_experts(strategy: Any) -> dict[tuple[int, int], torch.Tensor]:
    """(block index, global expert number) → gate/up weight of every expert on this rank under merak3d."""
    from lightning_merak.plugins.moe.layer import PlacementMOELayer

    experts = {}
    for index, block in strategy.local_blocks.items():
        for layer in (m for m in block.modules() if isinstance(m, PlacementMOELayer)):
            first = layer.ep_rank * layer.num_local_experts
            for j, expert in enumerate(layer.experts.deepspeed_experts):
                experts[(index, first + j)] = expert.gate_up.weight.detach().clone()
    return experts


def _sgd_reference(learning_rate: float = SGD_LR, clip: float | None = None,
                   norms: list[float] | None = None) -> tuple[list[float], dict[tuple[int, int], torch.Tensor]]:
    """Losses of one process on the union of the data-parallel batches, and (layer, expert) → gate/up weight.

    ``clip`` and ``norms`` as in :func:`_train_on_union`.
    """
    module = _sgd_module(_model())
    optimizer = module.configure_optimizers()
    optimizer.param_groups[0]["lr"] = learning_rate
    losses = _train_on_union(module, optimizer, clip=clip, norms=norms)
    blocks = [m for m in module.model.modules() if hasattr(getattr(m, "experts", None), "gate_up_proj")]
    experts = {(i, e): block.experts.gate_up_proj[e].detach().clone()
               for i, block in enumerate(blocks) for e in range(block.experts.gate_up_proj.shape[0])}
    return losses, experts


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_mixtral_tiny_under_merak3d_pipeline_and_data_parallel() -> None:
    """pp=2 × dp=2: EP groups are carved from each stage's data-parallel ranks; training equals one process."""
    options = dict(dispatch="dropless", placement="pro_prophet", lancet_chunks="2")
    results = run_distributed(train_merak3d, 4, args=(options,), timeout_s=240)
    reference, reference_experts = _sgd_reference()
    untrained, initial_experts = _sgd_reference(learning_rate=0.0)
    moved = max(abs(a - b) for a, b in zip(reference, untrained))
    assert moved > 1e-2, f"training moved the losses by {moved:.3g} only; the comparison would prove nothing"
    trained_experts = {key: value for result in results for key, value in result["experts"].items()}
    assert set(trained_experts) == set(reference_experts), "every (layer, expert) must live on some rank"
    for key, expected in reference_experts.items():
        step, want = trained_experts[key] - initial_experts[key], expected - initial_experts[key]
        error = (step - want).norm() / want.norm()
        assert error < 1e-3, f"(layer, expert) {key}: update off by {error:.3g} relative (wrongly scaled gradient?)"
    for rank, result in enumerate(results):
        stage_ranks = [rank - rank % 2, rank - rank % 2 + 1]
        assert result["ep_ranks"] and all(ranks == stage_ranks for ranks in result["ep_ranks"]), result["ep_ranks"]
        for step, (ours, expected) in enumerate(zip(result["losses"], reference)):
            assert abs(ours - expected) < 1e-5 * abs(expected), f"rank {rank} step {step}: {ours} vs {expected}"
        assert len(result["losses"]) == STEPS
    assert [result["sampler_rank"] for result in results] == [0, 1, 0, 1], "data shards do not follow the mesh"


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("sharding", "ep_size"), [("none", 2), ("optimizer", 2), ("none", 1)])
def test_gradient_clipping_under_merak3d_counts_every_expert_once(sharding: str, ep_size: int) -> None:
    """The clipping norm sums expert weights over their expert-parallel group (each rank holds other experts).
    With ZeRO-1 the replicated weights' optimizer state is sharded over the data-parallel ranks and the experts'
    (reduced over their own groups by the MoE layers) is not: the same norms and steps. At ``ep_size=1`` every
    rank holds every expert, reduced over the whole data-parallel group."""
    clip = 0.05
    options = dict(dispatch="capacity", placement="none")
    results = run_distributed(train_merak3d, 4, args=(options, clip, sharding, ep_size), timeout_s=240)
    norms: list[float] = []
    reference, reference_experts = _sgd_reference(clip=clip, norms=norms)
    _, initial_experts = _sgd_reference(learning_rate=0.0)
    for rank, result in enumerate(results):
        assert len(result["gradient_norms"]) == STEPS
        for step, (ours, expected) in enumerate(zip(result["gradient_norms"], norms)):
            assert abs(ours - expected) < 1e-5 * expected, f"rank {rank} step {step}: norm {ours} vs {expected}"
    trained_experts = {key: value for result in results for key, value in result["experts"].items()}
    for key, expected in reference_experts.items():
        step, want = trained_experts[key] - initial_experts[key], expected - initial_experts[key]
        error = (step - want).norm() / want.norm()
        assert error < 1e-3, f"(layer, expert) {key}: clipped update off by {error:.3g} relative"
    for rank, result in enumerate(results):
        for step, (ours, expected) in enumerate(zip(result["losses"], reference)):
            assert abs(ours - expected) < 1e-5 * abs(expected), f"rank {rank} step {step}: {ours} vs {expected}"


# Load heatmap: where it goes ------------------------------------------------------------------


class _TrainerStub:
    """The trainer attributes the heatmap needs; counts reads of ``log_dir`` (a broadcast in Lightning)."""

    def __init__(self, log_dir: str, is_global_zero: bool, loggers: tuple[str, ...] = ("csv",)) -> None:
        self._log_dir, self.is_global_zero, self.default_root_dir, self.log_dir_reads = log_dir, is_global_zero, "", 0
        self.loggers = list(loggers)

    @property
    def log_dir(self) -> str:
        self.log_dir_reads += 1
        return self._log_dir


def test_heatmap_in_log_dir_reads_the_log_dir_on_every_rank_and_rank_0_writes_it(tmp_path: Any) -> None:
    from lightning_merak.callbacks.moe.placement import MoEPlacementCallback

    callback = MoEPlacementCallback(heatmap_in_log_dir=True)
    other, zero = _TrainerStub(str(tmp_path / "other"), False), _TrainerStub(str(tmp_path), True)
    callback.on_train_end(other, None)  # type: ignore[arg-type]  # this rank saw no MoE layer (history empty)
    assert other.log_dir_reads == 1, "a rank other than 0 skipped trainer.log_dir, a collective: rank 0 would hang"
    assert not (tmp_path / "other").exists()
    callback.history = {1: ([[3, 1], [2, 2]], [[2, 2], [2, 2]])}  # a pipeline stage holding layer 1 only
    callback.on_train_end(zero, None)  # type: ignore[arg-type]
    assert zero.log_dir_reads == 1 and (tmp_path / MoEPlacementCallback.HEATMAP_FILE).is_file()
    unlogged = _TrainerStub(str(tmp_path / "unlogged"), True, loggers=())
    callback.on_train_end(unlogged, None)  # type: ignore[arg-type]  # logger=False: no log files, no heatmap
    assert unlogged.log_dir_reads == 0 and not (tmp_path / "unlogged").exists()
    with pytest.raises(ValueError, match="pass one of them"):
        MoEPlacementCallback(heatmap_path=str(tmp_path / "h.png"), heatmap_in_log_dir=True)
