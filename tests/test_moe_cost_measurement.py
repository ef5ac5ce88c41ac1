"""The cost model's constants are measured on the running ranks (issue #25: profiled, not hand-set)."""

from __future__ import annotations

from typing import Any

import pytest


def _profile(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_merak.plugins.moe.cost_measurement import profile_cost_model

    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    cost = profile_cost_model(expert, 32, 1, dist.group.WORLD, list(range(world_size)), repeats=2)
    return {"shared": cost.expert_tokens_per_s, "alone": cost.expert_tokens_per_s_alone,
            "measured": dict(cost.measured), "same": [cost.all_to_all.seconds, cost.point_to_point.seconds]}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_profile_measures_the_lone_rank_expert_rate_identically_on_every_rank() -> None:
    from lightning_merak.testing import run_distributed

    results = run_distributed(_profile, 2, timeout_s=90)
    assert all(r == results[0] for r in results)  # one MAX-reduced set of figures: every rank plans alike
    first = results[0]
    assert first["measured"]["expert_forward_alone_1024_tokens_s"] > 0
    assert first["alone"] is None or first["alone"] > first["shared"]
