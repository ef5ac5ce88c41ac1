"""Input that used to be refused late (once the ranks ran) or with a library's own error, now refused before launch
with a message naming the value and the fix: generated data too small for a batch, a ``data=hf_dataset`` file
``datasets`` cannot parse, and a checkpoint damaged since it was written."""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path

import pytest
import torch

from lightning_merak.checkpoint.checkpoint_io import SafeCheckpointIO
from lightning_merak.checkpoint.resume import resume_path
from lightning_merak.checkpoint.safe_load import DamagedCheckpointError, load_torch_file
from lightning_merak.modules.config import DataConfig, DataError
from lightning_merak.modules.data import LanguageModelingData
from lightning_merak.modules.hf_data import HFDatasetData

from .test_train import refused


def _refusal(overrides: list[str], run_dir: Path, monkeypatch, capsys) -> str:
    """What merak-train's command line prints on stderr when it refuses ``overrides`` before launch (exit 2)."""
    code, output = refused(overrides, run_dir, monkeypatch, capsys)
    assert code == 2, output.out + output.err
    assert output.err.startswith("merak-train: error: ") and "Traceback" not in output.err, output.err
    return output.err


# Generated data too small for a batch ------------------------------------------------------------------------------


def test_fewer_synthetic_sequences_than_a_batch_are_refused_before_launch(tmp_path, monkeypatch, capsys):
    error = _refusal(["data.num_sequences=10", "data.batch_size=16"], tmp_path, monkeypatch, capsys)
    assert ("data=synthetic has data.num_sequences=10 training sequences: fewer than one batch of "
            "data.batch_size=16, so nothing would train; raise data.num_sequences or lower data.batch_size") in error


def test_a_ddp_rank_s_share_of_synthetic_sequences_is_checked_before_launch(tmp_path, monkeypatch, capsys):
    """20 sequences make a batch of 16 on one rank, but DDP's sampler gives each of the 2 ranks 10."""
    error = _refusal(["strategy=ddp", "data.num_sequences=20", "data.batch_size=16"], tmp_path, monkeypatch, capsys)
    assert ("data=synthetic has data.num_sequences=20 training sequences, 10 for each of 2 data-parallel ranks: fewer "
            "than one batch of data.batch_size=16 per rank, so nothing would train; raise data.num_sequences or lower "
            "data.batch_size; or train on fewer data-parallel ranks") in error


def test_variable_lengths_are_read_whole_by_every_rank() -> None:
    """Each rank reads every global batch of variable-length samples: the share is the whole set."""
    variable = LanguageModelingData(DataConfig(name="synthetic", num_sequences=20, batch_size=16, lengths="variable"))
    variable.check_before_launch(data_parallel=2)
    fixed = LanguageModelingData(DataConfig(name="synthetic", num_sequences=20, batch_size=16))
    fixed.check_before_launch(data_parallel=1)
    with pytest.raises(DataError, match="10 for each of 2 data-parallel ranks"):
        fixed.check_before_launch(data_parallel=2)


# hf_dataset files datasets cannot parse ----------------------------------------------------------------------------


def _documents(count: int) -> str:
    return "\n".join(json.dumps({"text": "y" * 40}) for _ in range(count))


def test_a_jsonl_line_that_is_not_json_names_the_file_and_line(tmp_path: Path, caplog) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_documents(5) + '\n{"text": broken}\n')
    with pytest.raises(DataError, match=re.escape(
            f"{corpus}:6 is not valid JSON (Expecting value at column 10); each line of a JSON-lines file must be one "
            'JSON object, such as {"text": "..."}')):
        HFDatasetData(str(corpus), seq_len=8, batch_size=2)
    assert not caplog.records, "datasets' own log line of the failure is dropped: the refusal says more"


