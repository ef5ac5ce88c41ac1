"""MoE balance metrics and load heatmaps on two gloo ranks under DDP, for both expert kinds (swapped DeepSpeed-MoE
layers, ``merak_ep``): by default they follow ``trainer.log_every_n_steps`` at Lightning's steps, the run's last
step included, and both draw the expert-load heatmap; the heatmap's rows count every route the ranks sent."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_merak.testing import run_distributed

pytestmark = pytest.mark.distributed

STEPS, BATCH, SEQ = 3, 2, 12
METRIC = {"merak_ep": "moe_ep/max_over_mean", "deepspeed": "moe/layer0/rb"}


def _batches(rank: int) -> torch.Tensor:
    return torch.randint(0, 128, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(20 + rank))


def _train(rank: int, world: int, experts: str, out: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.modules.config import OptimConfig
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    torch.manual_seed(0)
    family = "qwen3_moe" if experts == "merak_ep" else "mixtral"
    config = ProphetMoEConfig(experts=experts, ep_size=2, aux_loss_coef=0.0)  # moe.log_every_n_steps left unset
    model = tiny_moe_model(family)
    model.config.use_cache = False
    module = CausalLMModule(config.apply(model), OptimConfig(learning_rate=3e-3, warmup_steps=1, total_steps=STEPS))
    callback = config.build_callbacks()[0]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, log_every_n_steps=2,
                         logger=CSVLogger(out, name=experts, version=0), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[callback])
    trainer.fit(module, DataLoader(TensorDataset(_batches(rank)), batch_size=BATCH))
    history = {layer: before for layer, (before, _) in callback.history.items()}
    return {"history": history, "top_k": model.config.num_experts_per_tok,
            "logged": METRIC[experts] in trainer.callback_metrics}


@pytest.mark.parametrize("experts", ["merak_ep", "deepspeed"])
def test_moe_metrics_follow_the_trainer_and_both_expert_kinds_draw_the_load(tmp_path: Path, experts: str) -> None:
    results = run_distributed(_train, 2, args=(experts, str(tmp_path)), timeout_s=120)
    log_dir = tmp_path / experts / "version_0"
    with open(log_dir / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    steps = [int(row["step"]) for row in rows if row.get(METRIC[experts])]
    assert steps == [1, 2]  # trainer.log_every_n_steps=2 at Lightning's steps, and the run's last step
    assert [int(row["step"]) for row in rows if row.get("train/loss")] == [1]  # the same numbering
    assert all(result["logged"] for result in results)
    assert (log_dir / "moe_load_heatmap.png").stat().st_size > 0
    figures = sorted(path.name for path in (log_dir / "figures").glob("*.png"))
    assert figures == ["moe_load_heatmap_layer1-step2.png"]  # layer 0's figure is the PNG above
    for result in results:
        assert sorted(result["history"]) == [0, 1] and all(len(rows) == STEPS for rows in result["history"].values())
    if experts == "merak_ep":  # every route of both ranks' tokens lands on one EP rank's experts
        routes = 2 * BATCH * SEQ * results[0]["top_k"]
        assert all(sum(row) == routes for rows in results[0]["history"].values() for row in rows)
        assert results[0]["history"] == results[1]["history"]  # counts all-gathered: alike on every rank
