"""The per-sample context-parallel cost model is fitted as :class:`DegreeCost` prices a sample.

A split sample pays the forward's fixed overhead once on every rank; taking ``1/size`` of it off the measured time
left the rest to each ring step's exchange, which came out ``overhead/size`` too high.
"""

from __future__ import annotations

import pytest

from lightning_merak.parallel.context.rounds import fit_degree_cost
from lightning_merak.parallel.context.variable import DegreeCost
from lightning_merak.parallel.micro_batching.plan import CostModel


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("lengths", [(512, 1024, 2048), (2, 5, 11)])
def test_the_fit_recovers_the_costs_that_produced_the_timings(size: int, lengths: tuple[int, ...]) -> None:
    truth = DegreeCost(CostModel(per_token=2e-5, per_token_squared=3e-9, overhead=4e-3), exchange_per_step=1e-3)
    alone = [(1, length, truth.time(length, 1)) for length in lengths]
    split = [(length, truth.time(length, size)) for length in lengths]
    fitted = fit_degree_cost(alone, split, size)
    assert fitted.exchange_per_step == pytest.approx(truth.exchange_per_step, rel=1e-6)
    for length in lengths:
        assert fitted.time(length, size) == pytest.approx(truth.time(length, size), rel=1e-6)
