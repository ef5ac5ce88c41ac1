"""Data for distributed tests: each data-parallel rank's share of fixed global batches."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class ReplicaBatches(pl.LightningDataModule):
    """Each data-parallel rank's slice of the global batches ``batches[first:last]`` (``[steps, batch, seq]``), so
    a run at any data-parallel degree sees the same global batches as a single-process reference."""

    def __init__(self, batches: torch.Tensor, first: int, last: int) -> None:
        super().__init__()
        self.batches, self.first, self.last = batches, first, last

    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        shard = self.batches.shape[1] // kwargs["num_replicas"]
        local = self.batches[self.first:self.last, kwargs["rank"] * shard:(kwargs["rank"] + 1) * shard]
        return DataLoader(TensorDataset(local.reshape(-1, self.batches.shape[2])), batch_size=shard, shuffle=False)
