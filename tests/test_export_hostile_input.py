"""``merak-export`` under hostile input: a config that would change the recorded model, a checkpoint whose data files
are missing, cut short or damaged, an export interrupted part way, an output the user cannot write to, and a
LightningModule that holds its model under another attribute. Each is refused before ``OUT`` is touched (or, found
while reading, leaves an earlier export in ``OUT`` as it was), with ``merak-export: error: <the fix>``."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from lightning_merak.checkpoint.names import MODEL_RECORD_KEY, model_record
from lightning_merak.checkpoint.safe_load import SafeFileSystemReader
from lightning_merak.checkpoint.sharded import LIGHTNING_CHECKPOINT
from lightning_merak.cli.export import main as merak_export
from lightning_merak.hf.export import export_checkpoint
from lightning_merak.modules.causal_lm import CausalLMModule
from tests.test_export_refusals import _refusal
from tests.test_hf_export import LLAMA, VOCAB, _lightning_checkpoint, _stored

STAGING = ".merak-export-partial-"


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LLAMA).eval()


@pytest.fixture(scope="module")
def recorded(model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DDP run's .ckpt of a tiny Llama with its model record."""
    return _lightning_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "final.ckpt")


def _config_dir(path: Path, **changes: object) -> Path:
    """The tiny Llama's config.json with ``changes``."""
    path.mkdir()
    values = json.loads(LLAMA.to_json_string(use_diff=False))
    (path / "config.json").write_text(json.dumps({**values, **changes}))
    return path


def _files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones too) and its bytes."""
    return {str(file.relative_to(directory)): file.read_bytes() for file in sorted(directory.rglob("*"))
            if file.is_file()}


def _sharded(model: torch.nn.Module, path: Path) -> Path:
    """A merak3d checkpoint directory of ``model`` in two data files, as merak3d's save lays it out."""
    dcp.save({"model": CausalLMModule(model).state_dict()}, no_dist=True,
             storage_writer=dcp.FileSystemWriter(str(path), thread_count=2))
    torch.save({MODEL_RECORD_KEY: model_record(model)}, path / LIGHTNING_CHECKPOINT)
    assert len(list(path.glob("*.distcp"))) == 2
    return path


# 1. --config beside a recorded config ------------------------------------------------------------------------------

def _rope_change() -> dict[str, object]:
    values = json.loads(LLAMA.to_json_string(use_diff=False))
    if "rope_parameters" in values:
        return {"rope_parameters": {**values["rope_parameters"], "rope_theta": 10.0}}
    return {"rope_theta": 10.0}


@pytest.mark.parametrize("changes, named", [
    ({"vocab_size": 64}, ["vocab_size is 96 there and 64 in --config"]),
    ({**_rope_change(), "rms_norm_eps": 0.5, "hidden_act": "gelu"},
     ["rms_norm_eps is 1e-06 there and 0.5 in --config", "hidden_act is 'silu' there and 'gelu' in --config", "rope"]),
])
def test_a_config_that_changes_the_recorded_model_is_refused(tmp_path, capsys, recorded, changes, named):
    error = _refusal(capsys, recorded, tmp_path / "out", "--config", _config_dir(tmp_path / "config", **changes))
    assert "differs from the config" in error and "drop --config" in error
    assert all(part in error for part in named), error
    assert not (tmp_path / "out").exists()


def test_a_config_that_does_not_change_the_model_exports_the_recorded_one(tmp_path, recorded, model, caplog):
    export_checkpoint(recorded, tmp_path / "plain")
    export_checkpoint(recorded, tmp_path / "same", config=_config_dir(tmp_path / "same_config"))
    with caplog.at_level("WARNING"):
        export_checkpoint(recorded, tmp_path / "eos", config=_config_dir(tmp_path / "eos_config", eos_token_id=7))
    assert "eos_token_id is 2 there and 7 in --config" in caplog.text and "recorded config is written" in caplog.text
    plain = _stored(tmp_path / "plain")
    for out in ("same", "eos"):
        stored = _stored(tmp_path / out)
        assert stored.keys() == plain.keys() and all(torch.equal(stored[key], plain[key]) for key in plain)
        assert json.loads((tmp_path / out / "config.json").read_text()) == json.loads(
            (tmp_path / "plain" / "config.json").read_text())


def test_extra_vocabulary_rows_are_refused_not_cut(tmp_path, capsys, model):
    """Without a record, a --config of a smaller vocabulary gives the tensors other shapes: refused, rows not cut."""
    unrecorded = _lightning_checkpoint(model, tmp_path / "old.ckpt", record=False)
    error = _refusal(capsys, unrecorded, tmp_path / "out", "--config", _config_dir(tmp_path / "v64", vocab_size=64))
    assert f"has shape ({VOCAB}, 32)" in error and "expects (64, 32) by the --config given" in error
    assert not (tmp_path / "out").exists()


# 2, 3. A checkpoint whose data files are missing, cut short or damaged; an interrupted export ----------------------

@pytest.fixture()
def earlier_export(tmp_path: Path, model: torch.nn.Module) -> tuple[Path, Path, dict[str, bytes]]:
    """A merak3d checkpoint, and ``OUT`` holding a good sharded export of it (with a file of the user's own)."""
    checkpoint = _sharded(model, tmp_path / "final.ckpt")
    out = tmp_path / "out"
    export_checkpoint(checkpoint, out, max_shard_size="30KB")
    (out / "README.md").write_text("mine\n")
    return checkpoint, out, _files(out)


