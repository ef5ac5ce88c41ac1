"""A Python user's ``Trainer.fit`` under merak3d leaves its process groups to be destroyed at exit when it ended
well, and only then (after a failure a peer may still wait inside a collective)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.distributed import process_exit
from lightning_merak.strategies import Merak3DStrategy
from lightning_merak.testing import run_distributed


class _Regression(pl.LightningModule):
    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.layer, self.fail = nn.Linear(4, 1), fail

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("the step failed")
        features, targets = batch
        return nn.functional.mse_loss(self.layer(features), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _RecordedExit:
    """Stands in for ``atexit`` in :mod:`~lightning_merak.distributed.process_exit`: what is registered now."""

    def __init__(self) -> None:
        self.registered: list[object] = []

    def register(self, function: object) -> None:
        self.registered.append(function)

    def unregister(self, function: object) -> None:
        self.registered = [known for known in self.registered if known is not function]


def _fit_twice(rank: int, world_size: int) -> list[list[object]]:
    recorded = process_exit.atexit = _RecordedExit()
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    after: list[list[object]] = []
    for fail in (False, True):
        trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(timeout_s=60),
                             max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, use_distributed_sampler=False)
        try:
            trainer.fit(_Regression(fail), data)
        except RuntimeError:
            assert fail
        after.append(list(recorded.registered))
    return after


@pytest.mark.distributed
def test_groups_are_left_at_exit_after_a_fit_that_ended_well_only() -> None:
    for after_success, after_failure in run_distributed(_fit_twice, 2, timeout_s=120):
        assert after_success == [process_exit.leave_process_groups]
        assert after_failure == []


def test_leaving_without_a_group_does_nothing() -> None:
    process_exit.leave_process_groups()
