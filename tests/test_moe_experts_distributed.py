"""``merak_ep`` at ep=2 on gloo ranks against the single-process unswapped model.

Each rank runs its own batch. The reference is the unswapped model on the same batch in every
process, its gradients averaged over the ranks (what data parallelism gives for the mean loss);
ours averages the non-expert gradients the same way and divides the expert gradients (which already
sum both ranks' tokens through the all-to-all) by the rank count.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_merak.testing import module_losses, run_distributed

pytestmark = pytest.mark.distributed

FAMILIES = ("mixtral", "deepseek_v3", "qwen2_moe")  # softmax top-k; sigmoid + group-limited + bias; shared expert


def _family_case(rank: int, world: int, family: str, replicate: bool = False,
                 one_way: bool = False) -> dict[str, float]:
    from lightning_merak.plugins.moe.core.placement import PlacementPlan, Replication
    from lightning_merak.plugins.moe.experts import (
        enable_expert_parallel,
        expert_load,
        experts_modules,
        set_replica_plans,
        tiny_moe_model,
    )

    reference = tiny_moe_model(family)
    swapped = copy.deepcopy(reference)
    report = enable_expert_parallel(swapped)
    if replicate:  # rank 0's expert 0 hosted by rank 1 and (unless one way) rank 1's last expert by rank 0
        last = report.num_experts - 1
        replications = (Replication(0, 0, (1,)),) + (() if one_way else (Replication(last, 1, (0,)),))
        plan = PlacementPlan(report.num_experts, 2, replications)
        set_replica_plans(swapped, {name: plan for name, _ in experts_modules(swapped)})
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(10 + rank))

    out = reference(ids, labels=ids)
    out.loss.backward()
    ref_logits = out.logits.detach()
    ref_grads = {}
    for name, param in reference.named_parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            ref_grads[name] = param.grad / world

    out = swapped(ids, labels=ids)
    out.loss.backward()
    logit_diff = (out.logits.detach() - ref_logits).abs().max().item()
    grad_diff = 0.0
    experts = set(report.expert_parameters)
    for name, param in swapped.named_parameters():
        if name not in ref_grads:
            assert param.grad is None or not param.grad.any(), name
            continue
        if name in experts:
            grad, ref = param.grad / world, ref_grads[name][report.local_experts.start:report.local_experts.stop]
        else:
            dist.all_reduce(param.grad)
            grad, ref = param.grad / world, ref_grads[name]
        grad_diff = max(grad_diff, (grad - ref).abs().max().item())
    loads = expert_load(swapped)
    routes = sum(int(c.sum()) for c in loads.values())
    hosted = sum(int(c[1, 0] + c[0, -1]) for c in loads.values())  # routes the replicas computed (if replicating)
    return {"logits": logit_diff, "grads": grad_diff, "routes": routes, "local": len(report.local_experts),
            "hosted": hosted}


def _run_families(rank: int, world: int) -> dict[str, dict[str, float]]:
    results = {family: _family_case(rank, world, family) for family in FAMILIES}
    results.update({f"{family}+replicas": _family_case(rank, world, family, True) for family in FAMILIES[:2]})
    # rank 0 hosts nothing yet must still keep its routes to the replicated expert out of what it sends
    results["mixtral+one-way replica"] = _family_case(rank, world, "mixtral", True, one_way=True)
    return results


def _one_sided(rank: int, world: int) -> tuple[float, float]:
    """Every route goes to rank 0's experts: rank 1 computes nothing yet joins every exchange."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from lightning_merak.plugins.moe.experts.exchange import local_expert_range
    from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE, ExpertShard, expert_parallel_forward

    config = MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=4)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    full = MixtralExperts(config)
    with torch.no_grad():
        full.gate_up_proj.normal_(0, 0.2)
        full.down_proj.normal_(0, 0.2)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 32, generator=gen)
    index = torch.randint(0, 2, (6, 2), generator=gen)
    weights = torch.rand(6, 2, generator=gen)
    ref = full(x, index, weights)
    ref.sum().backward()
    ref_grad = full.gate_up_proj.grad.clone()
    dist.all_reduce(ref_grad)

    mine = local_expert_range(4, rank, world)
    local = copy.deepcopy(full)
    local.gate_up_proj = torch.nn.Parameter(full.gate_up_proj.detach()[mine.start:mine.stop].clone())
    local.down_proj = torch.nn.Parameter(full.down_proj.detach()[mine.start:mine.stop].clone())
    setattr(local, SHARD_ATTRIBUTE, ExpertShard(None, rank, world, 4, mine))
    out = expert_parallel_forward(local, x, index, weights)
    out.sum().backward()
    grad = local.gate_up_proj.grad if local.gate_up_proj.grad is not None else torch.zeros(2, 32, 32)
    return (out - ref).abs().max().item(), (grad - ref_grad[mine.start:mine.stop]).abs().max().item()


def test_ep2_families_equal_unswapped_with_and_without_replicas() -> None:
    results = run_distributed(_run_families, 2, timeout_s=120)
    for rank, per_family in enumerate(results):
        for family, diffs in per_family.items():
            assert diffs["logits"] <= 1e-5 and diffs["grads"] <= 1e-5, (rank, family, diffs)
            assert diffs["local"] in (4, 8)
    for family in results[0]:
        assert results[0][family]["routes"] == results[1][family]["routes"] > 0  # same all-gathered matrix
        assert results[0][family]["hosted"] > 0


def test_ep2_rank_with_no_tokens_still_exchanges() -> None:
    for out_diff, grad_diff in run_distributed(_one_sided, 2, timeout_s=60):
        assert out_diff <= 1e-5 and grad_diff <= 1e-5


STEPS, BATCH, SEQ = 3, 2, 12


def _lm_batches(rank: int) -> torch.Tensor:
    return torch.randint(0, 128, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(20 + rank))


def _optim() -> object:
    from lightning_merak.modules.config import OptimConfig

    return OptimConfig(learning_rate=3e-3, warmup_steps=1, total_steps=STEPS)


def _train_merak_ep(rank: int, world: int) -> dict[str, object]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    config = ProphetMoEConfig(experts="merak_ep", ep_size=2, log_every_n_steps=1)
    module = CausalLMModule(config.apply(tiny_moe_model("qwen3_moe")), _optim())
    losses: list[float] = []

    class Recorder(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, *args) -> None:
            losses.append(float(outputs["loss"]))

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[Recorder(), *config.build_callbacks()])
    trainer.fit(module, DataLoader(TensorDataset(_lm_batches(rank)), batch_size=BATCH))
    experts = module.model.model.layers[0].mlp.experts
    return {"losses": losses, "local": experts.gate_up_proj.shape[0], "implementation":
            experts.config._experts_implementation, "logged": "moe_ep/max_over_mean" in trainer.callback_metrics}


def test_hydra_option_trains_like_one_process_under_lightning_ddp() -> None:
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    results = run_distributed(_train_merak_ep, 2, timeout_s=120)
    module = CausalLMModule(tiny_moe_model("qwen3_moe"), _optim())
    data = [_lm_batches(rank) for rank in range(2)]
    reference = module_losses(module, [(torch.cat([d[step * BATCH:(step + 1) * BATCH] for d in data]),)
                                       for step in range(STEPS)])
    for result in results:
        assert result["local"] == 8 and result["implementation"] == "merak_ep" and result["logged"]
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert mean == pytest.approx(reference, abs=1e-5)