def _copy(checkpoint: Path, path: Path) -> tuple[Path, list[Path]]:
    shutil.copytree(checkpoint, path)
    return path, sorted(path.glob("*.distcp"))


def _no_leftovers(out: Path) -> None:
    assert not [path for path in (*out.parent.iterdir(), *out.iterdir()) if STAGING in path.name]


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_or_truncated_data_files_are_refused_before_the_output_is_touched(tmp_path, capsys, earlier_export,
                                                                                   damage):
    checkpoint, out, before = earlier_export
    copy, data_files = _copy(checkpoint, tmp_path / "damaged")
    if damage == "missing":
        data_files[1].unlink()
    else:
        os.truncate(data_files[1], 100)
    expected = f"{data_files[1]} is " + ("missing" if damage == "missing" else "truncated or damaged (100 bytes")
    for target in (out, tmp_path / "new"):
        error = _refusal(capsys, copy, target, "--max-shard-size", "30KB")
        assert expected in error and "the checkpoint is incomplete" in error, error
    assert _files(out) == before and not (tmp_path / "new").exists()
    _no_leftovers(out)


def test_a_data_file_damaged_inside_is_refused_naming_it_and_the_earlier_export_kept(tmp_path, capsys,
                                                                                     earlier_export):
    """Of the whole size, but a record's bytes overwritten: found only when read, part way through the export."""
    checkpoint, out, before = earlier_export
    copy, _ = _copy(checkpoint, tmp_path / "damaged")
    storage = SafeFileSystemReader(str(copy)).read_metadata().storage_data
    last = max(storage.values(), key=lambda stored: (stored.relative_path, stored.offset))
    with open(copy / last.relative_path, "r+b") as file:  # the record read last: earlier shards are written first
        file.seek(last.offset)
        file.write(b"\0" * min(64, last.length))
    for target in (out, tmp_path / "new"):
        error = _refusal(capsys, copy, target, "--max-shard-size", "30KB")
        assert f"{copy / last.relative_path} cannot be read back" in error and "truncated or damaged" in error, error
    assert _files(out) == before and not (tmp_path / "new").exists()
    _no_leftovers(out)


def test_an_interrupted_export_leaves_the_earlier_one_whole(tmp_path, monkeypatch, earlier_export, model):
    import safetensors.torch

    checkpoint, out, before = earlier_export
    written = []
    save_file = safetensors.torch.save_file

    def interrupted(*args: object, **kwargs: object) -> None:
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(args[1])
        save_file(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    for target in (out, tmp_path / "deeper" / "new"):
        written.clear()
        with pytest.raises(KeyboardInterrupt):
            merak_export([str(checkpoint), str(target), "--max-shard-size", "20KB"])
        assert len(written) == 2
    assert _files(out) == before and not (tmp_path / "deeper").exists()
    _no_leftovers(out)
    monkeypatch.undo()
    merak_export([str(checkpoint), str(out)])  # completed: replaces the earlier weights, keeps the user's file
    assert sorted(path.name for path in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


# 4. An output the user cannot write to ---------------------------------------------------------------------------

@pytest.mark.distributed  # starts an interpreter, as a user without root's override of file permissions
@pytest.mark.timeout(120)
def test_an_output_the_user_cannot_write_to_is_refused_before_the_checkpoint_is_read(tmp_path):
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: file permissions do not apply")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    code = ("import sys\nfrom lightning_merak.cli.export import main\n"
            "for out in sys.argv[2:]:\n"
            "    try:\n        main([sys.argv[1], out])\n    except SystemExit as ended:\n"
            "        print('status', ended.code, file=sys.stderr, flush=True)\n")
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"] if os.geteuid() == 0 else []
    try:
        result = subprocess.run([*drop, sys.executable, "-c", code, str(tmp_path / "missing.ckpt"), str(locked),
                                 str(locked / "new")], capture_output=True, text=True, timeout=110,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    finally:
        locked.chmod(stat.S_IRWXU)
    assert "Traceback" not in result.stderr, result.stderr
    for out in (locked, locked / "new"):  # the output is named, not the missing checkpoint: checked first
        assert (f"merak-export: error: output directory {out}: cannot write in {locked} (Permission denied); "
                "pass a directory you can write to") in result.stderr, result.stderr
    assert result.stderr.count("status 2") == 2 and list(locked.iterdir()) == []


# 5. A LightningModule holding its model under another attribute --------------------------------------------------

@pytest.mark.parametrize("merge", [False, True])
def test_a_model_under_another_attribute_is_refused_naming_where_it_must_sit(tmp_path, capsys, model, merge):
    checkpoint = tmp_path / "net.ckpt"
    torch.save({"state_dict": {f"net.{key}": value for key, value in model.state_dict().items()}}, checkpoint)
    config = tmp_path / "config"
    LLAMA.save_pretrained(config)
    error = _refusal(capsys, checkpoint, tmp_path / "out", "--config", config, *(["--merge-adapters"] if merge else []))
    assert "holds tensors LlamaForCausalLM does not have: net." in error
    assert "must sit under `model.`" in error and "adapter" not in error
    assert not (tmp_path / "out").exists()
