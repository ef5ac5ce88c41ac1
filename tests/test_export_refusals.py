"""``merak-export`` refuses a user's mistake as ``merak-train`` does: ``merak-export: error: <the fix>`` on stderr, no
traceback, status 2, the arguments checked before the checkpoint is read (single process, in this interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_merak.cli.export import main as merak_export
from lightning_merak.hf.export import export_checkpoint
from tests.test_hf_export import LLAMA, _lightning_checkpoint, _stored


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DDP run's .ckpt of a tiny Llama, with its model record and no adapters."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LLAMA)
    return _lightning_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "final.ckpt")


def _refusal(capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    """Run merak-export, expect status 2, return its one-line reason."""
    with pytest.raises(SystemExit) as ended:
        merak_export([str(arg) for arg in argv])
    assert ended.value.code == 2
    error = capsys.readouterr().err
    assert "merak-export: error: " in error and "Traceback" not in error
    return error


def test_missing_or_empty_checkpoint_is_refused_naming_what_to_pass(tmp_path, capsys):
    assert "does not exist; pass a checkpoint: merak-train writes" in _refusal(capsys, tmp_path / "nope.ckpt",
                                                                                 tmp_path / "out")
    (tmp_path / "empty").mkdir()
    error = _refusal(capsys, tmp_path / "empty", tmp_path / "out")
    assert "is a directory without lightning.ckpt" in error and "merak-train writes" in error
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "final.ckpt").touch()
    error = _refusal(capsys, tmp_path / "checkpoints", tmp_path / "out")  # the folder above the checkpoint
    assert "it holds the checkpoints ['final.ckpt']: pass one of them" in error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [b"", b"not a checkpoint\n", "truncated"])
def test_unreadable_checkpoint_file_is_refused_with_its_size(tmp_path, capsys, plain_checkpoint, content):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(plain_checkpoint.read_bytes()[:4096] if content == "truncated" else content)
    error = _refusal(capsys, bad, tmp_path / "out")
    assert f"{bad} ({bad.stat().st_size} bytes) is not a readable checkpoint" in error
    assert "merak-train writes valid ones" in error and "mmap" not in error


def test_checkpoint_that_is_no_lightning_dict_or_unfinished_directory_is_refused(tmp_path, capsys):
    torch.save([1, 2], tmp_path / "list.ckpt")
    assert "holds a list, not a Lightning checkpoint dict" in _refusal(capsys, tmp_path / "list.ckpt", tmp_path / "o")
    (tmp_path / "sharded").mkdir()
    torch.save({}, tmp_path / "sharded" / "lightning.ckpt")  # a merak3d directory whose save stopped early
    assert "no .metadata index" in _refusal(capsys, tmp_path / "sharded", tmp_path / "o")


@pytest.mark.parametrize("adapter_only", [False, True])
def test_output_that_is_a_file_is_refused_before_the_checkpoint_is_read(tmp_path, capsys, adapter_only):
    (tmp_path / "taken").write_text("x")
    for out in (tmp_path / "taken", tmp_path / "taken" / "below"):
        argv = [tmp_path / "missing.ckpt", out, *(["--adapter-only"] if adapter_only else [])]
        error = _refusal(capsys, *argv)  # the output is named, not the missing checkpoint: checked first
        assert f"{tmp_path / 'taken'} is an existing file; pass a new or existing directory" in error


def test_unknown_dtype_is_refused_listing_the_supported_ones(tmp_path, capsys):
    error = _refusal(capsys, tmp_path / "missing.ckpt", tmp_path / "out", "--dtype", "bogus")
    assert "invalid choice: 'bogus'" in error and "bfloat16" in error and "float32" in error
    with pytest.raises(ValueError, match="dtype 'bogus' is not one export writes; pass one of bfloat16, float16"):
        export_checkpoint(tmp_path / "missing.ckpt", tmp_path / "out", dtype="bogus")


@pytest.mark.parametrize("size", ["banana", "1.5GB", "0", "-1GB", ""])
def test_unreadable_shard_size_is_refused_naming_the_accepted_forms(tmp_path, capsys, size):
    error = _refusal(capsys, tmp_path / "missing.ckpt", tmp_path / "out", f"--max-shard-size={size}")
    assert f"max shard size {size!r} is not a size" in error and "5GB, 500MB" in error and "2GiB" in error


def test_shard_size_in_bytes_is_accepted(tmp_path, capsys, plain_checkpoint):
    merak_export([str(plain_checkpoint), str(tmp_path / "out"), "--max-shard-size", "30000"])
    index = tmp_path / "out" / "model.safetensors.index.json"
    assert index.is_file() and len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    assert "merak-export: wrote" in capsys.readouterr().out


def test_missing_config_is_refused_before_the_checkpoint_is_read(tmp_path, capsys):
    error = _refusal(capsys, tmp_path / "missing.ckpt", tmp_path / "out", "--config", tmp_path / "no_model")
    assert f"config {tmp_path / 'no_model'} is neither a config.json file nor a directory holding one" in error


def test_merge_adapters_without_adapters_is_refused(tmp_path, capsys, plain_checkpoint):
    error = _refusal(capsys, plain_checkpoint, tmp_path / "out", "--merge-adapters")
    assert "holds no adapters" in error and "drop --merge-adapters" in error
    assert not list((tmp_path / "out").glob("*.safetensors"))
    merak_export([str(plain_checkpoint), str(tmp_path / "out")])  # without the flag: the weights as they are
    assert sorted(_stored(tmp_path / "out")) == sorted(AutoModelForCausalLM.from_config(LLAMA).state_dict().keys()
                                                       - {"lm_head.weight"})


def test_adapter_only_refuses_a_shard_size_it_would_ignore(tmp_path, capsys):
    error = _refusal(capsys, tmp_path / "missing.ckpt", tmp_path / "out", "--adapter-only", "--max-shard-size", "1GB")
    assert "drop --config, --dtype and --max-shard-size" in error


def test_only_refusals_end_quietly(tmp_path, monkeypatch, capsys):
    """A refused value ends with status 2 and its reason; an error of the program itself keeps its traceback."""
    import lightning_merak.cli.export as export_module

    def failing(error: Exception):
        def export(*args: object, **kwargs: object) -> None:
            raise error
        return export

    monkeypatch.setattr(export_module, "export_checkpoint", failing(ValueError("x=1 is refused; pass x=2")))
    assert "merak-export: error: x=1 is refused; pass x=2" in _refusal(capsys, tmp_path / "a.ckpt", tmp_path / "out")
    monkeypatch.setattr(export_module, "export_checkpoint", failing(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        merak_export([str(tmp_path / "a.ckpt"), str(tmp_path / "out")])


def test_exporting_again_into_a_folder_replaces_the_earlier_weights(tmp_path, plain_checkpoint):
    """A sharded export over a single-file one (and back) leaves only the new weight files: a stale
    model.safetensors beside a new index would be what from_pretrained loads."""
    out = tmp_path / "out"
    export_checkpoint(plain_checkpoint, out)
    assert (out / "model.safetensors").is_file()
    sharded = export_checkpoint(plain_checkpoint, out, max_shard_size=20_000)
    weights = sorted(path.name for path in out.glob("model*.safetensors*"))
    assert weights == sorted(name for name in sharded.files if name.startswith("model")) and len(weights) > 2
    export_checkpoint(plain_checkpoint, out)
    assert sorted(path.name for path in out.glob("model*.safetensors*")) == ["model.safetensors"]
