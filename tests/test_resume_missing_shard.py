"""Resuming a merak3d checkpoint directory that lacks a shard file: ``resume=<it>`` is refused naming the missing
shard and the newest complete checkpoint beside it (never resumed from the directory's own ``lightning.ckpt``), and
``resume=auto`` goes back to the newest complete one, naming the one it skipped and why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_merak.checkpoint.files import why_incomplete
from lightning_merak.checkpoint.resume import resume_path
from tests.test_final_checkpoint_nodes import _sharded_checkpoint
from tests.test_late_refusals import _refusal

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "lightning_merak.checkpoint.resume"]


@pytest.fixture()
def checkpoints(tmp_path: Path) -> tuple[Path, Path, str]:
    """A run's checkpoints: a complete ``step=2.ckpt`` and a newer ``step=4.ckpt`` whose first shard is gone."""
    older = _sharded_checkpoint(tmp_path / "step=2.ckpt", 1000)
    newer = _sharded_checkpoint(tmp_path / "step=4.ckpt", 2000)
    shard = sorted(path.name for path in newer.glob("*.distcp"))[0]
    (newer / shard).unlink()
    return older, newer, shard


def test_a_directory_missing_a_shard_is_refused_naming_it_and_the_checkpoint_to_resume(checkpoints):
    older, newer, shard = checkpoints
    with pytest.raises(ValueError) as refused:
        resume_path(str(newer), newer.parent)
    assert str(refused.value) == (f"resume={newer} is not a complete checkpoint: it lacks shard files its index "
                                  f"lists: {shard} (missing); resume from the newest complete checkpoint beside it: "
                                  f"resume={older}")


def test_without_a_complete_checkpoint_beside_it_the_refusal_says_so(checkpoints):
    older, newer, shard = checkpoints
    whole = (older / shard).read_bytes()
    (older / shard).write_bytes(whole[:10])
    assert why_incomplete(older) == f"it lacks shard files its index lists: {shard} (10 of its {len(whole)} bytes)"
    with pytest.raises(ValueError, match=re.escape(f"{shard} (missing); no complete checkpoint is beside it: pass "
                                                   "another one, or resume=auto to start afresh")):
        resume_path(str(newer), newer.parent)


@pytest.mark.parametrize("resume", ["auto", "directory"])
def test_auto_skips_the_incomplete_newest_for_the_newest_complete_saying_which_and_why(checkpoints, caplog, resume):
    older, newer, shard = checkpoints
    with caplog.at_level("WARNING", logger="lightning_merak.checkpoint.resume"):
        chosen = resume_path("auto" if resume == "auto" else str(newer.parent), newer.parent)
    assert chosen == older
    shown = "auto" if resume == "auto" else str(newer.parent)
    assert _warnings(caplog) == [f"resume={shown}: skipped incomplete checkpoints ({newer}: it lacks shard files its "
                               f"index lists: {shard} (missing)); resuming from {older}"]


def test_a_complete_newest_is_chosen_without_a_warning(tmp_path, caplog):
    _sharded_checkpoint(tmp_path / "step=2.ckpt", 1000)
    newer = _sharded_checkpoint(tmp_path / "step=4.ckpt", 2000)
    with caplog.at_level("WARNING", logger="lightning_merak.checkpoint.resume"):
        assert resume_path("auto", tmp_path) == newer == resume_path(str(newer), tmp_path)
    assert _warnings(caplog) == []


def test_merak_train_refuses_it_before_launch(checkpoints, tmp_path, monkeypatch, capsys):
    older, newer, shard = checkpoints
    error = _refusal([f"resume={newer}"], tmp_path / "run", monkeypatch, capsys)
    assert f"{shard} (missing)" in error and f"resume={older}" in error, error
