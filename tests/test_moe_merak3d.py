"""``merak_ep`` under merak3d (#30 item 4): pipeline_parallel=2 × data_parallel=2 on 4 gloo ranks, each stage's
experts spread over its data-parallel ranks, trains like the unswapped single-process model on the union of the
data-parallel batches: losses, dense gradients and every expert's gradient (each rank holds only its own)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.parallel.experts import expert_group_ranks, expert_layout_problem
from lightning_merak.testing import run_distributed, snapshot_gradients
from lightning_merak.testing.data import ReplicaBatches

STEPS, BATCH, SEQ, VOCAB, LR = 3, 8, 8, 128, 0.5
FAMILIES = {"mixtral": {}, "qwen3_moe": {}, "deepseek_v3": {"first_k_dense_replace": 0}}  # all MoE blocks
"""Tiny Mixtral (8 experts, top-2), Qwen3-MoE (16, top-8) and DeepSeek-V3 (16, top-8, groups, shared expert, bias)."""


def _model(family: str) -> torch.nn.Module:
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    model = tiny_moe_model(family, hidden=32, layers=2, vocab=VOCAB, seed=0, **FAMILIES[family])
    model.config.use_cache = False
    return model


def _batches() -> torch.Tensor:
    return torch.randint(3, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(5))


class _SGDModule(CausalLMModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=LR)


def _reference(family: str, clip: float | None = None) -> dict[str, Any]:
    """Losses, gradients (clipped to ``clip``) and norms before clipping of the unswapped model (transformers' own
    expert loop) on the whole batches."""
    module = _SGDModule(_model(family))
    initial = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    optimizer = module.configure_optimizers()
    losses, grads, norms = [], [], []
    for batch in _batches():
        optimizer.zero_grad()
        loss = module.compute_loss((batch,))
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(module.model.parameters(), clip)))
            assert norms[-1] > clip, "the clip must bite, or the test proves nothing"
        losses.append(loss.item())
        grads.append(snapshot_gradients(module.model))
        optimizer.step()
    return {"losses": losses, "gradients": grads, "initial": initial, "norms": norms}


class _Recorder(pl.Callback):
    """Per step: the logged loss and this rank's gradients by unsplit name; the experts each module holds."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.gradients: list[dict[str, torch.Tensor]] = []
        self.experts: dict[str, tuple[int, int]] = {}
        self.initial: dict[str, torch.Tensor] = {}
        self.norms: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE

        if self.experts:
            return
        model = pl_module.model
        original = getattr(model, "original_name", lambda name: name)  # pipeline stages rename their modules
        for name, module in model.named_modules():
            shard = getattr(module, SHARD_ATTRIBUTE, None)
            if shard is not None:
                for tensor in ("gate_up_proj", "down_proj"):
                    full = f"{original(name)}.{tensor}"
                    self.experts[full] = (shard.experts.start, shard.experts.stop)
                    self.initial[full] = getattr(module, tensor).detach().clone()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        from lightning_merak.testing import layout_gradients

        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        if trainer.strategy.last_gradient_norm is not None:
            self.norms.append(trainer.strategy.last_gradient_norm)
        self.gradients.append(layout_gradients(trainer.strategy, pl_module.model))


