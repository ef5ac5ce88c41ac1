"""Our DeepSpeed-MoE layer under merak3d needs its layout when the callbacks are set up, before a planner runs.

``moe=prophet strategy.pipeline_parallel=auto`` launched and then failed on every rank with "the device mesh exists
once processes have started"; it is refused before launch, naming the degrees to fix or merak_ep.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lightning_merak.strategies.merak3d import Merak3DStrategy

from .test_train import refused

TINY_MOE = ["model=mixtral_tiny", "moe=prophet", "strategy=merak3d", "trainer.devices=2", "trainer.max_steps=1"]


def test_merak_train_refuses_deepspeed_experts_under_a_planned_layout_before_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    code, output = refused([*TINY_MOE, "strategy.pipeline_parallel=auto"], tmp_path, monkeypatch, capsys)
    assert code == 2, output.out + output.err
    assert output.err.startswith("merak-train: error: the DeepSpeed-MoE layer's expert groups are carved from "
                                 "merak3d's layout when the callbacks are set up, before the planner chooses one")
    assert "or use moe.experts=merak_ep" in output.err


def test_a_layout_read_before_the_planner_chose_names_the_degrees(monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = Merak3DStrategy(pipeline_parallel="auto")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match=r"merak3d plans its layout at setup .*: nothing can read its device mesh"):
        _ = strategy.device_mesh
