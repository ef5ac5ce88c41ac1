"""EmbRace's optimizer state in a checkpoint, in one process: the entries saved whole are recorded by table (an untied
head of the table's shape is not one of them), the live state is left alone, and a resumed rank keeps its columns."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.callbacks.sparse_comm.embrace import column_bounds, shard_embeddings
from lightning_merak.callbacks.sparse_comm.embrace_checkpoint import (
    GATHERED_ENTRIES,
    gather_optimizer_states,
    slice_optimizer_states,
)

ROWS, WIDTH = 64, 8


def _stepped(group: dist.ProcessGroup) -> tuple[nn.Module, dict[str, object], torch.optim.Optimizer]:
    """A table and an untied head of the same shape, sharded and stepped once by Adam."""
    model = nn.ModuleDict({"embed": nn.Embedding(ROWS, WIDTH), "head": nn.Linear(WIDTH, ROWS, bias=False)})
    tables = shard_embeddings(model, ["embed"], group)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model["head"](model["embed"](torch.arange(5))).sum().backward()
    optimizer.step()
    return model, tables, optimizer


def test_the_checkpoint_records_the_table_entries_and_a_resumed_rank_keeps_its_columns(
        single_rank_group: dist.ProcessGroup) -> None:
    model, tables, optimizer = _stepped(single_rank_group)
    shard = model["embed"].shard
    live = optimizer.state[shard]
    checkpoint = {"optimizer_states": [optimizer.state_dict()]}
    gather_optimizer_states(checkpoint, [optimizer], tables)
    index = [id(p) for p in optimizer.param_groups[0]["params"]].index(id(shard))
    assert checkpoint[GATHERED_ENTRIES] == [[[0, index, "embed"]]]
    saved = checkpoint["optimizer_states"][0]["state"][index]
    assert saved is not live and optimizer.state[shard] is live
    whole = saved["exp_avg"].clone()

    table = tables["embed"]  # as rank 1 of 2 would hold it
    table.bounds, table.group_rank = column_bounds(WIDTH, 2), 1
    slice_optimizer_states(checkpoint, tables)
    resumed = checkpoint["optimizer_states"][0]["state"][index]
    assert torch.equal(resumed["exp_avg"], whole[:, WIDTH // 2:]) and resumed["exp_avg"].is_contiguous()
    assert resumed["step"] == saved["step"] and GATHERED_ENTRIES not in checkpoint


def test_a_resume_without_the_sharded_table_names_it_and_the_fix(single_rank_group: dist.ProcessGroup) -> None:
    _, tables, optimizer = _stepped(single_rank_group)
    checkpoint = {"optimizer_states": [optimizer.state_dict()]}
    gather_optimizer_states(checkpoint, [optimizer], tables)
    with pytest.raises(ValueError, match=r"EmbRace table 'embed'.*EmbRace does not shard.*SparseCommunication"):
        slice_optimizer_states(checkpoint, {})
