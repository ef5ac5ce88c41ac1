"""A benchmark row that fails makes the script exit non-zero, after its table and JSON (no real runs: the measuring
functions are replaced)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import lightning_merak.testing
from benchmarks import adapters, planner


def test_a_failed_adapter_layout_exits_one_after_writing_the_json(monkeypatch, tmp_path, capsys):
    def rank_died(*args: object, **kwargs: object) -> None:
        raise RuntimeError("rank 1 died: simulated failure")

    monkeypatch.setattr(lightning_merak.testing, "run_distributed", rank_died)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    out = tmp_path / "adapters_layouts.json"
    assert adapters.main(["--leg", "layouts", "--quick", "--out", str(out)]) == 1
    written = json.loads(out.read_text())
    assert {row["layout"] for row in written["rows"]} == {"tp2", "pp2", "dp2_full"}
    assert "simulated failure" in capsys.readouterr().err


def _layout(dp: int) -> dict[str, object]:
    return {"dp": dp, "pp": 1, "tp": 2 // dp, "micro_batches": None, "overlap": 1}


@pytest.mark.parametrize("fails", [False, True])
def test_a_failed_planner_layout_exits_one_after_writing_the_json(fails, monkeypatch, tmp_path, capsys):
    plan = [{"layout": _layout(dp), "step_s": 0.1 * dp, "samples": dp, "components": {}} for dp in (1, 2)]
    keys = [planner._layout_key(p["layout"]) for p in plan]
    group = SimpleNamespace(name="base", merak={}, layers=0, layouts=keys)
    calibration = SimpleNamespace(describe=lambda: {})
    written = []
    monkeypatch.setattr(planner, "prepare_rank_heap", lambda default_heap: "test heap")
    monkeypatch.setattr(planner, "_plan", lambda mode: plan)
    monkeypatch.setattr(planner, "calibration_groups", lambda plan: [group])
    monkeypatch.setattr(planner, "_traced_run", lambda merak, layers: None)
    monkeypatch.setattr(planner, "_calibration_run", lambda name, trace: {})
    monkeypatch.setattr(planner, "_measure", lambda layout, mode: "rank 1 died" if fails and layout["dp"] == 2
                        else planner.Measured(0.1, 0.1))
    monkeypatch.setattr(planner, "_predictor", lambda groups, traces: SimpleNamespace(calibration=calibration))
    monkeypatch.setattr(planner, "_replay_predictions", lambda plan, predictors: dict.fromkeys(keys, 0.1))
    monkeypatch.setattr(planner, "_held_out_replay", lambda plan, groups, traces: dict.fromkeys(keys, 0.1))
    monkeypatch.setattr(planner, "_replay_splits", lambda plan, predictor: dict.fromkeys(keys))
    monkeypatch.setattr(planner, "write_run", lambda *args, **kwargs: written.append(args) or tmp_path / "p.json")
    assert planner.main(["--quick"]) == (1 if fails else 0)
    assert len(written) == 1
    assert (f"{keys[1]} failed: rank 1 died" in capsys.readouterr().err) == fails
