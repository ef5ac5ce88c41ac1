"""``merak-train strategy=merak3d comm=embrace`` builds the model eagerly: EmbRace shards tables that exist.

On meta (merak3d's default for the built-in module) the tables would reach EmbRace unmaterialised, and the run was
refused where it could train.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import lightning_merak.cli.train as merak_train
from lightning_merak.cli.config import register_configs

from .test_refusals_where_first_known import TINY


def _prepared(overrides: list[str], run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> merak_train.PreparedRun:
    prepared: list[merak_train.PreparedRun] = []
    monkeypatch.setattr(merak_train, "fit", lambda run, prelaunched=None: prepared.append(run))
    monkeypatch.setattr(merak_train, "prelaunch_local_ranks", lambda devices, num_nodes: None)
    monkeypatch.setattr("sys.argv", ["merak-train", *TINY, *overrides, "trainer.devices=1",
                                     f"hydra.run.dir={run_dir}"])
    register_configs()
    merak_train.run_command_line()
    (run,) = prepared
    return run


@pytest.mark.parametrize(("comm", "on_meta"), [("comm=embrace", False), ("comm=none", True)])
def test_merak3d_builds_the_model_eagerly_for_embrace_only(comm: str, on_meta: bool, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    run = _prepared(["strategy=merak3d", comm, "comm.min_table_rows=64"] if comm != "comm=none"
                    else ["strategy=merak3d"], tmp_path, monkeypatch)
    embedding = run.module.model.get_input_embeddings().weight
    assert embedding.is_meta is on_meta
