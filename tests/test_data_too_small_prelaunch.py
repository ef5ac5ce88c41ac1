"""A corpus shorter than two blocks of ``data.seq_len`` is refused before the ranks start, once, with a bounded
read of the corpus (not a count of all of it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_merak.modules.config import DataError
from lightning_merak.modules.hf_data import HFDatasetData


def _empty_texts(folder: Path, records: int) -> Path:
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps({"text": ""}) + "\n" for _ in range(records)))
    return path


def test_short_corpus_refused_in_the_constructor(tmp_path: Path) -> None:
    path = _empty_texts(tmp_path, 20)  # 20 end-of-text ids
    with pytest.raises(DataError, match=r"yields 20 tokens, fewer than two blocks of data.seq_len=32"):
        HFDatasetData(str(path), seq_len=32)
    assert HFDatasetData(str(path), seq_len=8).seq_len == 8


@pytest.mark.distributed
def test_cli_refuses_short_corpus_before_launch(tmp_path: Path) -> None:
    path = _empty_texts(tmp_path, 20)
    command = [sys.executable, "-m", "lightning_merak.cli.train", f"hydra.run.dir={tmp_path / 'run'}",
               "data=hf_dataset", f"data.path={path}", "data.seq_len=32", "trainer.max_steps=2"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 2, output
    assert output.count("fewer than two blocks of data.seq_len=32") == 1, output
    assert "Initializing distributed" not in output, output