def test_a_json_document_that_breaks_names_its_line(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.json"
    corpus.write_text('[\n  {"text": "a"},\n  {"text": \n]\n')
    with pytest.raises(DataError, match=re.escape(f"{corpus}:4 is not valid JSON (Expecting value at column 1)")):
        HFDatasetData(str(corpus), seq_len=8, batch_size=2)


def test_bytes_that_are_not_utf8_are_refused_where_the_ranks_read_them(tmp_path: Path) -> None:
    """datasets reads the bytes without a word and fails turning them into text, as setup reads every record."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(_documents(5).encode() + b'\n{"text": "caf\xe9"}\n')
    data = HFDatasetData(str(corpus), seq_len=8, batch_size=2)
    with pytest.raises(DataError, match=re.escape(f"{corpus}:6 is not UTF-8 text (byte 0xe9 at column 14: invalid "
                                                  "continuation byte); re-encode the file as UTF-8")):
        data.setup("fit")


def test_a_damaged_parquet_file_gives_the_library_s_reason_and_the_path(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.parquet"
    corpus.write_bytes(b"PAR1 not parquet")
    with pytest.raises(DataError, match=re.escape(f"data.path='{corpus}' cannot be read as parquet by datasets "
                                                  "(Parquet magic bytes not found in footer")):
        HFDatasetData(str(corpus), seq_len=8, batch_size=2)


def test_the_command_line_refuses_a_broken_hf_file_without_hydra_s_wrapper(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a"\n')
    error = _refusal(["data=hf_dataset", f"data.path={corpus}"], tmp_path / "run", monkeypatch, capsys)
    assert f"{corpus}:1 is not valid JSON (Expecting ',' delimiter at column 13)" in error, error
    assert "Failed to load JSON" not in error and "Error in call to target" not in error, error


# Checkpoints damaged since they were written -----------------------------------------------------------------------


def _checkpoint(path: Path) -> Path:
    torch.save({"state_dict": {"w": torch.arange(64, dtype=torch.float32)}, "global_step": 2}, path)
    return path


def _record(archive_path: Path, suffix: str) -> tuple[int, int]:
    """``(offset, size)`` of the record whose name ends with ``suffix`` (torch.save stores records uncompressed)."""
    raw = archive_path.read_bytes()
    with zipfile.ZipFile(archive_path) as archive:
        info = next(info for info in archive.infolist() if info.filename.endswith(suffix))
    header = raw[info.header_offset:info.header_offset + 30]
    start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    return start, info.file_size


def _flipped(path: Path, suffix: str) -> Path:
    """``path`` with a byte in the middle of its record ``suffix`` flipped, as a disk or a copy may damage it."""
    start, size = _record(path, suffix)
    raw = bytearray(path.read_bytes())
    raw[start + size // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    return path


def test_a_flipped_byte_in_the_pickle_is_named_by_its_checksum(tmp_path: Path) -> None:
    """Before, torch's unpickler failed with IndexError, EOFError, or a refusal as an unsafe checkpoint."""
    damaged = _flipped(_checkpoint(tmp_path / "step=2.ckpt"), "data.pkl")
    expected = re.escape(f"{damaged} is damaged: its record step=2/data.pkl fails its CRC-32 check; point at another "
                         "checkpoint (an earlier one of the same run), or start afresh without resume")
    for load in (lambda: load_torch_file(damaged, mmap=True), lambda: SafeCheckpointIO().load_checkpoint(damaged)):
        with pytest.raises(DamagedCheckpointError, match=expected):
            load()


def test_a_record_cut_short_is_refused_when_a_rank_loads_it(tmp_path: Path) -> None:
    """A zip whose directory is whole but whose tensor record is shorter than the tensor: the memory-mapped read
    before launch sees only shapes, a rank's load fails in torch's reader."""
    whole = _checkpoint(tmp_path / "whole.ckpt")
    buffer = io.BytesIO()
    with zipfile.ZipFile(whole) as source, zipfile.ZipFile(buffer, "w") as target:
        for name in source.namelist():
            content = source.read(name)
            target.writestr(name, content[:100] if name.endswith("data/0") else content)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(buffer.getvalue())
    with pytest.raises(DamagedCheckpointError, match=re.escape(
            f"{cut} cannot be read back (torch.load: RuntimeError: record size (100 bytes) does not match expected "
            "size (256 bytes")):
        SafeCheckpointIO().load_checkpoint(resume_path(str(cut), tmp_path))


def test_a_zip_directory_that_no_longer_reads_is_not_a_complete_checkpoint(tmp_path: Path) -> None:
    """A record's name in the zip directory damaged to bytes that are not UTF-8 (its UTF-8 flag set)."""
    path = _checkpoint(tmp_path / "step=2.ckpt")
    raw = bytearray(path.read_bytes())
    entry = raw.rindex(b"PK\x01\x02")  # the last record's entry in the central directory
    raw[entry + 9] |= 0x08  # general purpose flags, bit 11: the name is UTF-8
    raw[entry + 46] = 0xFF  # the name's first byte
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=re.escape(f"resume={path} is not a complete checkpoint")):
        resume_path(str(path), tmp_path)
    assert resume_path("auto", tmp_path) is None


