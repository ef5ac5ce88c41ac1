"""The blocks merak3d splits: a bigger container of same-class modules that the forward does not chain (output heads,
per-layer side modules) is refused naming the other candidates, and blocks of mixed classes are told to be one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_merak.parallel.pipeline.trace import TraceError, find_trunk, trace_model
from lightning_merak.strategies.merak3d.network import module_view

VOCAB, WIDTH = 64, 16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.linear(hidden))


class _OtherBlock(_Block):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden - torch.tanh(self.linear(hidden))


class _Net(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


class _TwoHeads(_Net):
    """Two output heads in a ModuleList holding more parameters than the blocks; their logits averaged."""

    def __init__(self) -> None:
        super().__init__([_Block() for _ in range(4)])
        self.heads = nn.ModuleList(nn.Linear(WIDTH, VOCAB) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return sum(head(hidden) for head in self.heads) / len(self.heads)


class _SideModules(_Net):
    """A bigger ModuleList of per-layer side modules, each called beside its block."""

    def __init__(self) -> None:
        super().__init__([_Block() for _ in range(4)])
        self.side = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH))
                                  for _ in range(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block, side in zip(self.blocks, self.side):
            hidden = block(hidden) + 0.1 * side(hidden)
        return self.head(hidden)


@pytest.mark.parametrize(("net", "taken"), [(_TwoHeads, "heads"), (_SideModules, "side")])
def test_a_bigger_container_the_forward_does_not_chain_is_refused_naming_the_blocks(net, taken):
    torch.manual_seed(0)
    with pytest.raises(TraceError, match=f"takes {taken}, .*not call them one after another on the hidden state.*"
                                         "the other candidates: blocks"):
        trace_model(net(), torch.randint(VOCAB, (2, 8)), profile=False)


def test_a_lone_chained_trunk_beside_another_container_traces():
    """The blocks are the largest container and chained: a smaller list of heads beside them changes nothing."""
    torch.manual_seed(0)
    net = _TwoHeads()
    net.heads = nn.ModuleList(nn.Linear(WIDTH, 2) for _ in range(2))  # smaller than the blocks
    net.forward = lambda ids: _Net.forward(net, ids)
    assert trace_model(net, torch.randint(VOCAB, (2, 8)), profile=False).trunk_path == "blocks"


def test_blocks_of_mixed_classes_are_told_to_be_one_class():
    net = _Net([_Block(), _OtherBlock(), _Block(), _OtherBlock()])
    with pytest.raises(TraceError, match=r"blocks holds blocks of several classes \(_Block, _OtherBlock\): its blocks "
                                         "must be one class"):
        find_trunk(net)
    holder = nn.Module()
    holder.net = net
    with pytest.raises(TypeError, match=r"net.blocks holds blocks of several classes .*must be one class"):
        module_view(holder, pipeline_parallel=2, tensor_parallel=1)
