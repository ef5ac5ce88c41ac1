"""DeltaMemory under Lightning: identical gradients, the budget held, re-planning,
the plot, Hydra, user checkpointing respected, and DDP with two gloo processes."""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.delta import Action, DeltaMemory
from lightning_merak.callbacks.delta.callback import PLOT_NAME
from lightning_merak.testing import TraceRecorder, assert_traces_match, run_distributed
from lightning_merak.testing.delta_models import (
    CausalLMModule,
    ImageClassifierModule,
    SmallResNet,
    tiny_gpt2,
    tiny_llama,
)

STEPS = 4


def token_data(seq_len: int = 32, count: int = 16) -> TensorDataset:
    return TensorDataset(torch.randint(0, 128, (count, seq_len), generator=torch.Generator().manual_seed(1)))


def image_data(count: int = 16) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(count, 3, 16, 16, generator=generator), torch.randint(0, 10, (count,), generator=generator)
    )


def fit(make_module, data, callbacks, root: Path, steps: int = STEPS, batch_size: int = 4, **trainer_kwargs):
    pl.seed_everything(0, verbose=False)
    module = make_module()
    recorder = TraceRecorder()
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
        callbacks=[recorder, *callbacks], **trainer_kwargs,
    )
    loader = data if isinstance(data, DataLoader) else DataLoader(data, batch_size=batch_size)
    trainer.fit(module, loader)
    return recorder.trace, module


