"""The DeepSpeed-MoE swap (``moe.experts=deepspeed``) under scaled losses, autocast and bf16 models, one process.

The router's load-balancing gradient equals that of ``coef × l_aux`` added to the training loss, under Lightning's
gradient accumulation and a GradScaler's loss scale; the layer runs under bf16 autocast; a bf16 model is swapped in
its dtype; top-k above 2 is refused naming ``merak_ep``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_merak.plugins.moe import MoE, MoEOptions, swap_sparse_moe_blocks
from lightning_merak.plugins.moe.aux_gradient import scale_aux_gradients_by_loss
from lightning_merak.plugins.moe.block_replacement import SwappedSparseBlock
from lightning_merak.plugins.moe.experts.families import tiny_moe_model
from lightning_merak.testing.causal_lm import FixedOptimizerModule

COEF = 1.0
ROUTER = "model.layers.0.mlp.moe.deepspeed_moe.gate.wg.weight"


def _batches(count: int) -> list[torch.Tensor]:
    return [torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(count)]


def _swapped(coef: float, **overrides: Any) -> tuple[nn.Module, list[SwappedSparseBlock]]:
    model = tiny_moe_model("mixtral", num_experts_per_tok=2, **overrides)
    blocks = swap_sparse_moe_blocks(model, 1, MoEOptions(dispatch="dropless"), drop_tokens=False, aux_loss_coef=coef)
    return model, blocks


def _reference_router_grad(batches: list[torch.Tensor], divided_by: float) -> torch.Tensor:
    """``(LM + coef × Σ l_aux) / divided_by`` per batch, back-propagated by hand with no aux gradient injected."""
    model, blocks = _swapped(0.0)
    module = FixedOptimizerModule(model, "sgd", lr=1.0)
    module.train()
    for ids in batches:
        loss = module.compute_loss(ids) + COEF * sum(b.moe.deepspeed_moe.l_aux for b in blocks)
        (loss / divided_by).backward()
    return dict(model.named_parameters())[ROUTER].grad.clone()


class _AuxScaledModule(FixedOptimizerModule):
    """Hooks the loss its training step returns, before Lightning divides and scales it, as a LightningModule that
    trains a swapped model does."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        scale_aux_gradients_by_loss(loss)
        return loss


