"""Clipping by norm under Lightning's DDP with expert parallelism (``merak_ep``, and the DeepSpeed-MoE swap): the
norm counts every expert once, summed over the expert-parallel group, so every rank scales its gradients by one
factor, the replicated weights stay equal and training equals the unswapped model's on one process.

Before, each rank clipped by the norm of its own experts and the replicated weights: another factor per rank.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_merak.distributed.gradient_norm import ShardedGradients, clip_over_groups, installed_sharded_gradients
from lightning_merak.testing import run_distributed

STEPS, BATCH, SEQ, VOCAB, LEARNING_RATE, CLIP = 3, 8, 8, 128, 0.5, 0.05


class _TrainerStub:
    """The one trainer attribute the clipping reads: ``strategy.precision_plugin``."""

    def __init__(self, precision: Precision) -> None:
        self.strategy = type("Strategy", (), {"precision_plugin": precision})()


def test_one_norm_collects_every_callbacks_expert_groups() -> None:
    """Layers (or EmbRace's tables) registered one after another add to one norm, whoever installed it first."""
    precision = Precision()
    experts, more_experts, dense = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    clip_over_groups(_TrainerStub(precision), [experts], None)
    sharded = installed_sharded_gradients(precision)
    assert sharded is not None and precision.clip_grad_by_norm == sharded.clip
    group = object()  # registration runs no collective: any group stands in
    clip_over_groups(_TrainerStub(precision), [more_experts], group)
    assert installed_sharded_gradients(precision) is sharded
    assert (sharded.group_index(experts), sharded.group_index(more_experts), sharded.group_index(dense)) == (0, 1, None)

    tables = ShardedGradients()  # as EmbRace installs it under DDP
    precision = Precision()
    precision.clip_grad_by_norm = tables.clip
    clip_over_groups(_TrainerStub(precision), [experts], None)
    assert installed_sharded_gradients(precision) is tables and tables.group_index(experts) == 0


def test_a_precision_plugin_clipping_its_own_way_is_refused() -> None:
    class OwnClipping(Precision):
        def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
            """A clipping that would not count the other ranks' experts."""

    installed = Precision()
    installed.clip_grad_by_norm = lambda optimizer, clip_val: None  # another callback's clipping
    for precision in (OwnClipping(), installed):
        with pytest.raises(ValueError, match="clip_grad_by_norm of its own.*strategy=merak3d"):
            clip_over_groups(_TrainerStub(precision), [nn.Parameter(torch.ones(2))], None)
    assert installed_sharded_gradients(Precision()) is None


def test_lightnings_clipping_by_norm_on_one_rank_is_torchs(single_rank_group: Any) -> None:
    """Through the precision plugin's own ``clip_gradients``, an expert group of one rank is torch's clipping."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
    grads = [torch.randn_like(param) * 3 for param in params]
    reference = [nn.Parameter(param.detach().clone()) for param in params]
    for param, twin, grad in zip(params, reference, grads):
        param.grad, twin.grad = grad.clone(), grad.clone()
    precision = Precision()
    clip_over_groups(_TrainerStub(precision), params[:1], single_rank_group)
    precision.clip_gradients(torch.optim.SGD(params, lr=0.1), 1.0)  # by norm, Lightning's default
    assert float(torch.nn.utils.clip_grad_norm_(reference, 1.0)) > 1.0  # the clipping bit
    for param, twin in zip(params, reference):
        torch.testing.assert_close(param.grad, twin.grad)


# Two ranks against one process ----------------------------------------------------------------------------


def _model() -> nn.Module:
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    model = tiny_moe_model("mixtral", hidden=32, layers=2, vocab=VOCAB, seed=0)
    model.config.use_cache = False
    return model


def _batches() -> torch.Tensor:
    """``[steps, global batch, positions]``: each of the 2 ranks trains on half of each global batch."""
    return torch.randint(3, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def _sgd_module(model: nn.Module) -> pl.LightningModule:
    """Plain SGD: a wrongly scaled gradient changes the trajectory (Adam would hide it)."""
    from lightning_merak.modules.causal_lm import CausalLMModule

    class SGDModule(CausalLMModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE)

    return SGDModule(model)


def _dense_weight(model: nn.Module) -> torch.Tensor:
    return model.model.layers[0].self_attn.q_proj.weight.detach().clone()


class _FixedReplicas(pl.Callback):
    """Pro-Prophet replicas from the first step (the tiny model's loads plan none): expert 0 of rank 0 also on
    rank 1, the last expert of rank 1 also on rank 0. Their gradients return to the owners' parameters."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_merak.plugins.moe.core.placement import PlacementPlan, Replication
        from lightning_merak.plugins.moe.experts import experts_modules, set_replica_plans

        modules = experts_modules(pl_module.model)
        experts = pl_module.model.config.num_local_experts
        plan = PlacementPlan(experts, 2, (Replication(0, 0, (1,)), Replication(experts - 1, 1, (0,))))
        set_replica_plans(pl_module.model, {name: plan for name, _ in modules})


def _train_ddp(rank: int, world_size: int, experts: str, out: str) -> dict[str, Any]:
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_merak.callbacks import TrainingMetrics
    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from lightning_merak.testing.data import ReplicaBatches

    placement = "none" if experts == "merak_ep" else "auto"  # merak_ep: replicas of _FixedReplicas' plan
    config = ProphetMoEConfig(experts=experts, ep_size=2, placement=placement, dispatch="dropless",
                              aux_loss_coef=0.0, log_every_n_steps=1)
    model = config.apply(_model())
    module = _sgd_module(model)
    losses: list[float] = []

    class Recorder(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                               *args: Any) -> None:
            losses.append(float(outputs["loss"]))

    replicas = [_FixedReplicas()] if experts == "merak_ep" else []
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=DDPStrategy(process_group_backend="gloo"),
                         max_steps=STEPS, logger=CSVLogger(out, name="csv", version=0), log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         use_distributed_sampler=False, gradient_clip_val=CLIP,
                         callbacks=[Recorder(), TrainingMetrics(), *config.build_callbacks(), *replicas])
    trainer.fit(module, datamodule=ReplicaBatches(_batches(), 0, STEPS))
    return {"losses": losses, "dense": _dense_weight(model)}


def _reference() -> tuple[list[float], list[float], torch.Tensor]:
    """The unswapped model on one process, on the whole global batches, clipped by torch: losses, norms, a weight."""
    module = _sgd_module(_model())
    optimizer = module.configure_optimizers()
    losses, norms = [], []
    for batch in _batches():
        optimizer.zero_grad()
        loss = module.compute_loss((batch,))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(module.model.parameters(), CLIP)
        assert norm > 2 * CLIP, f"gradient norm {norm:.3g}: the clipping hardly bites, the test would prove little"
        optimizer.step()
        losses.append(loss.item())
        norms.append(float(norm))
    return losses, norms, _dense_weight(module.model)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("experts", ["merak_ep", "deepspeed"])
def test_clipping_under_ddp_with_expert_parallelism_equals_the_unswapped_model(experts: str, tmp_path: Path) -> None:
    """merak_ep with replicas of hot experts (counted once: no parameters of their own), and the DeepSpeed swap;
    the logged gradient norm is the one the clipping took, every expert counted once."""
    results = run_distributed(_train_ddp, 2, args=(experts, str(tmp_path)), timeout_s=240)
    reference, reference_norms, reference_dense = _reference()
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as handle:
        logged = [float(row["train/grad_norm"]) for row in csv.DictReader(handle) if row.get("train/grad_norm")]
    assert logged == pytest.approx(reference_norms, rel=1e-5)
    assert torch.equal(results[0]["dense"], results[1]["dense"]), "the ranks clipped by different factors"
    torch.testing.assert_close(results[0]["dense"], reference_dense, rtol=0, atol=1e-6)
    mean_losses = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert mean_losses == pytest.approx(reference, rel=1e-6, abs=0), (mean_losses, reference)
