"""Adapters on MoE models at ep=2 (gloo) against one process: LoRA, Q-BaRA (float experts) and QA-HiRA (INT4
experts) on attention and on fused experts, each expert's adapter on the rank owning the expert; outputs, adapter
gradients, save/load and (LoRA) the merged export.

Each rank runs its own batch. The reference is the eager single-process adapted model on the same batch in
every process, its adapter gradients averaged over the ranks (data parallelism's mean-loss gradient); ours
averages the attention adapters' gradients the same way and divides the expert adapters' gradients (which
already sum both ranks' tokens through the all-to-all) by the rank count.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_merak.testing import module_losses, run_distributed

pytestmark = pytest.mark.distributed

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
FACTORS = ("lora_A", "lora_B", "qbara_A", "qbara_B", "qahira_H")
POOLED = {"qbara": ("mixtral", {"lambda_in": 2, "lambda_out": 2}, False),
          "qahira": ("qwen3_moe", {"lambda_in": 16, "lambda_out": 2}, True)}


def _diffs(reference: torch.nn.Module, ours: torch.nn.Module, ids: torch.Tensor,
           world: int) -> tuple[float, float, int]:
    """Logit and adapter-gradient differences of ``ours`` (ep=2) against the single-process ``reference``."""
    from lightning_merak.adapters.moe import expert_adapters, slice_expert_factor

    experts = {adapter.name: adapter for adapter in expert_adapters(ours)}
    out = reference(ids, labels=ids)
    out.loss.backward()
    ref_logits = out.logits.detach()
    out = ours(ids, labels=ids)
    out.loss.backward()
    logit_diff = (out.logits.detach() - ref_logits).abs().max().item()

    ref_params = dict(reference.named_parameters())
    grad_diff, checked = 0.0, 0
    for name, param in ours.named_parameters():
        if not param.requires_grad:
            continue
        ref_grad = ref_params[name].grad.clone()
        dist.all_reduce(ref_grad)
        owner = next((a for prefix, a in experts.items() if name.startswith(prefix + ".")
                      and name[len(prefix) + 1:].split(".")[0] in FACTORS), None)
        if owner is None:
            assert getattr(param, "allreduce", True) is not False, name
            dist.all_reduce(param.grad)
        else:
            assert param.allreduce is False, name
            kind = "B" if ".lora_B." in name else "A"  # pooled factors are expert-major, as lora_A
            ref_grad = slice_expert_factor(kind, ref_grad, owner.experts, owner.num_experts)
        grad_diff = max(grad_diff, (param.grad / world - ref_grad / world).abs().max().item())
        checked += 1
    return logit_diff, grad_diff, checked


def _family_case(rank: int, world: int, family: str, directory: str) -> dict[str, float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_merak.adapters.moe import (
        add_moe_adapters,
        expert_adapter_state_dict,
        expert_adapters,
        load_moe_adapter,
        merged_state_dict,
        moe_adapter_config,
        save_moe_adapter,
    )
    from lightning_merak.plugins.moe.experts import enable_expert_parallel, tiny_moe_model

    base = tiny_moe_model(family)
    config = moe_adapter_config(base, r=4, alpha=8, init_lora_weights=False)
    torch.manual_seed(7)
    reference = add_moe_adapters(copy.deepcopy(base), config)
    whole = expert_adapter_state_dict(reference)
    ours = copy.deepcopy(base)
    report = enable_expert_parallel(ours)
    ours = add_moe_adapters(ours, config)
    load_moe_adapter(ours, whole)
    assert all(int(a.wrapper.num_experts) == len(report.local_experts) for a in expert_adapters(ours))

    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(10 + rank))
    logit_diff, grad_diff, checked = _diffs(reference, ours, ids, world)

    adapter_dir, merged_dir = Path(directory) / f"{family}-adapter", Path(directory) / f"{family}-merged"
    save_moe_adapter(ours, adapter_dir)
    saved = expert_adapter_state_dict(ours)
    dist.barrier()
    loaded = expert_adapter_state_dict(PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)))
    save_exact = all(torch.equal(loaded[key], whole[key]) and torch.equal(saved[key], whole[key]) for key in whole)

    merged_base, merged = merged_state_dict(ours)
    reference_base, reference_merged = merged_state_dict(reference)  # the merged unswapped model
    merge_diff = max((merged[key] - reference_merged[key]).abs().max().item() for key in reference_merged)
    if rank == 0:
        merged_base.save_pretrained(merged_dir, state_dict=merged)
    dist.barrier()
    exported = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    exported.set_experts_implementation("eager")
    reloaded = exported.state_dict()
    export_exact = reloaded.keys() == reference_merged.keys() and all(
        torch.equal(reloaded[key], reference_merged[key]) for key in reloaded)
    with torch.no_grad():
        export_diff = (exported(ids).logits - reference_base(ids).logits).abs().max().item()
    return {"logits": logit_diff, "grads": grad_diff, "checked": checked, "save_exact": save_exact,
            "merge": merge_diff, "export_exact": export_exact, "export_logits": export_diff}


def _replica_case(rank: int, world: int) -> dict[str, float]:
    """Adapters added before expert parallelism, then Pro-Prophet replicas of adapted experts: the owner's
    adapted slice travels to the replica rank and its gradient returns to the owner's factors."""
    from lightning_merak.adapters.moe import (
        add_moe_adapters,
        expert_adapter_state_dict,
        load_moe_adapter,
        moe_adapter_config,
    )
    from lightning_merak.plugins.moe.core.placement import PlacementPlan, Replication
    from lightning_merak.plugins.moe.experts import (
        enable_expert_parallel,
        experts_modules,
        set_replica_plans,
        tiny_moe_model,
    )

    base = tiny_moe_model("mixtral")
    config = moe_adapter_config(base, r=4, alpha=8, init_lora_weights=False)
    torch.manual_seed(7)
    reference = add_moe_adapters(copy.deepcopy(base), config)
    ours = add_moe_adapters(copy.deepcopy(base), config)  # adapters first: enable_expert_parallel cuts them
    load_moe_adapter(ours, expert_adapter_state_dict(reference))
    report = enable_expert_parallel(ours)
    assert sum(".lora_" in name for name in report.expert_parameters) == 4 * 2  # 2 layers × 2 tensors × (A, B)
    last = report.num_experts - 1
    plan = PlacementPlan(report.num_experts, 2, (Replication(0, 0, (1,)), Replication(last, 1, (0,))))
    set_replica_plans(ours, {name: plan for name, _ in experts_modules(ours)})
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(20 + rank))
    logit_diff, grad_diff, checked = _diffs(reference, ours, ids, world)
    return {"logits": logit_diff, "grads": grad_diff, "checked": checked}


