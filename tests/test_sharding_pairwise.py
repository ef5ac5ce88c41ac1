"""ZeRO's reduce-scatter on CPU ranks as an all-to-all of owned parts: over two ranks gloo's bits (in a hybrid group
too); over three and four ranks the sum in rank order, within rounding of gloo's, and training that matches."""

from __future__ import annotations

import pytest
import torch

from lightning_merak.parallel.data.reduce_scatter import sum_in_rank_order
from lightning_merak.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks


def _pairwise_rank(rank: int, world_size: int) -> list[bool]:
    import torch.distributed as dist

    from lightning_merak.parallel.data.reduce_scatter import PairwiseReduceScatter

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


@pytest.mark.parametrize("world_size", [2, 4], ids=["dp2", "two-pairs"])
def test_a_pairwise_reduce_scatter_gives_gloos_bits(world_size: int) -> None:
    results = run_distributed(_pairwise_rank, world_size, timeout_s=120)
    assert all(all(identical) for identical in results), results


PART_LENGTHS = (1, 7, 1365, 2**13 + 1)
"""Elements per rank: odd lengths (gloo's ring segments then split unevenly), one element, a few pages."""


def _exchange_rank(rank: int, world_size: int) -> list[dict[str, object]]:
    import torch.distributed as dist

    from lightning_merak.parallel.data.reduce_scatter import ExchangeReduceScatter, start_reduce_scatter

    outcomes = []
    for part in PART_LENGTHS:
        numel = world_size * part
        generator = torch.Generator().manual_seed(100 * rank + numel)
        flat = torch.randn(numel, generator=generator) * torch.logspace(-6, 6, numel)
        flat[numel - world_size + 1:] = 0.0  # a bucket's padding: its last part ends in zeros on every rank
        sent = flat.clone()
        expected = torch.empty(part)
        dist.reduce_scatter_tensor(expected, flat.clone(), group=dist.group.WORLD)
        everyone = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(everyone, flat)
        mine = [copy.view(world_size, part)[rank] for copy in everyone]
        ordered = sum_in_rank_order(mine, torch.empty(part))
        magnitude = sum_in_rank_order([piece.abs() for piece in mine], torch.empty(part))
        out = torch.full((part,), float("nan"))
        work = start_reduce_scatter(out, flat, dist.group.WORLD)
        work.wait()
        work.wait()  # waiting again adds nothing
        outcomes.append({
            "exchange": isinstance(work, ExchangeReduceScatter) and work.is_completed(),
            "ordered_exactly": torch.equal(out, ordered),
            "flat_untouched": torch.equal(flat, sent),
            # the two orders of n addends differ by at most (n - 1) roundings of partial sums of |x|
            "within_rounding": bool(((out - expected).abs()
                                     <= world_size * torch.finfo(out.dtype).eps * magnitude).all()),
            "padding_sums_to_zero": part != 1 or rank != world_size - 1 or bool(out.eq(0).all()),
        })
    return outcomes


@pytest.mark.parametrize("world_size", [3, 4])
def test_an_exchange_over_three_or_more_ranks_sums_in_rank_order(world_size: int) -> None:
    """The all-to-all's sum equals the fixed-order sum bit for bit and gloo's ring sum to rounding."""
    results = run_distributed(_exchange_rank, world_size, timeout_s=120)
    for rank, outcomes in enumerate(results):
        for part, outcome in zip(PART_LENGTHS, outcomes):
            assert all(outcome.values()), (rank, part, outcome)


def test_a_bucket_that_does_not_split_evenly_is_refused() -> None:
    """Refused before any exchange starts (the check needs only the group's size)."""
    results = run_distributed(_uneven_rank, 3, timeout_s=60)
    assert all("pad it to a multiple" in message for message in results), results


def _uneven_rank(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    from lightning_merak.parallel.data.reduce_scatter import ExchangeReduceScatter

    try:
        ExchangeReduceScatter(torch.empty(3), torch.zeros(10), dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "not refused"


def test_sum_in_rank_order_adds_left_to_right() -> None:
    parts = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])]
    assert sum_in_rank_order(parts, torch.empty(1)).item() == 0.0  # (1e8 + 1) rounds to 1e8 in fp32
    assert sum_in_rank_order(parts[::-1], torch.empty(1)).item() == 0.0
    assert sum_in_rank_order([parts[0], parts[2], parts[1]], torch.empty(1)).item() == 1.0


def _zero_dp4_rank(rank: int, world_size: int) -> list[dict]:
    """ZeRO-1 and ZeRO-2 at dp=4 with small buckets, counting the exchanges they start."""
    from lightning_merak.parallel.data import reduce_scatter
    from tests.test_merak3d_sharding import _train_rank

    started = [0]
    build = reduce_scatter.ExchangeReduceScatter.__init__

    def counting(self, *args, **kwargs) -> None:
        started[0] += 1
        build(self, *args, **kwargs)

    reduce_scatter.ExchangeReduceScatter.__init__ = counting  # type: ignore[method-assign]
    try:
        results = []
        for mode in ("optimizer", "gradients"):
            started[0] = 0
            layout = {"data_parallel": 4, "grad_bucket_mb": 0.01, "data_parallel_sharding": mode}
            results.append({**_train_rank(rank, world_size, "llama", layout), "exchanges": started[0]})
        return results
    finally:
        reduce_scatter.ExchangeReduceScatter.__init__ = build  # type: ignore[method-assign]


def test_zero_at_dp4_trains_as_one_process_does() -> None:
    """ZeRO-1 and ZeRO-2 over four CPU ranks reduce-scatter by exchange and match the single-process run (losses
    to 1e-5, weights after Adam to the tolerance plain data parallelism gets), each rank stepping a quarter."""
    from tests.test_merak3d_sharding import _check, _reference

    reference = _reference("llama")
    for zero1, zero2 in run_distributed(_zero_dp4_rank, 4, timeout_s=300):
        _check([zero1, zero2], reference)
        for result in (zero1, zero2):
            assert result["exchanges"] > 0 and result["early_launches"] > 0
        assert zero1["optimizer_elements"] == zero2["optimizer_elements"]