def test_the_command_line_refuses_a_damaged_checkpoint_before_launch(tmp_path, monkeypatch, capsys):
    damaged = _flipped(_checkpoint(tmp_path / "damaged.ckpt"), "data.pkl")
    error = _refusal([f"resume={damaged}"], tmp_path / "run", monkeypatch, capsys)
    assert f"{damaged} is damaged: its record damaged/data.pkl fails its CRC-32 check" in error, error


def test_a_loader_resumed_with_other_data_parallel_shares_is_refused():
    """A checkpoint's trained-batch count means samples only at its data-parallel degree and batch size: at dp2 x 4
    two steps read 16 samples, so a pp2 run (one share of 4) skipping 2 batches would train 8 of them again."""
    from torch.utils.data import DistributedSampler

    from lightning_merak.modules.data import ResumableDataLoader

    samples = list(range(32))

    def loader(replicas: int, batch_size: int) -> ResumableDataLoader:
        sampler = DistributedSampler(samples, num_replicas=replicas, rank=0, shuffle=False) if replicas > 1 else None
        return ResumableDataLoader(samples, batch_size=batch_size, sampler=sampler, epoch=lambda: 0,
                                   trained_batches=lambda: 2, shuffle_seed=0)

    saved = loader(2, 4).state_dict()
    assert saved == {"pass": 0, "batches": 2, "replicas": 2, "batch_size": 4, "pass_length": 4,
                     "order": ["sequential"]}
    same = loader(2, 4)
    same.load_state_dict(saved)
    assert next(iter(same)).tolist() == [16, 18, 20, 22]  # rank 0's third batch: the two trained ones skipped
    for replicas, batch_size in ((1, 4), (2, 8)):
        with pytest.raises(DataError, match=re.escape(
                "the checkpoint's run read 2 data-parallel shares of 4 samples a step, this run reads "
                f"{replicas} of {batch_size}: skipping its 2 trained batches would skip other samples")):
            loader(replicas, batch_size).load_state_dict(saved)
    older = loader(1, 4)
    older.load_state_dict({"pass": 0, "batches": 2})  # a checkpoint from before the shares were saved
    assert next(iter(older)).tolist() == [8, 9, 10, 11]


def test_a_stream_resumed_with_other_data_parallel_shares_is_refused(tmp_path):
    """A streamed corpus is split by rank without a sampler: its loader's state records the stream's shares, so a
    resume at another data-parallel degree is refused as a sampler's is (it skipped another share's batch count)."""
    import json

    from lightning_merak.modules.hf_data import HFDatasetData

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"document {index} " + "word " * 40}) for index in range(16)))
    data = HFDatasetData(str(corpus), seq_len=16, batch_size=2, streaming=True)
    saved = data.resumable_loader(data.train_stream(0, 2)).state_dict()
    assert (saved["replicas"], saved["batch_size"]) == (2, 2)
    data.resumable_loader(data.train_stream(1, 2)).load_state_dict(saved)
    with pytest.raises(DataError, match=re.escape("the checkpoint's run read 2 data-parallel shares of 2 samples a "
                                                  "step, this run reads 1 of 2")):
        data.resumable_loader(data.train_stream(0, 1)).load_state_dict(saved)
