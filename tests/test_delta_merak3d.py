"""DeltaMemory under merak3d on two gloo ranks: each rank manages its own stage's blocks
under its own budget, gradients equal those of the same layout without the callback, and
blocks merak3d already recomputes are left alone and reported."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.delta import Action, DeltaMemory
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import TraceRecorder, TrainingTrace, assert_traces_match, run_distributed

STEPS, BATCH, SEQ, VOCAB = 4, 8, 16, 96
LLAMA = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False})


class _SGDModule(CausalLMModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.5)


class _ShardedTokens(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        shard = BATCH // kwargs["num_replicas"]
        tokens = torch.randint(VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(3))
        local = tokens[:, kwargs["rank"] * shard:(kwargs["rank"] + 1) * shard]
        return DataLoader(TensorDataset(local.reshape(-1, SEQ)), batch_size=shard, shuffle=False)


def _fit(layout: dict, callback: DeltaMemory | None) -> TrainingTrace:
    torch.manual_seed(0)
    model = build_causal_lm(LLAMA, vocab_size=VOCAB)
    model.config.use_cache = False
    module = _SGDModule(model)
    recorder = TraceRecorder(loss_metric="train/loss")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=Merak3DStrategy(**layout, timeout_s=120), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[recorder] + ([callback] if callback is not None else []),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=_ShardedTokens())
    return recorder.trace


def _rank(rank: int, world_size: int, layout: dict, swap_dir: str) -> dict:
    torch.set_num_threads(1)
    reference = _fit(layout, None)
    probe = DeltaMemory(budget=2**40, warmup_steps=1, plot=False, swap_dir=swap_dir)
    observed = _fit(layout, probe)
    unmanaged = probe.plan.unmanaged_peak_bytes
    budget = (3 * unmanaged + probe.plan.min_peak_bytes) // 4  # reachable, yet below the unmanaged peak
    managed = DeltaMemory(budget=budget, warmup_steps=1, plot=False, swap_dir=swap_dir)
    trace = _fit(layout, managed)
    return {
        "reference": reference,
        "observed": observed,
        "managed": trace,
        "budget": budget,
        "unmanaged_peak": unmanaged,
        "plan": {d.name: d.action.value for d in managed.plan.decisions},
        "fits": managed.plan.fits,
        "table": managed.plan.table(),
        "peaks": [r.peak_saved_bytes for r in managed.manager.step_reports],
        "resident_after": managed.manager.ledger.resident_bytes,
        "events": managed.manager.profile.step_events(),
        "excluded": dict(managed.excluded),
    }


def _check_rank(result: dict) -> None:
    assert_traces_match(result["reference"], result["observed"], loss_rtol=1e-6, grad_rtol=1e-6)
    assert_traces_match(result["reference"], result["managed"], loss_rtol=1e-6, grad_rtol=1e-6)
    assert result["fits"], result["table"]
    assert set(result["plan"].values()) - {Action.KEEP.value}, result["table"]
    assert len(result["peaks"]) == STEPS - 1
    assert all(peak <= result["budget"] for peak in result["peaks"]), (result["peaks"], result["table"])


@pytest.mark.distributed
def test_pipeline_stages_are_managed_per_rank_and_merak3d_recompute_is_respected(tmp_path):
    layout = {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1, "partition": "uniform",
              "recompute": "stage_aware"}
    first, last = run_distributed(_rank, world_size=2, args=(layout, str(tmp_path)), timeout_s=300)
    for result in (first, last):
        _check_rank(result)
    # uniform split of 4 blocks: stage 0 holds layers 0-1 and merak3d recomputes half of them;
    # the last stage recomputes none
    assert first["excluded"] == {"model.model.layers.0": "recomputed by the merak3d strategy (recompute='stage_aware')"}
    assert set(first["plan"]) == {"model.model.layers.1"}
    assert last["excluded"] == {} and set(last["plan"]) == {"model.model.layers.2", "model.model.layers.3"}
    # 1F1B over 4 micro-batches: the first stage holds two micro-batches at once, the last one
    forwards_before_first_backward = [e[0] for e in first["events"]].index("B")
    assert forwards_before_first_backward == 2, first["events"]
    assert [e[0] for e in last["events"]][:2] == ["F", "F"] and last["events"][2][0] == "B", last["events"]


@pytest.mark.distributed
@pytest.mark.parametrize("sharding", ["none", "gradients"])
def test_data_parallel_replicas_share_one_plan_and_match_unmanaged(tmp_path, sharding):
    """With ZeRO-2 the gradients' buckets come and go each step, around DELTA's swapped activations."""
    layout = {"data_parallel": 2, "pipeline_parallel": 1, "tensor_parallel": 1, "data_parallel_sharding": sharding}
    results = run_distributed(_rank, world_size=2, args=(layout, str(tmp_path)), timeout_s=300)
    for result in results:
        _check_rank(result)
        assert result["resident_after"] == 0
        assert set(result["plan"]) == {f"model.model.layers.{i}" for i in range(4)}
    assert results[0]["plan"] == results[1]["plan"]


def test_overrides_naming_no_block_fail_before_the_layout_is_built():
    torch.manual_seed(0)
    module = _SGDModule(build_causal_lm(LLAMA, vocab_size=VOCAB))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Merak3DStrategy(), logger=False)
    with pytest.raises(ValueError, match="layers.9"):
        DeltaMemory(overrides={"model.model.layers.9": "swap"}).setup(trainer, module, "fit")
    callback = DeltaMemory()
    callback.setup(trainer, module, "fit")
    assert callback.manager is None, "blocks are managed only once merak3d has cut the model"