def _pooled_case(rank: int, world: int, method: str, directory: str) -> dict[str, float]:
    """Q-BaRA / QA-HiRA on attention and experts (QA-HiRA on INT4 experts, G=16): each rank holds its experts'
    factors, saving gathers PEFT's whole layout (it loads into the unsharded model), loading slices it."""
    from peft import PeftModel

    from lightning_merak.adapters import moe, quantize_model
    from lightning_merak.plugins.moe.experts import enable_expert_parallel, tiny_moe_model

    family, options, int4 = POOLED[method]
    base = tiny_moe_model(family)
    if int4:
        quantize_model(base, "int4", 16, experts=True)
    config = moe.moe_adapter_config(base, method, r=4, alpha=8, **options)
    reference = moe.add_moe_adapters(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.requires_grad:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    whole = moe.expert_adapter_state_dict(reference)
    ours = copy.deepcopy(base)
    report = enable_expert_parallel(ours)
    ours = moe.add_moe_adapters(ours, config)
    moe.load_moe_adapter(ours, whole)
    local = moe.expert_adapters(ours)
    assert local and all(int(a.wrapper.num_experts) == len(report.local_experts) for a in local)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(40 + rank))
    logit_diff, grad_diff, checked = _diffs(reference, ours, ids, world)
    adapter_dir = Path(directory) / f"{method}-adapter"
    moe.save_moe_adapter(ours, adapter_dir)
    saved = moe.expert_adapter_state_dict(ours)
    dist.barrier()
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir))
    loaded_state = moe.expert_adapter_state_dict(loaded)
    save_exact = all(torch.equal(loaded_state[k], whole[k]) and torch.equal(saved[k], whole[k]) for k in whole)
    with torch.no_grad():
        load_diff = (loaded(ids).logits - reference(ids).logits).abs().max().item()
    return {"logits": logit_diff, "grads": grad_diff, "checked": checked, "save_exact": save_exact,
            "load_logits": load_diff}


