"""A merak3d MoE run at ``data_parallel="auto"`` (the README's ``moe=prophet`` default) resumes: Lightning restores
the checkpoint before ``setup``, and the experts each rank reads follow the layout adopted when the processes
started, which resolved the ``"auto"`` degree."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed

RESUME_AT = 2


def test_expert_placement_reads_the_layout_adopted_at_start() -> None:
    strategy = Merak3DStrategy(data_parallel="auto")
    with pytest.raises(ValueError, match="needs fixed degrees"):  # no layout yet: the arguments leave dp open
        strategy._expert_placement()
    strategy._groups = SimpleNamespace(layout=strategy._arguments.layout(2))  # as setup_environment adopts it
    assert strategy._expert_placement() == (0, (1, 2, 1))
    assert strategy._checkpointer._data_parallel_ranks() == (0, [0, 1])  # the ranks its expert groups are carved from


def auto_resume_run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """dp="auto" on 2 ranks (so dp=2), experts split over both; saved after an epoch of 2 steps, resumed."""
    from tests.test_moe_checkpoint import merak3d_resume_runs

    return merak3d_resume_runs(str(Path(directory) / "auto-moe"), world_size, {"data_parallel": "auto"},
                               data_rank=rank)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_merak3d_moe_resumes_at_data_parallel_auto(tmp_path: Path) -> None:
    from tests.test_moe_checkpoint import assert_resumed_like_straight

    results = run_distributed(auto_resume_run, 2, args=(str(tmp_path),), timeout_s=240)
    assert set(results[0]["straight_experts"]) != set(results[1]["straight_experts"]), "ranks hold other experts"
    assert_resumed_like_straight(results)