class _ScalerWithoutAutocast(MixedPrecision):
    """Lightning's 16-mixed loss scaling (a GradScaler at 2^16) in float32: compares with a float32 reference."""

    def __init__(self) -> None:
        super().__init__("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=65536.0))

    def autocast_context_manager(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _RouterGrad(pl.Callback):
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grad = dict(pl_module.model.named_parameters())[ROUTER].grad.clone()


@pytest.mark.parametrize("loss_scaling", [False, True], ids=["32-true", "16-mixed-scaler"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_aux_gradient_follows_lightnings_accumulation_and_loss_scale(accumulate: int, loss_scaling: bool) -> None:
    batches = _batches(accumulate)
    model, _ = _swapped(COEF)
    grad = _RouterGrad()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=accumulate, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[grad], plugins=[_ScalerWithoutAutocast()] if loss_scaling else None)
    trainer.fit(_AuxScaledModule(model, "sgd", lr=1.0),
                train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    torch.testing.assert_close(grad.grad, _reference_router_grad(batches, accumulate), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("model_loss", [True, False], ids=["model-loss-with-labels", "loss-of-its-own"])
def test_aux_gradient_follows_a_grad_scalers_loss_scale(model_loss: bool) -> None:
    """The model's own ``output.loss`` is hooked by the swap; a loss computed outside it is hooked by the caller."""
    ids = _batches(1)[0]
    model, _ = _swapped(COEF)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    if model_loss:
        loss = model(ids, labels=ids).loss
    else:
        loss = FixedOptimizerModule(model, "sgd", lr=0.1).compute_loss(ids)
        scale_aux_gradients_by_loss(loss)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.testing.assert_close(dict(model.named_parameters())[ROUTER].grad, _reference_router_grad([ids], 1.0),
                               rtol=1e-4, atol=1e-7)


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


@pytest.mark.parametrize("options", [dict(), dict(drop_tokens=False, dispatch="dropless")],
                         ids=["capacity", "dropless"])
def test_layer_under_bf16_autocast_matches_float32_within_bf16(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    layer = MoE(hidden_size=16, expert=_expert(), num_experts=4, k=2, min_capacity=2, use_rts=False, **options)
    x = torch.randn(2, 8, 16)
    results = []
    for autocast in (False, True):
        inputs = x.clone().requires_grad_(True)
        layer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, aux, _ = layer(inputs)
        (out.float().square().mean() + aux).backward()
        results.append((out.float(), inputs.grad, [p.grad.clone() for p in layer.parameters()]))
    (out32, dx32, grads32), (out16, dx16, grads16) = results
    torch.testing.assert_close(out16, out32, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx16, dx32, rtol=5e-2, atol=5e-3)
    for grad16, grad32 in zip(grads16, grads32):
        torch.testing.assert_close(grad16, grad32, rtol=5e-2, atol=5e-3)


def test_a_bf16_model_is_swapped_in_its_dtype() -> None:
    ids = _batches(1)[0]
    eager = tiny_moe_model("mixtral", num_experts_per_tok=2, dtype=torch.bfloat16)
    model, blocks = _swapped(0.0, dtype=torch.bfloat16)
    layer = blocks[0].moe.deepspeed_moe
    assert {p.dtype for p in layer.experts.parameters()} == {torch.bfloat16}
    assert layer.gate.wg.weight.dtype == torch.float32  # DeepSpeed's gate computes in float32
    loss = model(ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss.float(), eager(ids, labels=ids).loss.float(), rtol=2e-2, atol=2e-2)
    assert all(p.grad is not None for p in layer.experts.parameters())


def test_top_k_above_two_names_merak_ep() -> None:
    from lightning_merak.cli.options.moe import ProphetMoEConfig

    with pytest.raises(ValueError, match=r"model\.config\.num_experts_per_tok=3: only top-1 and top-2 .*pass 1 or "
                                         r"2, or .*moe\.experts=merak_ep, which keeps the model's own router and "
                                         r"runs any top-k"):
        ProphetMoEConfig(ep_size=1, placement="none").apply(tiny_moe_model("mixtral", num_experts_per_tok=3))


def _under_autocast_against_deepspeed(rank: int, world_size: int) -> dict[str, float]:
    """Both layers under bf16 autocast, same weights and tokens; ours runs a forced replica of expert 0 on rank 1
    (the replica path) and two Lancet chunks (the chunked path), each from this step's counts and prefetched."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from lightning_merak.distributed.deepspeed_comm import init_deepspeed_comm
    from lightning_merak.plugins.moe import PlacementPlan, Replication, StepChoice

    init_deepspeed_comm("gloo")
    worst: dict[str, float] = {}
    for dropless in (False, True):
        for timing in ("current", "predicted"):
            kwargs = dict(hidden_size=16, num_experts=4, ep_size=world_size, k=2, min_capacity=2,
                          drop_tokens=not dropless, use_rts=False, top2_2nd_expert_sampling=False)
            torch.manual_seed(0)
            reference = DeepSpeedMoE(expert=_expert(), **kwargs)
            reference.set_deepspeed_parallelism()
            ours = MoE(expert=_expert(), **kwargs, dispatch="dropless" if dropless else "capacity", lancet_chunks=2)
            ours.load_state_dict(reference.state_dict())
            forced = PlacementPlan(4, world_size, (Replication(0, 0, (1,)),))
            layer = ours.deepspeed_moe
            layer._choose = lambda counts, padding, prefetched: StepChoice("pro_prophet", timing, forced, padding, 0.0)
            layer.prefetch_plan = forced if timing == "predicted" else None
            x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(rank))
            results = []
            for model in (reference, ours):
                inputs = x.clone().requires_grad_(True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out, aux, _ = model(inputs)
                (out.float().square().mean() + aux).backward()
                results.append((out.float(), inputs.grad, {n: p.grad for n, p in model.named_parameters()}))
            (ref_out, ref_dx, ref_grads), (our_out, our_dx, our_grads) = results
            assert layer.stats["plan"].replications, "the forced replica did not run"
            case = f"{'dropless' if dropless else 'capacity'}/{timing}"
            worst[f"{case} output"] = ((ref_out - our_out).abs().max() / ref_out.abs().max()).item()
            worst[f"{case} input grad"] = ((ref_dx - our_dx).abs().max() / ref_dx.abs().max()).item()
            for name, grad in ref_grads.items():
                worst[f"{case} {name}"] = ((grad - our_grads[name]).abs().max() / grad.abs().max()).item()
    return worst


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_layer_under_bf16_autocast_matches_deepspeeds_on_two_ranks_with_replicas_and_chunks() -> None:
    from lightning_merak.testing import run_distributed

    for rank, worst in enumerate(run_distributed(_under_autocast_against_deepspeed, 2, timeout_s=200)):
        name = max(worst, key=worst.get)
        assert worst[name] < 3e-2, f"rank {rank}: {name} differs by {worst[name]:.3g} of its largest value"