def _run(rank: int, world: int, directory: str) -> dict[str, dict[str, float]]:
    results = {family: _family_case(rank, world, family, directory) for family in FAMILIES}
    results.update({method: _pooled_case(rank, world, method, directory) for method in POOLED})
    results["mixtral adapters-first+replicas"] = _replica_case(rank, world)
    return results


def test_moe_adapters_ep2_equal_single_process(tmp_path) -> None:
    results = run_distributed(_run, world_size=2, args=(str(tmp_path),), timeout_s=180)
    for rank, per_family in enumerate(results):
        for family, result in per_family.items():
            assert result["checked"] > 0, (rank, family)
            assert result["logits"] <= 1e-5 and result["grads"] <= 1e-5, (rank, family, result)
            if family in POOLED:
                assert result["save_exact"] and result["load_logits"] == 0.0, (rank, family, result)
            if family in FAMILIES:
                assert result["save_exact"] and result["export_exact"], (rank, family, result)
                assert result["merge"] == 0.0 and result["export_logits"] == 0.0, (rank, family, result)


STEPS, BATCH, SEQ = 3, 2, 12


def _lm_batches(rank: int) -> torch.Tensor:
    return torch.randint(3, 128, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(30 + rank))


def _adapted_module() -> object:
    from lightning_merak.adapters.moe import add_moe_adapters, moe_adapter_config
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.modules.config import OptimConfig
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    base = tiny_moe_model("qwen3_moe")
    torch.manual_seed(11)
    model = add_moe_adapters(base, moe_adapter_config(base, r=4, alpha=8, init_lora_weights=False))
    return CausalLMModule(model, OptimConfig(learning_rate=3e-3, warmup_steps=1, total_steps=STEPS))


def _train_ddp(rank: int, world: int) -> tuple[list[float], list[int]]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback

    module = _adapted_module()
    losses: list[float] = []

    class Recorder(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, *args) -> None:
            losses.append(float(outputs["loss"]))

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[Recorder(), ExpertParallelCallback(ep_size=2)])
    trainer.fit(module, DataLoader(TensorDataset(_lm_batches(rank)), batch_size=BATCH))
    from lightning_merak.adapters.moe import expert_adapters

    return losses, [int(adapter.wrapper.num_experts) for adapter in expert_adapters(module)]


def test_expert_adapters_train_like_one_process_under_lightning_ddp() -> None:
    """Adapters added with the model, cut by the callback's enable_expert_parallel, averaged like experts."""
    results = run_distributed(_train_ddp, 2, timeout_s=120)
    module = _adapted_module()
    data = [_lm_batches(rank) for rank in range(2)]
    reference = module_losses(module, [(torch.cat([d[step * BATCH:(step + 1) * BATCH] for d in data]),)
                                       for step in range(STEPS)])
    assert all(local == [8] * 4 for _, local in results)  # 16 experts: each rank's adapters cut to its 8
    mean = [(a + b) / 2 for a, b in zip(results[0][0], results[1][0])]
    assert mean == pytest.approx(reference, abs=1e-5)
    assert reference[-1] != pytest.approx(reference[0], abs=1e-4)  # the adapters did train
