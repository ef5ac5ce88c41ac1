"""A transformers MoE model's router aux loss under merak3d pipeline stages (``output_router_logits=True``).

Stages record their routers' logits and carry them down the pipeline; the last stage adds the family's own
``load_balancing_loss_func`` to each micro-batch's loss. The reference is the unsplit model with labels over
the same micro-batches (gradient accumulation): each micro-batch's aux loss is over its own tokens.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.parallel.pipeline.router_aux import (
    RouterAuxLoss,
    carried_router_logits,
    router_aux_of,
)
from lightning_merak.testing import run_distributed
from lightning_merak.testing.data import ReplicaBatches

STEPS, BATCH, SEQ, VOCAB, LR, COEF = 2, 8, 8, 128, 0.5, 0.5


def _model(family: str) -> torch.nn.Module:
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    return tiny_moe_model(family, hidden=32, layers=2, vocab=VOCAB, seed=0, output_router_logits=True,
                          router_aux_loss_coef=COEF, use_cache=False)


def _ids(seed: int, batch: int = 4) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


# Pure parts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_carried_router_logits_give_the_models_own_aux_loss(family: str) -> None:
    """Per-layer logits appended stage by stage ([batch, layers, seq, experts]) give coef × the forward's aux loss."""
    model = _model(family)
    ids = _ids(1)
    output = model(ids)
    aux = router_aux_of(model, model.model.layers)
    first, second = output.router_logits
    carried = carried_router_logits(carried_router_logits(None, [first], 4, SEQ), [second], 4, SEQ)
    assert carried.shape == (4, 2, SEQ, aux.num_experts)
    assert torch.equal(carried[:, 1].reshape(-1, aux.num_experts), second)
    assert aux.weighted_loss(carried).item() == pytest.approx(COEF * output.aux_loss.item(), rel=1e-6)
    assert output.aux_loss.item() > 0
    with pytest.raises(ValueError, match="one row per token"):
        carried_router_logits(None, [first[:-1]], 4, SEQ)


