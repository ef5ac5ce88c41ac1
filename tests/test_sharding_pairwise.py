"""ZeRO's reduce-scatter over two CPU ranks by a send and a receive gives gloo's bits, in a hybrid group too."""

from __future__ import annotations

import pytest
import torch

from lightning_merak.testing.distributed import run_distributed


def _pairwise_rank(rank: int, world_size: int) -> list[bool]:
    import torch.distributed as dist

    from lightning_merak.strategies.merak3d.data_parallel import PairwiseReduceScatter

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world_size == 4 else [dist.group.WORLD]
    group = pairs[rank // 2]
    identical = []
    for numel in (2, 18, 4098, 2**16):
        generator = torch.Generator().manual_seed(100 * rank + numel)
        flat = torch.randn(numel, generator=generator) * torch.logspace(-6, 6, numel)
        expected = torch.empty(numel // 2)
        dist.reduce_scatter_tensor(expected, flat.clone(), group=group)
        out = torch.full((numel // 2,), float("nan"))
        work = PairwiseReduceScatter(out, flat, dist.get_rank(group), group)
        work.wait()
        work.wait()  # waiting again adds nothing
        identical.append(torch.equal(out, expected) and work.is_completed())
    return identical


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4], ids=["dp2", "two-pairs"])
def test_a_pairwise_reduce_scatter_gives_gloos_bits(world_size: int) -> None:
    results = run_distributed(_pairwise_rank, world_size, timeout_s=120)
    assert all(all(identical) for identical in results), results
