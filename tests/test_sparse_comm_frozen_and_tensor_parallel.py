"""EmbRace keeps a frozen table frozen (a PEFT/LoRA base), tied head included; S2 and ``auto`` refuse merak3d's
tensor-parallel ranks, whose table gradients are DTensors, at the callback's setup and in merak-train before launch.
In one process: a group of one rank runs the same sharding, lookups and autograd as a wider one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.callbacks.sparse_comm.arguments import check_merak3d_layout
from lightning_merak.callbacks.sparse_comm.callback import SparseCommunication
from lightning_merak.callbacks.sparse_comm.embrace import ShardedEmbedding, ShardedTiedHead, shard_embeddings

from .test_train import refused

ROWS, WIDTH = 64, 8


def _frozen_table_model(tied: bool) -> nn.ModuleDict:
    """A frozen table, a trainable layer and a head (tied to the table, or a trainable one of its own)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"embed": nn.Embedding(ROWS, WIDTH), "mix": nn.Linear(WIDTH, WIDTH),
                           "head": nn.Linear(WIDTH, ROWS, bias=False)})
    if tied:
        model["head"].weight = model["embed"].weight
    model["embed"].weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied_head"])
def test_embrace_keeps_a_frozen_table_frozen_through_training_and_loading(
        single_rank_group: dist.ProcessGroup, tied: bool) -> None:
    model = _frozen_table_model(tied)
    before = model["embed"].weight.detach().clone()
    shard_embeddings(model, ["embed"], single_rank_group)
    table = model["embed"]
    assert isinstance(table, ShardedEmbedding) and not table.shard.requires_grad
    assert isinstance(model["head"], ShardedTiedHead) == tied
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    for _ in range(2):
        optimizer.zero_grad()
        model["head"](model["mix"](table(torch.arange(10)))).square().sum().backward()
        optimizer.step()
    assert table.shard.grad is None and model["mix"].weight.grad is not None
    torch.testing.assert_close(table.full_weight(), before, rtol=0, atol=0)
    model.load_state_dict({**model.state_dict(), "embed.weight": before + 1.0}, strict=False)  # an unsharded save
    assert not table.shard.requires_grad
    torch.testing.assert_close(table.shard, before + 1.0)


def test_embrace_still_trains_a_trainable_table(single_rank_group: dist.ProcessGroup) -> None:
    table = ShardedEmbedding.from_embedding(nn.Embedding(ROWS, WIDTH), single_rank_group)
    assert table.shard.requires_grad


@pytest.mark.parametrize("method", ["s2", "auto"])
@pytest.mark.parametrize("tensor_parallel", [2, "auto"])
def test_s2_refuses_tensor_parallel_under_merak3d_naming_the_fix(method: str, tensor_parallel: int | str) -> None:
    layout = SimpleNamespace(pipeline_parallel=1, tensor_parallel=tensor_parallel, data_parallel=2)
    with pytest.raises(ValueError, match=r"needs tensor_parallel=1.*strategy\.tensor_parallel=1.*comm=dense"):
        SparseCommunication(method)._check_layout(layout)


@pytest.mark.parametrize("method", [None, "dense", "s2", "auto", "embrace"])
def test_the_layouts_each_method_runs_under_pass(method: str | None) -> None:
    check_merak3d_layout(method, SimpleNamespace(pipeline_parallel=1, tensor_parallel=1))
    if method in (None, "dense", "embrace"):
        check_merak3d_layout(method, SimpleNamespace(pipeline_parallel=1, tensor_parallel=2))


def test_merak_train_refuses_comm_s2_with_tensor_parallel_before_launch(tmp_path: Path, monkeypatch, capsys) -> None:
    code, output = refused(["comm=s2", "strategy.tensor_parallel=2"], tmp_path, monkeypatch, capsys)
    assert code == 2, output.out + output.err
    assert "method='s2' under merak3d needs tensor_parallel=1" in output.err, output.err[-3000:]
