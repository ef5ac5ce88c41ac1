"""The moe_families benchmark's paired statistic: per-round ratios of the slowest rank's steps, then their median."""

from __future__ import annotations

import pytest

from benchmarks.moe_families import _paired_speedup


def test_paired_speedup_takes_each_rounds_slowest_rank_then_the_median_ratio() -> None:
    peers = [{"steps_ms": {"eager": [10.0, 40.0, 12.0], "ours": [5.0, 30.0, 6.0]}},
             {"steps_ms": {"eager": [12.0, 20.0, 9.0], "ours": [4.0, 10.0, 8.0]}}]
    # slowest rank per round: eager 12, 40, 12 and ours 5, 30, 8 → ratios 2.4, 1.33, 1.5
    assert _paired_speedup(peers, "eager") == pytest.approx(1.5)