MODELS = {
    "llama": (lambda: CausalLMModule(tiny_llama()), token_data,
              {"model.model.layers.0": "swap", "model.model.layers.1": "recompute"}),
    "gpt2": (lambda: CausalLMModule(tiny_gpt2()), token_data,
             {"model.transformer.h.0": "recompute", "model.transformer.h.1": "swap"}),
    "resnet": (lambda: ImageClassifierModule(SmallResNet()), image_data,
               {"model.stages.0.0": "recompute", "model.stages.1.1": "swap"}),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_match_unmanaged_training(name, tmp_path):
    make_module, make_data, overrides = MODELS[name]
    reference, _ = fit(make_module, make_data(), [], tmp_path)
    callback = DeltaMemory(budget="64KiB", overrides=overrides, swap_dir=str(tmp_path / "swap"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the small budget cannot be met; that is not under test
        managed, _ = fit(make_module, make_data(), [callback], tmp_path)
    assert_traces_match(reference, managed, loss_rtol=1e-6, grad_rtol=1e-6)
    actions = set(callback.plan.actions.values())
    assert {Action.SWAP, Action.RECOMPUTE} <= actions, callback.plan.table()
    assert callback.manager.step_reports, "managed steps must report"
    assert not os.path.exists(callback.manager.swap.tier.directory), "disk tier must clean up"
    assert (tmp_path / PLOT_NAME).is_file()


def test_budget_is_respected_by_the_callbacks_own_accounting(tmp_path):
    make_module = lambda: CausalLMModule(tiny_gpt2(layers=6))
    probe = DeltaMemory(budget=2**40, warmup_steps=1, plot=False)
    fit(make_module, token_data(), [probe], tmp_path, steps=2)
    unmanaged = probe.plan.unmanaged_peak_bytes
    budget = unmanaged // 2
    callback = DeltaMemory(budget=budget, warmup_steps=1, plot=False)
    fit(make_module, token_data(), [callback], tmp_path, steps=STEPS)
    plan = callback.plan
    assert plan.fits, plan.table()
    assert any(a is not Action.KEEP for a in plan.actions.values())
    reports = callback.manager.step_reports
    assert len(reports) == STEPS - 1
    for report in reports:
        assert report.peak_saved_bytes <= budget, (report, plan.table())
    assert callback.manager.ledger.resident_bytes == 0


def test_replans_when_input_shapes_change(tmp_path):
    data = token_data(seq_len=32, count=8)
    longer = token_data(seq_len=64, count=8)
    loader = DataLoader(torch.utils.data.ConcatDataset([data, longer]), batch_size=4,
                        collate_fn=lambda items: (torch.stack([i[0] for i in items]),))
    callback = DeltaMemory(budget="150KiB", warmup_steps=1, plot=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(lambda: CausalLMModule(tiny_gpt2()), loader, [callback], tmp_path, steps=4)
    plans = callback.manager._plans
    assert set(plans) == {((4, 32),), ((4, 64),)}
    short, long = plans[((4, 32),)], plans[((4, 64),)]
    assert long.unmanaged_peak_bytes > short.unmanaged_peak_bytes


def test_user_checkpointing_is_respected_and_reported(tmp_path):
    def make_module():
        module = CausalLMModule(tiny_llama(layers=3))
        module.model.model.layers[1].gradient_checkpointing = True
        module.model.model.layers[1]._gradient_checkpointing_func = functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False
        )
        return module

    callback = DeltaMemory(budget="auto", warmup_steps=1, plot=False)
    fit(make_module, token_data(), [callback], tmp_path, steps=2)
    assert callback.excluded == {"model.model.layers.1": "transformers gradient checkpointing is enabled"}
    assert set(callback.plan.actions) == {"model.model.layers.0", "model.model.layers.2"}


def test_bad_arguments_fail_before_training():
    with pytest.raises(ValueError, match="swap_tier"):
        DeltaMemory(swap_tier="nvme")
    with pytest.raises(ValueError, match="fraction"):
        DeltaMemory(budget=2.0)
    with pytest.raises(ValueError, match="override"):
        DeltaMemory(overrides={"layer": "offload"})
    with pytest.raises(ValueError, match="warmup_steps"):
        DeltaMemory(warmup_steps=0)


def test_hydra_option_builds_the_callback():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    import lightning_merak
    from lightning_merak.cli.options.memory import DeltaMemoryConfig, register

    register()
    conf_dir = os.path.join(os.path.dirname(lightning_merak.__file__), "conf")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        default = compose(overrides=["+memory=delta"]).memory
        assert default.budget == "auto"
        tuned = compose(overrides=["+memory=delta", "memory.budget=0.5", "memory.warmup_steps=3"]).memory
        bad = compose(overrides=["+memory=delta", "memory.budget=lots"]).memory
    GlobalHydra.instance().clear()
    option = OmegaConf.to_object(tuned)
    assert isinstance(option, DeltaMemoryConfig)
    (callback,) = option.build_callbacks()
    assert isinstance(callback, DeltaMemory) and callback.budget.fraction == 0.5
    with pytest.raises(ValueError, match="auto"):
        OmegaConf.to_object(bad)


def ddp_rank(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    results = {}
    for managed in (False, True):
        pl.seed_everything(0, verbose=False)
        module = CausalLMModule(tiny_gpt2(layers=3))
        recorder = TraceRecorder()
        callbacks = [recorder]
        if managed:
            callbacks.append(DeltaMemory(budget="96KiB", warmup_steps=1, plot=False, swap_dir=root))
        trainer = pl.Trainer(
            max_steps=3, accelerator="cpu", devices=world_size, strategy="ddp", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=root, callbacks=callbacks,
        )
        data = token_data(count=24)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(data, batch_size=4))
        results[managed] = recorder.trace
        if managed:
            results["plan"] = {k: v.value for k, v in callbacks[-1].plan.actions.items()}
    return results


@pytest.mark.distributed
def test_ddp_two_gloo_ranks_agree_on_the_plan_and_match_unmanaged(tmp_path):
    results = run_distributed(ddp_rank, world_size=2, args=(str(tmp_path),), timeout_s=150)
    assert results[0]["plan"] == results[1]["plan"]
    assert set(results[0]["plan"].values()) != {"keep"}
    for rank_result in results:
        assert_traces_match(rank_result[False], rank_result[True], loss_rtol=1e-6, grad_rtol=1e-6)
