"""Buffers that first change after the first training step (an EMA enabled after a warm-up, a batch statistic
unfrozen later) are kept equal over merak3d's data-parallel replicas as DDP keeps them: rank 0's values reach
every replica before each training forward, from the step after their first change on."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed
from lightning_merak.util.buffers import ReplicaBuffers

HIDDEN, STEPS, BATCH, WARMUP = 4, 4, 2, 1
"""Features, training steps, samples per replica and step, and the steps before the statistics start updating."""


class _LateStats(nn.Module):
    """A linear layer over its normalised input, whose statistics start updating once ``updating`` is set: a
    batch-norm kernel's (which counts no version) and an EMA written in place; a constant buffer never changes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(HIDDEN, 1)
        self.register_buffer("running_mean", torch.zeros(HIDDEN))
        self.register_buffer("running_var", torch.ones(HIDDEN))
        self.register_buffer("ema", torch.zeros(HIDDEN))
        self.register_buffer("constant", torch.ones(HIDDEN))
        self.updating = False

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        updating = self.training and self.updating
        if updating:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(0.5 * inputs.mean(0))
        normed = F.batch_norm(inputs, self.running_mean, self.running_var, training=updating, momentum=0.5)
        return self.linear(normed * self.constant)


def _statistics(net: _LateStats) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in net.named_buffers()}


# Single process: which buffers a sync sends ------------------------------------------------------------------


class _TwoRanks:
    """A data-parallel group of two as :class:`ReplicaBuffers` asks it (the collectives are stubbed)."""

    def size(self) -> int:
        return 2


def test_a_buffer_is_sent_from_the_sync_after_its_first_change_on_even_when_the_first_step_left_it_alone(
        monkeypatch):
    sent: list[list[int]] = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda flags, op, group: None)  # this rank's flags
    monkeypatch.setattr(torch.distributed, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(torch.distributed, "broadcast", lambda flat, src, group: sent[-1].append(flat.numel()))
    net = _LateStats()
    names = {id(tensor): name for name, tensor in net.named_buffers()}
    replicas = ReplicaBuffers()
    group = _TwoRanks()
    for step in range(STEPS):
        sent.append([])
        replicas.before_training_step(net, group)
        net.updating = step >= WARMUP
        net(torch.randn(BATCH, HIDDEN))
    sent_names = sorted(names[id(owner._buffers[name])] for owner, name in replicas._changing)
    assert sent_names == ["ema", "running_mean", "running_var"]  # not the constant
    # step 1 takes the snapshot, step 2 finds nothing changed yet; from step 3 on the three buffers (one dtype)
    assert sent == [[], [], [3 * HIDDEN], [3 * HIDDEN]]


def test_a_model_whose_buffers_never_change_sends_none(monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda flags, op, group: None)
    monkeypatch.setattr(torch.distributed, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *args, **kwargs: pytest.fail("a buffer was sent"))
    net = _LateStats()
    replicas = ReplicaBuffers()
    for _ in range(STEPS):
        replicas.before_training_step(net, _TwoRanks())
        net(torch.randn(BATCH, HIDDEN))
    replicas.before_validation(net, _TwoRanks())
    assert replicas._changing == []


# Two ranks against DDP's semantics -------------------------------------------------------------------------


class _LateModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _LateStats()
        self.batches: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.net.updating = batch_idx >= WARMUP  # a schedule turns the statistics on after a warm-up
        self.batches.append(batch.clone())
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _train_rank(rank: int, world_size: int) -> dict:
    strategy = Merak3DStrategy(data_parallel=world_size, timeout_s=60)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    module = _LateModule()
    samples = torch.randn(STEPS * BATCH * world_size, HIDDEN, generator=torch.Generator().manual_seed(3))
    trainer.fit(module, DataLoader(samples, batch_size=BATCH))
    return {"statistics": _statistics(module.net), "batches": module.batches}


def _as_ddp_keeps_them(batches: list[list[torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each rank's buffers after training on its ``batches``, rank 0's values taken before every forward (DDP's
    ``broadcast_buffers=True``): rank 0's own history, and each other rank's last step on top of it."""
    reference = _LateStats()
    before_last: dict[str, torch.Tensor] = {}
    for step, batch in enumerate(batches[0]):
        before_last = _statistics(reference)
        reference.updating = step >= WARMUP
        reference(batch)
    results = [_statistics(reference)]
    for rank_batches in batches[1:]:
        with torch.no_grad():
            for name, tensor in reference.named_buffers():
                tensor.copy_(before_last[name])
        reference(rank_batches[-1])
        results.append(_statistics(reference))
    return results


@pytest.mark.distributed
def test_replicas_take_rank_zeros_buffers_that_start_changing_after_the_first_step_as_ddp_does():
    results = run_distributed(_train_rank, 2, timeout_s=120)
    batches = [result["batches"] for result in results]
    assert [len(rank_batches) for rank_batches in batches] == [STEPS, STEPS]
    assert not torch.equal(batches[0][-1], batches[1][-1])  # the statistics differ per rank without syncing
    for rank, (result, expected) in enumerate(zip(results, _as_ddp_keeps_them(batches), strict=True)):
        for name, tensor in expected.items():
            torch.testing.assert_close(result["statistics"][name], tensor, rtol=0, atol=1e-6,
                                       msg=f"rank {rank}: {name}")
