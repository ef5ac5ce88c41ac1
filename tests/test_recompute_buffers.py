"""A recomputed block leaves its buffers as its forward left them: merak3d's ``RecomputedForward`` and the
re-enterable context both it and DeltaMemory use (torch recomputes a region once per backward pass reaching it)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_merak.protocols.layout_aware import RecomputedForward
from lightning_merak.util.buffers import KeptBuffers


class _NormedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)).relu()


def test_a_recomputed_block_counts_each_batch_once_in_its_running_statistics() -> None:
    torch.manual_seed(0)
    plain = _NormedBlock()
    recomputed = copy.deepcopy(plain)
    recomputed.forward = RecomputedForward(recomputed.forward)
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step), requires_grad=True)
        for block in (plain, recomputed):
            block(x).square().sum().backward()
    for name, buffer in plain.named_buffers():
        torch.testing.assert_close(dict(recomputed.named_buffers())[name], buffer, rtol=0, atol=0)
    torch.testing.assert_close(recomputed.linear.weight.grad, plain.linear.weight.grad)


def test_kept_buffers_is_entered_once_per_recomputation() -> None:
    block, entries = _NormedBlock(), []

    class _Counted:
        def __enter__(self) -> None:
            entries.append("in")

        def __exit__(self, *exc_info: object) -> None:
            entries.append("out")

    kept = KeptBuffers(block, _Counted())
    for _ in range(2):  # two recomputations of one region: a generator context fails the second
        with kept:
            block(torch.randn(8, 4))
    assert entries == ["in", "out", "in", "out"]
    assert int(block.norm.num_batches_tracked) == 0
