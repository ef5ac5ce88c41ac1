"""The ranks that hold different samples of a batch: what Lightning's logging and ``all_gather`` sum over.

A ``training_step`` and ``validation_step`` see the whole batch of their batch replica on every rank of it: its
tensor- and pipeline-parallel ranks hold the same samples, and so do its context-parallel ranks (the model shards
the sequence inside its forward and returns the whole batch's loss or logits: :mod:`.parallel.context.model`).
A value logged with ``reduce_fx="sum", sync_dist=True`` then counts each sample once only when summed over the ranks
that differ in their batch replica alone, as DDP sums over its replicas.
"""

from __future__ import annotations

import torch.distributed as dist

from lightning_merak.distributed.process_groups import new_group
from lightning_merak.parallel.layout import LayoutGroups
from lightning_merak.protocols.layout_aware import data_parallel_groups_from_mesh

__all__ = ["batch_replica_group"]


def batch_replica_group(groups: LayoutGroups) -> dist.ProcessGroup:
    """This rank's group of batch replicas: its data-parallel ranks with its position in their context-parallel
    group (each run of ``context_parallel`` consecutive ranks along ``dp`` is one); the data-parallel group itself
    without context parallelism. With it, a collective: every rank calls it once, creating every group in one order."""
    context = groups.layout.context_parallel
    if context == 1:
        return groups.data_parallel_group
    mine = None
    for line in data_parallel_groups_from_mesh(groups.mesh.mesh.tolist(), groups.mesh.mesh_dim_names or ()):
        for offset in range(context):
            ranks = line[offset::context]
            group = new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
    assert mine is not None
    return mine
