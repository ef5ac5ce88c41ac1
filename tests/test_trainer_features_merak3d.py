"""Lightning Trainer features a user combines with merak3d, against the same Trainer in one process: clipping by
value (tensor-parallel shards beside whole gradients), evaluating the best checkpoint after a fit (read into the
layout the fit built), evaluation loaders whose last batch is smaller than the first (filled up for the pipeline's
stages, the fillers left out)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.distributed.dtensors import local_tensor
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed
from tests.test_shapes_precisions import SEQ, VOCAB, _module


def _loader(samples: int, seed: int) -> DataLoader:
    ids = torch.randint(VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(ids), batch_size=4)


def _fit_and_evaluate(rank: int, world_size: int, layout: dict, directory: str) -> dict:
    """Fit 2 steps clipped by value, then validate and predict the best checkpoint on 5 samples in batches of 4;
    then again after the weights were moved off it."""
    module = _module()
    strategy = Merak3DStrategy(**layout, timeout_s=60) if layout else "auto"
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         gradient_clip_val=0.003, gradient_clip_algorithm="value", use_distributed_sampler=False,
                         callbacks=[ModelCheckpoint(dirpath=directory, monitor="val/loss", save_top_k=1)])
    trainer.fit(module, _loader(8, 1), _loader(5, 2))
    results = {}
    for attempt in ("best", "restored"):
        results[attempt] = {
            "val": trainer.validate(module, _loader(5, 2), ckpt_path="best", verbose=False)[0]["val/loss"],
            "logits": torch.cat(trainer.predict(module, _loader(5, 2), ckpt_path="best")),
        }
        with torch.no_grad():  # off the checkpoint: the next evaluation must read it again
            for param in module.parameters():
                local_tensor(param).add_(0.5)
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"pipeline_parallel": 2, "micro_batches": 2}, {"tensor_parallel": 2}],
                         ids=["pp2", "tp2"])
def test_clipped_fit_then_best_checkpoint_evaluates_as_one_process(layout, tmp_path: Path):
    reference = _fit_and_evaluate(0, 1, {}, str(tmp_path / "reference"))
    for result in run_distributed(_fit_and_evaluate, 2, args=(layout, str(tmp_path / "merak3d")), timeout_s=120):
        for attempt in ("best", "restored"):
            assert result[attempt]["val"] == pytest.approx(reference["best"]["val"], rel=1e-5)
            torch.testing.assert_close(result[attempt]["logits"], reference["best"]["logits"], rtol=1e-4, atol=1e-5)
