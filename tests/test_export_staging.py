"""How ``merak-export`` puts an export in place: ``--adapter-only`` through the same staging folder as the full export
(an interrupted adapter export leaves an earlier adapter whole), staging folders of exports killed outright removed
by the next export (never a live one's), and the order of the renames into an existing ``OUT``."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import peft
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from lightning_merak.cli.export import main as merak_export
from lightning_merak.hf.export import export_adapter, export_checkpoint
from tests.test_cli_open import _checkpoint, _tiny_llama
from tests.test_hf_export import LLAMA, _lightning_checkpoint, _stored

STAGING = ".merak-export-partial-"
NO_SUCH_PID = 2**31 - 1  # above any pid_max


def _files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones too) and its bytes."""
    return {str(file.relative_to(directory)): file.read_bytes() for file in sorted(directory.rglob("*"))
            if file.is_file()}


def _leftovers(*folders: Path) -> list[Path]:
    return [path for folder in folders if folder.is_dir() for path in folder.iterdir() if STAGING in path.name]


def _adapted_checkpoint(path: Path, seed: int, second: bool = True) -> Path:
    """A DDP .ckpt of a tiny Llama with LoRA factors drawn from ``seed``; with ``second``, a second adapter (PEFT
    writes it in a subfolder)."""
    adapted = get_peft_model(_tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    if second:
        adapted.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return _checkpoint(adapted, path)


def test_an_interrupted_adapter_export_leaves_the_earlier_adapter_whole(tmp_path, monkeypatch):
    out = tmp_path / "adapter"
    export_adapter(_adapted_checkpoint(tmp_path / "first.ckpt", 1), out)
    assert {"adapter_config.json", "adapter_model.safetensors", "second/adapter_model.safetensors"} <= set(_files(out))
    (out / "README.md").write_text("My adapter.\n")
    before = _files(out)
    newer = _adapted_checkpoint(tmp_path / "second.ckpt", 2)
    save_config = peft.PeftConfig.save_pretrained

    def killed(*args: object, **kwargs: object) -> None:  # after the weights of the first adapter are written
        raise KeyboardInterrupt

    monkeypatch.setattr(peft.PeftConfig, "save_pretrained", killed)
    for target in (out, tmp_path / "deeper" / "new"):
        with pytest.raises(KeyboardInterrupt):
            merak_export([str(newer), str(target), "--adapter-only"])
    assert _files(out) == before and not (tmp_path / "deeper").exists()
    assert not _leftovers(out, tmp_path)

    monkeypatch.setattr(peft.PeftConfig, "save_pretrained", save_config)
    merak_export([str(newer), str(out), "--adapter-only"])
    assert not _leftovers(out, tmp_path)
    assert "My adapter." in (out / "README.md").read_text()  # updated by PEFT, as it updates the card it finds
    reloaded = PeftModel.from_pretrained(_tiny_llama(), out)
    expected = torch.load(newer, weights_only=False)["state_dict"]
    loaded = reloaded.state_dict()
    for name, value in loaded.items():
        if "lora_" in name and ".default." in name:
            assert torch.equal(value, expected["model." + name]), name


def test_an_adapter_exported_beside_a_full_export_leaves_its_weights(tmp_path):
    """The adapter's files replace only their own names: a full export in the same folder keeps its shards and index."""
    checkpoint = _adapted_checkpoint(tmp_path / "adapted.ckpt", 1, second=False)
    out = tmp_path / "out"
    export_checkpoint(checkpoint, out, merge_adapters=True, max_shard_size="30KB")
    full = _files(out)
    assert "model.safetensors.index.json" in full
    export_adapter(checkpoint, out)
    export_adapter(checkpoint, out)  # over its own files too
    after = _files(out)
    assert {name: after[name] for name in full} == full and "adapter_model.safetensors" in after


def _tag(pid: int, boot: str | None = None, host: str | None = None) -> str:
    """A staging folder's writer tag, as the export writes it for this host unless told otherwise."""
    from lightning_merak.hf.export import _boot_id, _writer_tag

    here_host = _writer_tag().rsplit("-", 2)[0]
    return f"{host or here_host}-{boot or _boot_id()}-{pid}"


def test_the_next_export_removes_staging_folders_of_killed_exports_only(tmp_path, caplog):
    torch.manual_seed(0)
    checkpoint = _lightning_checkpoint(AutoModelForCausalLM.from_config(LLAMA), tmp_path / "final.ckpt")
    out = tmp_path / "out"
    export_checkpoint(checkpoint, out)
    dead = [out / f"{STAGING}{_tag(NO_SUCH_PID)}-0badc0de",  # its process gone
            tmp_path / f".out{STAGING}{_tag(NO_SUCH_PID)}-0badc0de",  # beside a new OUT
            tmp_path / f".other{STAGING}{_tag(NO_SUCH_PID)}-1badc0de",  # beside another OUT in the same parent
            out / f"{STAGING}{_tag(os.getpid(), boot='1234abcd5678')}-2badc0de"]  # written before a reboot
    live = [out / f"{STAGING}{_tag(os.getpid())}-3badc0de",  # a concurrent export on this host
            out / f"{STAGING}{_tag(NO_SUCH_PID, host='not-' + socket.gethostname())}-4badc0de",  # another host's
            out / f"{STAGING}5badc0de"]  # no writer recorded: cannot tell
    for folder in (*dead, *live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    with caplog.at_level("INFO", logger="lightning_merak.hf.export"):
        export_checkpoint(checkpoint, out)
    assert [folder for folder in dead if folder.exists()] == []
    assert all(folder.exists() for folder in live)
    lines = [record.message for record in caplog.records if "left by exports killed" in record.message]
    assert len(lines) == 1 and lines[0].startswith("merak-export: removed 4 folder(s)"), lines
    assert all(str(folder) in lines[0] for folder in dead)


def test_a_refused_export_removes_nothing(tmp_path):
    """Cleaning up is part of writing: an export refused before it writes leaves the disk as it was."""
    stale = tmp_path / "out" / f"{STAGING}{_tag(NO_SUCH_PID)}-0badc0de"
    stale.mkdir(parents=True)
    with pytest.raises(ValueError, match="does not exist"):
        export_checkpoint(tmp_path / "missing.ckpt", tmp_path / "out")
    assert stale.exists()


def test_weights_replace_an_earlier_export_before_their_index_and_the_config_last(tmp_path, monkeypatch):
    """Re-exported with the same shard names: the earlier index goes first (so no index ever names a mix of old and
    new shards), the new shards, then the new index, the config last."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LLAMA)
    out = tmp_path / "out"
    export_checkpoint(_lightning_checkpoint(model, tmp_path / "old.ckpt"), out, max_shard_size="30KB")
    shards = sorted(path.name for path in out.glob("model-*.safetensors"))
    assert len(shards) > 1
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    newer = _lightning_checkpoint(model, tmp_path / "new.ckpt")
    moves: list[tuple[str, bool]] = []  # each file moved into OUT, and whether an index was there as it moved
    replace = os.replace

    def recorded(source: object, target: object) -> None:
        if Path(target).parent == out:
            moves.append((Path(target).name, (out / "model.safetensors.index.json").exists()))
        replace(source, target)

    monkeypatch.setattr(os, "replace", recorded)
    export_checkpoint(newer, out, max_shard_size="30KB")
    assert [name for name, _ in moves] == [*shards, "model.safetensors.index.json", "config.json"]
    assert not any(index_there for name, index_there in moves if name in shards)
    stored = _stored(out)
    assert all(torch.equal(stored[key], value) for key, value in _stored_reference(model).items())

    moves.clear()
    calls = iter(range(1000))

    def killed_after_the_first_shard(source: object, target: object) -> None:
        if Path(target).parent == out and next(calls) == 1:
            raise KeyboardInterrupt
        replace(source, target)

    monkeypatch.setattr(os, "replace", killed_after_the_first_shard)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(_lightning_checkpoint(model, tmp_path / "new.ckpt"), out, max_shard_size="30KB")
    assert not (out / "model.safetensors.index.json").exists()  # a reader fails to load rather than mixing sets


def _stored_reference(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights as ``save_pretrained`` writes them (tied copies left out)."""
    return {key: value for key, value in model.state_dict().items() if key != "lm_head.weight"}
