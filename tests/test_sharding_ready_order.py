"""Buckets rebuilt after the first step in the order its backward finished the gradients: the same sums, exactly."""

from __future__ import annotations

import pytest

from lightning_merak.testing import run_distributed
from tests.test_merak3d_sharding import _check, _reference, _train_rank

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks


def _modes_rank(rank: int, world_size: int) -> list[dict]:
    """Plain dp and ZeRO-1 at dp=2, with overlap (buckets in ready order from the second step) and without (the
    reversed registration order throughout), small buckets so that several start during each backward."""
    from lightning_merak.parallel.data.buckets import DataParallelGradients

    ready_ordered: list[bool] = []
    build = DataParallelGradients.__init__

    def recording(self: DataParallelGradients, *args, **kwargs) -> None:
        build(self, *args, **kwargs)
        ready_ordered.append(self.ready_ordered)

    DataParallelGradients.__init__ = recording  # type: ignore[method-assign]
    results = []
    try:
        for mode in ("none", "optimizer"):
            for overlap in (True, False):
                ready_ordered.clear()
                layout = {"data_parallel": 2, "grad_bucket_mb": 0.01, "data_parallel_sharding": mode,
                          "overlap_grad_reduce": overlap}
                results.append({**_train_rank(rank, world_size, "llama", layout), "built": list(ready_ordered)})
    finally:
        DataParallelGradients.__init__ = build  # type: ignore[method-assign]
    return results


def test_ready_order_buckets_sum_what_the_reversed_ones_did_bit_for_bit():
    """At two ranks a sum has two addends, so any bucket layout gives the same bits: the overlapped runs (their
    buckets rebuilt in ready order after the first backward) must equal the runs without overlap (the reversed
    layout throughout) exactly, and the single-process reference within its tolerance."""
    reference = _reference("llama")
    for plain, plain_off, zero1, zero1_off in run_distributed(_modes_rank, 2, timeout_s=240):
        for on, off in ((plain, plain_off), (zero1, zero1_off)):
            assert on["built"] == [False, True] and off["built"] == [False]
            assert on["early_launches"] > 0 and off["early_launches"] == 0
            assert on["losses"] == off["losses"]
            for name, value in on["weights"].items():
                assert value.equal(off["weights"][name]), name
        _check([plain, zero1], reference)
