"""Adapters on ``merak_ep`` experts under merak3d in two more compositions (#30): tensor parallelism (tp=2 × dp=2,
LoRA on attention split over the tp ranks, expert adapters over each tp index's data-parallel ranks; refused at setup
today, see its mark), and Pro-Prophet
replicas at pp=2 × dp=2 (an owner's adapted expert computed on the other rank too, its gradient returned to the
owner's factors). Both train like the single-process adapted model with transformers' own expert loop: losses and
every adapter gradient, three SGD steps, 4 gloo ranks, tiny Qwen3-MoE (16 experts, top-8), LoRA r=4."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_merak.testing import run_distributed
from lightning_merak.testing.causal_lm import FixedOptimizerModule
from lightning_merak.testing.data import ReplicaBatches
from tests import test_moe_adapters_merak3d as adapters

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks

STEPS = 3


class _Replicas(pl.Callback):
    """From the first batch (the layout is built by then), each of this rank's experts modules replicates expert 0
    (owned by expert rank 0) onto rank 1 and the last expert (owned by rank 1) onto rank 0."""

    def __init__(self) -> None:
        self.planned: list[str] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.planned:
            return
        from lightning_merak.plugins.moe.core.placement import PlacementPlan, Replication
        from lightning_merak.plugins.moe.experts import experts_modules, set_replica_plans

        modules = experts_modules(pl_module.model)
        last = modules[0][1].num_experts - 1 if modules else 0
        plan = PlacementPlan(last + 1, 2, (Replication(0, 0, (1,)), Replication(last, 1, (0,))))
        set_replica_plans(pl_module.model, {name: plan for name, _ in modules})
        self.planned = [name for name, _ in modules]


def _replica_rank(rank: int, world_size: int) -> dict[str, Any]:
    """pp=2 × dp=2 with ep=2 and replicas, adapters on attention and experts, SGD over the adapters."""
    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback
    from lightning_merak.plugins.moe.experts import parallel
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    hosted_calls = []
    gather_replicas = parallel._replica_tensors

    def counted(*args: Any, **kwargs: Any) -> Any:  # the real gathering of replicated slices, counted
        hosted_calls.append(1)
        return gather_replicas(*args, **kwargs)

    parallel._replica_tensors = counted
    module = FixedOptimizerModule(adapters._model(), "sgd")
    recorder, replicas = adapters._Recorder(gradients=True), _Replicas()
    strategy = Merak3DStrategy(pipeline_parallel=2, data_parallel=2, tensor_parallel=1, micro_batches=2,
                               partition="uniform", timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[ExpertParallelCallback(log_every_n_steps=1), replicas, recorder],
    )
    trainer.fit(module, datamodule=ReplicaBatches(adapters._batches(), 0, STEPS))
    return {"losses": recorder.losses, "gradients": recorder.gradients, "experts": adapters._experts_of(module),
            "replicated": replicas.planned, "replica_forwards": len(hosted_calls)}


def _check_against_one_process(results: list[dict[str, Any]], expert_rank_of: Any) -> None:
    """Every rank's losses, and every adapter gradient (expert factors as the rank's slice), against one process."""
    from lightning_merak.adapters.moe import slice_expert_factor

    losses, grads, _ = adapters._reference("sgd")
    seen: set[str] = set()
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(losses[:STEPS], rel=1e-5), rank
        assert result["experts"], f"rank {rank} holds no expert adapter"
        for step, step_grads in enumerate(result["gradients"]):
            for name, grad in step_grads.items():
                want = grads[step][name]
                found = adapters._expert_factor(name, result["experts"])
                if found is not None:
                    kind, (start, stop, total) = found
                    ep_rank = expert_rank_of(rank)
                    assert (start, stop) == (ep_rank * total // 2, (ep_rank + 1) * total // 2), (rank, name)
                    want = slice_expert_factor(kind, want, range(start, stop), total)
                error = (grad - want).abs().max().item()
                assert error <= 1e-5 + 1e-4 * want.abs().max().item(), f"rank {rank} step {step} {name}: {error:.3g}"
                seen.add(name)
    assert seen == set(grads[0]), f"no rank reported {sorted(set(grads[0]) - seen)}"


@pytest.mark.timeout(150)
def test_tp2_dp2_expert_adapters_equal_one_process() -> None:
    """merak3d's mesh is (pp, dp, tp): rank = 2·dp + tp, so the expert rank is the data-parallel index and both tp
    ranks of it hold the same experts and factors."""
    layout = {"pipeline_parallel": 1, "data_parallel": 2, "tensor_parallel": 2}
    results = run_distributed(adapters._train_rank, 4, args=(layout, None, "sgd", 0, STEPS, None, None),
                              timeout_s=120)
    _check_against_one_process(results, lambda rank: rank // 2)


@pytest.mark.timeout(150)
def test_pp2_dp2_replicas_of_adapted_experts_equal_one_process() -> None:
    """Pro-Prophet replicas (set by ``set_replica_plans`` on the built stages) of adapted experts: each stage's
    experts modules run them and the losses and adapter gradients still equal one process."""
    results = run_distributed(_replica_rank, 4, timeout_s=120)
    for result in results:
        assert len(result["replicated"]) == 1, result["replicated"]  # one MoE layer on each of the two stages
        assert result["replica_forwards"] >= STEPS * 2, result["replica_forwards"]  # every micro-batch's forward
    _check_against_one_process(results, lambda rank: rank % 2)
