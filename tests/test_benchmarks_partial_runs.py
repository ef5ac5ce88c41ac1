"""A partial or non-default benchmark run is refused as a full run (it would join the goals' three runs) before any
work starts, and goal texts say what is measured."""

from __future__ import annotations

import pytest

from benchmarks import moe, moe_families, planner, replay
from benchmarks.context_parallel import VARIABLE_SPEEDUP


def _no_work(*args: object, **kwargs: object) -> None:
    raise AssertionError("the run started before its flags were checked")


@pytest.mark.parametrize("argv", [["--configs", "base"], ["--world-size", "2"], ["--policies", "ours_block"],
                                  ["--records", "RECORDS"]])
def test_moe_partial_runs_are_refused_as_full_runs(argv, monkeypatch, tmp_path, capsys):
    records = tmp_path / "records.json"
    records.write_text("[]")
    monkeypatch.setattr(moe, "run_clusters", _no_work)
    monkeypatch.setattr(moe, "rank_quota", _no_work)
    with pytest.raises(SystemExit) as exit_:
        moe.main([str(records) if arg == "RECORDS" else arg for arg in argv])
    assert exit_.value.code == 2 and "--out PATH" in capsys.readouterr().err


def test_moe_partial_run_with_out_goes_ahead(monkeypatch, tmp_path):
    def started(*args: object) -> None:
        raise RuntimeError("started")

    monkeypatch.setattr(moe, "rank_quota", started)
    with pytest.raises(RuntimeError, match="started"):
        moe.main(["--configs", "base", "--out", str(tmp_path / "moe.json")])


def test_moe_families_subset_is_refused_as_a_full_run(monkeypatch, capsys):
    monkeypatch.setattr(moe_families, "_cpu_leg", _no_work)
    with pytest.raises(SystemExit) as exit_:
        moe_families.main(["--families", moe_families._families()[0]])
    assert exit_.value.code == 2 and "--families" in capsys.readouterr().err


def test_planner_on_the_default_heap_is_refused_as_a_full_run(monkeypatch, capsys):
    monkeypatch.setattr(planner, "prepare_rank_heap", _no_work)
    with pytest.raises(SystemExit) as exit_:
        planner.main(["--default-heap"])
    assert exit_.value.code == 2 and "--default-heap" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--pin", "--default-heap"])
def test_replay_pinned_or_on_the_default_heap_is_refused_as_a_full_run(flag, monkeypatch, capsys):
    monkeypatch.setattr(replay, "emulation_available", _no_work)
    monkeypatch.setattr(replay, "restart_with_heap_tunables", _no_work)
    with pytest.raises(SystemExit) as exit_:
        replay.main([flag])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_simulated_moe_goals_say_sim():
    assert moe.SIMULATED_WORST_STEP.definition.startswith("[sim] ")
    assert moe.SIMULATED_OURS_OVER_BEST.definition.startswith("[sim] ")
    assert not moe.WORST_STEP.definition.startswith("[sim]")


def test_variable_cp_goal_says_one_mix_the_best_fixed_cp_and_repetitions():
    text = VARIABLE_SPEEDUP.definition
    assert "one length mix" in text and "best fixed cp" in text and "repetitions" in text
    assert "worst over length mixes" not in text