def _train_rank(rank: int, world_size: int, family: str, clip: float | None, pretrained: str | None,
                pipeline_parallel: int, ep_size: int | None, tensor_parallel: int = 1,
                sequence_parallel: bool = False) -> dict[str, Any]:
    """One rank's run; with ``pretrained``, the model is built on meta and each rank reads its part of it."""
    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback
    from lightning_merak.hf import pretrained_causal_lm
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    if pretrained is None:
        module = _SGDModule(_model(family))
    else:
        module = _SGDModule(None, pretrained_path=pretrained,
                            model_factory=lambda: pretrained_causal_lm(pretrained, VOCAB, {}, weights=False))
    recorder = _Recorder()
    strategy = Merak3DStrategy(data_parallel=world_size // (pipeline_parallel * tensor_parallel),
                               pipeline_parallel=pipeline_parallel, tensor_parallel=tensor_parallel,
                               sequence_parallel=sequence_parallel, micro_batches=2, partition="uniform", timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, gradient_clip_val=clip,
        callbacks=[ExpertParallelCallback(ep_size=ep_size, log_every_n_steps=1), recorder],
    )
    trainer.fit(module, datamodule=ReplicaBatches(_batches(), 0, STEPS))
    return {"losses": recorder.losses, "gradients": recorder.gradients, "experts": recorder.experts,
            "initial": recorder.initial, "norms": recorder.norms}


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("family", "clip", "on_meta", "pipeline_parallel", "ep_size", "tensor_parallel"), [
    ("mixtral", None, False, 2, None, (1, False)), ("deepseek_v3", 0.5, False, 2, None, (1, False)),
    ("mixtral", None, True, 2, None, (1, False)), ("qwen3_moe", 0.5, False, 1, 2, (1, False)),
    ("qwen3_moe", 0.5, False, 1, None, (2, False)), ("mixtral", None, False, 1, None, (2, True)),
], ids=["mixtral", "deepseek_v3-clipped", "mixtral-meta-pretrained", "qwen3_moe-dp4-ep2-clipped",
        "qwen3_moe-tp2-dp2-clipped", "mixtral-tp2-dp2-sequence-parallel"])