def _stage_chain(family: str, boundaries: tuple[int, ...], sub_batches: int, recompute: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss, weighted aux and gradients of ``model``'s stages run one after another in this process."""
    from lightning_merak.distributed.sub_batches import SubBatchForward
    from lightning_merak.parallel.pipeline.stage import build_stage_module
    from lightning_merak.parallel.pipeline.trace import trace_model
    from lightning_merak.protocols.layout_aware import RecomputedForward
    from lightning_merak.strategies.merak3d.build import call_model

    model = _model(family)
    ids = _ids(2)
    trace = trace_model(model, ids, call_model, profile=False)
    aux = router_aux_of(model, model.model.layers)
    stages = [build_stage_module(copy.deepcopy(model), trace, boundaries, index, call_model, aux)
              for index in range(len(boundaries))]
    for stage in stages:
        for index in stage.block_indices:
            block = stage.net.model.layers[index]
            if recompute:
                block.forward = RecomputedForward(block.forward)
        if sub_batches > 1:
            stage.forward = SubBatchForward(stage, sub_batches)
    loss_fn = RouterAuxLoss(CausalLMModule(model).loss_from_logits, aux)
    outputs: Any = (ids,)
    for stage in stages:
        outputs = stage(*outputs)
        if not stage.is_last:
            carried = outputs[-1] if stage.routers is not None else None
            routers = sum(s.routers.count for s in stages[:stage.stage_index + 1] if s.routers is not None)
            assert (carried is None) == (routers == 0)
            if carried is not None:
                assert carried.shape == (4, routers, SEQ, aux.num_experts)
    loss = loss_fn(outputs, ids)
    loss.backward()
    grads = {stage.original_name(name): p.grad for stage in stages for name, p in stage.named_parameters()
             if p.grad is not None}
    return loss.detach(), loss_fn.values[0], grads


@pytest.mark.parametrize(("family", "boundaries", "sub_batches", "recompute"), [
    ("mixtral", (0, 2), 1, False), ("qwen3_moe", (0, 1, 2, 3), 1, False), ("mixtral", (0, 2), 2, True),
], ids=["mixtral-2-stages", "qwen3_moe-prefix-only-first-stage", "mixtral-sub-batches-recompute"])
def test_stages_in_one_process_train_the_models_loss_with_labels(family: str, boundaries: tuple[int, ...],
                                                                 sub_batches: int, recompute: bool) -> None:
    """The stages chained by hand (no process group): loss, aux and every gradient equal the unsplit model's with
    labels, router gradients included; a first stage without blocks carries no router logits."""
    loss, aux, grads = _stage_chain(family, boundaries, sub_batches, recompute)
    model = _model(family)
    ids = _ids(2)
    output = model(ids, labels=ids)
    output.loss.backward()
    assert loss.item() == pytest.approx(output.loss.item(), rel=1e-6)
    assert aux.item() == pytest.approx(COEF * output.aux_loss.item(), rel=1e-6)
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(expected)
    for name, grad in grads.items():
        assert torch.allclose(grad, expected[name], rtol=1e-5, atol=1e-7), name
    without_aux = _model(family)
    without_aux.config.output_router_logits = False
    without_aux(ids, labels=ids).loss.backward()
    router = next(name for name in expected if "gate.weight" in name)
    assert not torch.allclose(dict(without_aux.named_parameters())[router].grad, expected[router], atol=1e-6), \
        "the aux loss must move the router gradients, or the comparison proves nothing"


def test_families_adding_no_aux_loss_have_none_and_other_models_without_a_router_are_refused() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    deepseek = _model("deepseek_v3")  # balances its experts by a routing bias: its loss adds no aux loss
    assert router_aux_of(deepseek, deepseek.model.layers) is None

    class OwnLlama(LlamaForCausalLM):  # a class outside transformers: its loss cannot be told from its module
        pass

    llama = OwnLlama(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"names no router class in _can_record_outputs\['router_logits'\]"):
        router_aux_of(llama, llama.model.layers)


# Distributed: merak3d against gradient accumulation over the same micro-batches ----------------

def _batches() -> torch.Tensor:
    return torch.randint(3, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(5))


class _SGDModule(CausalLMModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=LR)


def _reference(family: str, data_parallel: int, micro_batches: int) -> dict[str, Any]:
    """Per step: mean loss and weighted aux over every replica's micro-batches, each run through the unsplit model
    with labels, and the gradients of that mean (gradient accumulation); SGD between steps."""
    from lightning_merak.testing import snapshot_gradients

    model = _model(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, auxes, grads = [], [], []
    shard = BATCH // data_parallel
    for batch in _batches():
        optimizer.zero_grad()
        micro = [chunk for r in range(data_parallel) for chunk in batch[r * shard:(r + 1) * shard].chunk(micro_batches)]
        outputs = [model(ids, labels=ids) for ids in micro]
        loss = sum(output.loss for output in outputs) / len(micro)
        loss.backward()
        losses.append(loss.item())
        auxes.append(sum(COEF * output.aux_loss.item() for output in outputs) / len(micro))
        grads.append(snapshot_gradients(model))
        optimizer.step()
    return {"losses": losses, "auxes": auxes, "gradients": grads}


class _Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.auxes: list[float] = []
        self.gradients: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        from lightning_merak.testing import layout_gradients

        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.auxes.append(float(trainer.callback_metrics["train/router_aux_loss"]))
        self.gradients.append(layout_gradients(trainer.strategy, pl_module.model))


def assert_step_gradients_match(result: dict[str, Any], expected: dict[str, Any], rank: int) -> set[str]:
    """Every step's gradients of ``result`` equal ``expected``'s (an expert shard its slice) to 1e-5 of the largest
    entry; the names compared."""
    seen = set()
    for step in range(STEPS):
        for name, grad in result["gradients"][step].items():
            want = expected["gradients"][step][name]
            if name in result["experts"]:
                start, stop = result["experts"][name]
                want = want[start:stop]
            error = (grad - want).abs().max().item()
            assert error <= 1e-5 * max(1.0, want.abs().max().item()), f"rank {rank} step {step} {name}: {error}"
            seen.add(name)
    return seen


def expert_slices(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """The experts ``[start, stop)`` this rank holds of each fused expert tensor, by its unsplit name."""
    from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE

    original = getattr(model, "original_name", lambda name: name)
    experts = {}
    for name, module in model.named_modules():
        shard = getattr(module, SHARD_ATTRIBUTE, None)
        if shard is not None:
            for tensor in ("gate_up_proj", "down_proj"):
                experts[f"{original(name)}.{tensor}"] = (shard.experts.start, shard.experts.stop)
    return experts


def _train_rank(rank: int, world_size: int, family: str, layout: dict[str, Any], expert_parallel: bool
                ) -> dict[str, Any]:
    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    recorder = _Recorder()
    callbacks: list[pl.Callback] = [recorder]
    if expert_parallel:
        callbacks.append(ExpertParallelCallback(log_every_n_steps=1))
    strategy = Merak3DStrategy(pipeline_parallel=2, timeout_s=120, **{"partition": "uniform", **layout})
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=callbacks,
    )
    trainer.fit(_SGDModule(_model(family)),
                datamodule=ReplicaBatches(_batches(), 0, STEPS))
    experts = expert_slices(trainer.lightning_module.model) if expert_parallel else {}
    return {"losses": recorder.losses, "auxes": recorder.auxes, "gradients": recorder.gradients, "experts": experts}


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "world", "layout", "expert_parallel"), [
    ("mixtral", 2, {"data_parallel": 1, "micro_batches": 2, "vocab_stages": "on"}, False),
    ("mixtral", 2, {"data_parallel": 1, "micro_batches": 4, "schedule": "shifted_critical_path"}, False),
    ("qwen3_moe", 2, {"data_parallel": 1, "micro_batches": 4, "schedule": "gpipe", "recompute": "full"}, False),
    ("mixtral", 2, {"data_parallel": 1, "micro_batches": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2,
                    "partition": "min_max"}, False),
    ("qwen3_moe", 2, {"data_parallel": 1, "micro_batches": 4, "schedule": "interleaved_zero_bubble",
                      "virtual_stages": 2, "partition": "min_max"}, False),
    ("qwen3_moe", 4, {"data_parallel": 2, "micro_batches": 2}, True),
    ("mixtral", 4, {"data_parallel": 1, "tensor_parallel": 2, "tp_overlap": 2, "micro_batches": 2}, False),
], ids=["mixtral-pp2-m2-vocab-stages", "mixtral-pp2-m4-shifted-critical-path", "qwen3_moe-pp2-m4-gpipe-recompute",
        "mixtral-pp2-interleaved-4-stages", "qwen3_moe-pp2-zero-bubble", "qwen3_moe-pp2-dp2-merak_ep",
        "mixtral-pp2-tp2-sub-batches"])
def test_pipeline_stages_train_the_router_aux_loss_as_gradient_accumulation(
        family: str, world: int, layout: dict[str, Any], expert_parallel: bool) -> None:
    """Logged loss (cross-entropy + aux), logged aux and every gradient equal the unsplit model with labels over
    the same micro-batches, step after step of SGD."""
    results = run_distributed(_train_rank, world, args=(family, layout, expert_parallel), timeout_s=280)
    expected = _reference(family, layout["data_parallel"], layout["micro_batches"])
    seen: set[str] = set()
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5), (rank, result["losses"])
        assert result["auxes"] == pytest.approx(expected["auxes"], rel=1e-5), (rank, result["auxes"])
        assert all(aux > 0 for aux in result["auxes"])
        seen |= assert_step_gradients_match(result, expected, rank)
    assert seen == set(expected["gradients"][0]), sorted(set(expected["gradients"][0]) - seen)