def test_pp2_dp2_expert_parallel_equals_the_unswapped_model(family: str, clip: float | None, on_meta: bool,
                                                            pipeline_parallel: int, ep_size: int | None,
                                                            tensor_parallel: tuple[int, bool], tmp_path: Any) -> None:
    """pp=2 × dp=2, experts over each stage's two data-parallel ranks. Clipped: the norm counts each expert once
    (summed over the expert group). On meta with a pretrained checkpoint: each rank materialises and reads only
    its own experts. dp=4 with ep=2: two expert groups, expert gradients also summed across them. tp=2 × dp=2
    (``tensor_parallel`` is (tp, sequence parallel)): experts are not cut by tp, each tp rank exchanges with its
    own tp index's data-parallel peer and holds the same experts as its tp partner."""
    pretrained = None
    if on_meta:
        pretrained = str(tmp_path / "pretrained")
        _model(family).save_pretrained(pretrained)
    tp, sequence_parallel = tensor_parallel
    results = run_distributed(_train_rank, 4, args=(family, clip, pretrained, pipeline_parallel, ep_size, tp,
                                                    sequence_parallel), timeout_s=100)
    ep = ep_size or 4 // (pipeline_parallel * tp)
    expected = _reference(family, clip)
    losses, reference, initial = expected["losses"], expected["gradients"], expected["initial"]
    for rank, result in enumerate(results):
        assert len(result["losses"]) == STEPS
        for step, (ours, want) in enumerate(zip(result["losses"], losses)):
            assert abs(ours - want) <= 1e-5 * abs(want), f"rank {rank} step {step}: loss {ours} vs {want}"
        if clip is not None:
            assert result["norms"] == pytest.approx(expected["norms"], rel=1e-5), (rank, result["norms"])
        # mesh (pp, dp, tp): rank (pp·dp_size + dp)·tp_size + t holds experts [r·E/ep, (r+1)·E/ep), r = dp mod ep
        assert result["experts"], f"rank {rank} holds no experts module"
        ep_rank = (rank // tp) % ep
        for name, (start, stop) in result["experts"].items():
            total = initial[name].shape[0]
            assert (start, stop) == (ep_rank * total // ep, (ep_rank + 1) * total // ep), (rank, name, start, stop)
            assert torch.equal(result["initial"][name], initial[name][start:stop]), f"rank {rank}: {name} not its own"
    seen: set[str] = set()
    for step in range(STEPS):
        for rank, result in enumerate(results):
            for name, grad in result["gradients"][step].items():
                want = reference[step][name]
                if name in result["experts"]:
                    start, stop = result["experts"][name]
                    assert grad.shape[0] == stop - start, f"rank {rank} holds {grad.shape[0]} experts of {name}"
                    want = want[start:stop]
                error = (grad - want).abs().max().item()
                assert error <= 1e-5 + 1e-4 * want.abs().max().item(), f"rank {rank} step {step} {name}: {error:.3g}"
                seen.add(name)
    assert seen == set(reference[0]), f"no rank reported {sorted(set(reference[0]) - seen)}"


def test_expert_groups_are_carved_from_each_stage_data_parallel_ranks() -> None:
    dp_groups = [[0, 1, 2, 3], [4, 5, 6, 7]]  # two stages, dp=4 each
    ep, edp = expert_group_ranks(dp_groups, 2)
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert edp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert expert_group_ranks(dp_groups, 4) == (dp_groups, [[0], [1], [2], [3], [4], [5], [6], [7]])


@pytest.mark.parametrize(("change", "match"), [
    ({"sharding": "optimizer"}, "data_parallel_sharding='optimizer'.*use data_parallel_sharding='none'"),
    ({"schedule": "interleaved_zero_bubble"}, "use 1f1b"),
    ({"micro_batching": "dynamic"}, "use micro_batching='none'"),
    ({"ep_size": 3}, "ep_size=3 does not divide data_parallel=4"),
])
def test_unsupported_layouts_are_refused_with_the_fix(change: dict[str, Any], match: str) -> None:
    values = {"data_parallel": 4, "sharding": "none", "schedule": "1f1b",
              "micro_batching": "none", "ep_size": None}
    assert expert_layout_problem(**values) is None
    problem = expert_layout_problem(**{**values, **change})
    assert problem is not None
    import re

    assert re.search(match, problem), problem


def test_strategy_is_checked_before_launch() -> None:
    from lightning_merak.parallel.experts import check_merak3d_experts
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    check_merak3d_experts(Merak3DStrategy(data_parallel=2, pipeline_parallel=2, tensor_parallel=1), 4)
    check_merak3d_experts(Merak3DStrategy(data_parallel=2, pipeline_parallel=1, tensor_parallel=2), 4)
    with pytest.raises(ValueError, match="merak_ep under merak3d refused: moe.ep_size=2 does not divide"):
        check_merak3d_experts(Merak3DStrategy(data_parallel=1, pipeline_parallel=2, tensor_parallel=2), 4, 2)
    with pytest.raises(ValueError, match="data_parallel_sharding='full'"):
        check_merak3d_experts(Merak3DStrategy(data_parallel=4, data_parallel_sharding="full"), 4)
    check_merak3d_experts(Merak3DStrategy(pipeline_parallel="auto", data_parallel_sharding="auto"), 4)  # planned
    with pytest.raises(ValueError, match="data_parallel_sharding='optimizer'"):
        check_merak3d_experts(Merak3DStrategy(tensor_parallel="auto", data_parallel_sharding="optimizer"), 4)
    with pytest.raises(ValueError, match="moe.ep_size=4 does not divide data_parallel=2"):
        check_merak3d_experts(Merak3DStrategy(pipeline_parallel=2, tensor_parallel="auto"), 4, 4)


def test_meta_built_local_experts_start_distinct_on_each_expert_rank() -> None:
    """merak3d seeds a module's init by name, the same on every rank: the expert rank must enter the draw."""
    from lightning_merak.parallel.experts import _LocalExpertsInit

    experts = _model("mixtral").model.layers[0].mlp.experts
    drawn = []
    for ep_rank in (0, 1, 0):
        torch.manual_seed(11)
        _LocalExpertsInit(ep_rank)(experts)
        drawn.append(experts.gate_up_proj.detach().clone())
    assert torch.equal(drawn[0], drawn[2]) and not torch.equal(drawn[0], drawn[1])
    assert 0.01 < drawn[0].std().item() < 0.03  # the family's initializer_range (0.02)
