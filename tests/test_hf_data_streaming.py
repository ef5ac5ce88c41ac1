"""``HFDatasetData``'s stream and columns: each DataLoader worker reads its own share of a rank's documents (once, not
once per worker) and resumes only at the checkpoint's worker count; Trainer loops a stream would train wrongly with
are refused before launch and in ``setup``; a text column of the wrong type, token ids outside the vocabulary and a
csv's empty cell (the empty text, as in the other formats)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import datasets
import lightning.pytorch as pl
import pyarrow as pa
import pyarrow.parquet
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_merak.cli.checks import check_streaming_loop
from lightning_merak.cli.overrides import ConfigError
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import DataError, TrainerConfig
from lightning_merak.modules.hf_data import HFDatasetData, held_out

from .test_hf_data import MODEL, _batches, _documents, _one_block_documents, _text_reference, _texts, _write

# Loader workers ---------------------------------------------------------------------------------------------------


def _worker_shares(data: HFDatasetData, rank: int, world_size: int, workers: int, monkeypatch) -> list[list[str]]:
    """The documents each of ``workers`` loader workers of rank ``rank`` reads in one pass, read in this process."""
    shares = []
    for worker in range(workers):
        monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda worker=worker: SimpleNamespace(
            id=worker, num_workers=workers))
        shares.append(_texts(data.train_stream(rank, world_size, endless=False)))
    return shares


@pytest.mark.parametrize(("layout", "world_size", "workers"), [("save_to_disk", 2, 2), ("save_to_disk", 2, 3),
                                                               ("parquet_folder", 1, 2), ("parquet_folder", 2, 2)])
def test_each_loader_worker_streams_its_own_part_of_the_rank_s_documents(tmp_path: Path, monkeypatch, layout: str,
                                                                       world_size: int, workers: int) -> None:
    texts = _one_block_documents(60, seq_len=12)
    data = HFDatasetData(str(_write(tmp_path, layout, texts)), seq_len=12, batch_size=2, val_fraction=0.2,
                         streaming=True, shuffle_buffer=8, seed=7)
    shares = [share for rank in range(world_size) for share in _worker_shares(data, rank, world_size, workers,
                                                                               monkeypatch)]
    read = [text for share in shares for text in share]
    assert all(shares) and len(read) == len(set(read)), "every worker reads documents, none read twice"
    assert sorted(read) == sorted(text for text in texts if not held_out(text, 7, 0.2))


@pytest.mark.distributed
def test_a_two_worker_loader_reads_each_document_once_and_resumes(tmp_path: Path) -> None:
    """Real loader workers (processes): one pass reads the training documents once; a restored loader continues."""
    texts = _one_block_documents(60, seq_len=12)
    data = HFDatasetData(str(_write(tmp_path, "save_to_disk", texts)), seq_len=12, batch_size=2, val_fraction=0.2,
                         streaming=True, shuffle_buffer=8, seed=7, num_workers=2)
    one_pass = DataLoader(data.train_stream(0, 1, endless=False), batch_size=2, num_workers=2)
    read = [bytes(block[:-1].tolist()).decode() for (batch,) in one_pass for block in batch]
    assert sorted(read) == sorted(text for text in texts if not held_out(text, 7, 0.2))
    straight_loader = data.train_dataloader()
    assert straight_loader.num_workers == 2
    straight = _batches(straight_loader, 30)
    restored = data.train_dataloader()
    restored.load_state_dict({**straight_loader.state_dict(), "pass": 0, "batches": 11})
    assert all(torch.equal(a, b) for a, b in zip(_batches(restored, 19), straight[11:]))


def test_a_stream_resumes_mid_pass_only_at_the_checkpoint_s_worker_count(tmp_path: Path) -> None:
    corpus = str(_write(tmp_path, "save_to_disk", _documents(96)))
    loaders = {workers: HFDatasetData(corpus, seq_len=16, batch_size=2, streaming=True, num_workers=workers)
               .train_dataloader() for workers in (0, 1, 2)}
    state = {**loaders[2].state_dict(), "batches": 5}
    assert state["readers"] == 2 and loaders[0].state_dict()["readers"] == loaders[1].state_dict()["readers"] == 1
    with pytest.raises(DataError, match=re.escape("the checkpoint's run read each rank's stream in 2 loader worker "
                                                  "share(s), this run reads it in 1 (data.num_workers")):
        loaders[0].load_state_dict(state)
    loaders[2].load_state_dict(state)
    loaders[1].load_state_dict({**loaders[0].state_dict(), "batches": 5})  # one worker reads as the process does
    loaders[0].load_state_dict({key: value for key, value in state.items() if key != "readers"})  # older checkpoint


# Trainer loops a stream would train wrongly with --------------------------------------------------------------------


def _streaming_run(streaming: bool = True, target: str = "lightning_merak.modules.hf_data.HFDatasetData",
                   **trainer: Any) -> SimpleNamespace:
    return SimpleNamespace(trainer=TrainerConfig(**trainer), data={"_target_": target, "streaming": streaming})


@pytest.mark.parametrize(("trainer", "message"), [
    ({"val_check_interval": None}, "val_check_interval=null (trainer.val_check_interval) validates when an epoch ends, "
                                   "and a stream's epoch never ends"),
    ({"kwargs": {"limit_train_batches": 5}}, "limit_train_batches=5 (trainer.limit_train_batches): each epoch would "
                                             "restart the stream at the head of a freshly shuffled pass"),
    ({"max_steps": -1, "max_epochs": 2}, "so an epoch never ends: set the Trainer's max_steps (trainer.max_steps)"),
])
def test_a_stream_s_loop_settings_are_refused_before_launch(trainer: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_streaming_loop(_streaming_run(**trainer))
    for allowed in (_streaming_run(False, **trainer), _streaming_run(target="my.Data", **trainer)):
        check_streaming_loop(allowed)
    for allowed in (_streaming_run(val_check_interval=None, limit_val_batches=0),
                    _streaming_run(kwargs={"limit_train_batches": 1.0}),
                    _streaming_run(val_check_interval=None, kwargs={"fast_dev_run": 2})):
        check_streaming_loop(allowed)


@pytest.mark.parametrize(("trainer", "message"), [
    ({"limit_train_batches": 2, "limit_val_batches": 0}, "limit_train_batches=2 .*bound the run by max_steps"),
    ({"limit_val_batches": 2}, r"val_check_interval=1.0 .*set val_check_interval to an integer number of steps"),
])
def test_a_stream_s_loop_settings_are_refused_in_setup(tmp_path: Path, trainer: dict[str, Any], message: str) -> None:
    data = HFDatasetData(str(_write(tmp_path, "parquet", _documents())), seq_len=16, batch_size=2, streaming=True)
    fit = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **trainer)
    with pytest.raises(ValueError, match=message):
        fit.fit(CausalLMModule(build_causal_lm(MODEL, data.vocab_size)), datamodule=data)


# The text column ----------------------------------------------------------------------------------------------------


def test_a_text_column_of_another_type_is_refused_naming_it(tmp_path: Path) -> None:
    rows = 40
    parquet = tmp_path / "chat.parquet"
    pyarrow.parquet.write_table(pa.table({
        "messages": [[{"role": "user", "content": f"hi {i}"}] for i in range(rows)],
        "sentences": [["a b c", "d e f"]] * rows, "number": list(range(rows)), "floats": [[1.0, 4.5]] * rows,
        "ids": [[1, 2, 3]] * rows,
        "text": ["hello"] * rows, "large": pa.array(["hello"] * rows, pa.large_string())}), parquet)
    for column, holds in (("messages", "List({'role': Value('string'), 'content': Value('string')}) values"),
                          ("sentences", "List(Value('string')) values"), ("number", "Value('int64') values"),
                          ("floats", "List(Value('float64')) values")):
        with pytest.raises(DataError, match=re.escape(f"data.path='{parquet}': column {column!r} holds {holds}, "
                                                      "neither text (strings) nor token ids (lists of integers); set "
                                                      "data.text_field to the column of text or token ids")):
            HFDatasetData(str(parquet), text_field=column)
    for column in ("ids", "text", "large"):  # 40 short rows: blocks of 8 tokens
        HFDatasetData(str(parquet), text_field=column, seq_len=8)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join(json.dumps({"text": {"a": 1} if i == 5 else "hello"}) for i in range(rows)))
    with pytest.raises(DataError, match=re.escape("column 'text' holds Json(decode=True) values")):
        HFDatasetData(str(mixed))
    numbers = tmp_path / "numbers.csv"
    numbers.write_text("text\n" + "\n".join(str(i) for i in range(rows)))
    with pytest.raises(DataError, match=re.escape("column 'text' holds int values such as 0 (datasets reads a csv "
                                                  "column of numbers alone as numbers)")):
        HFDatasetData(str(numbers))


def test_a_record_of_another_type_is_refused_where_it_is_read(tmp_path: Path) -> None:
    """A csv is read in chunks of 10,000 rows, each typed on its own: numbers past the first are found as read."""
    corpus = tmp_path / "late_numbers.csv"
    corpus.write_text("text\n" + "\n".join(["hello"] * 10_000 + ["12", "13"]))
    data = HFDatasetData(str(corpus), seq_len=8, batch_size=2)
    with pytest.raises(DataError, match=re.escape(f"data.path='{corpus}' record 10001 (column 'text') holds int 12, "
                                                  "neither text nor a list of token ids")):
        data.setup("fit")


@pytest.mark.parametrize(("ids", "found"), [(599, "token id 599 at position 3, outside the vocabulary of 257 tokens"),
                                            (-1, "token id -1 at position 3")])
@pytest.mark.parametrize("streaming", [False, True])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_record(tmp_path: Path, ids: Any, found: str,
                                                                        streaming: bool) -> None:
    documents = [[1, 2, 3, 4, 5, 6, 7, 8]] * 30
    documents[6] = [1, 2, 3, ids, 5]
    corpus = str(_write(tmp_path, "parquet", documents))
    data = HFDatasetData(corpus, seq_len=4, batch_size=2, streaming=streaming, val_fraction=0.01)
    where = "a streamed record's column 'text'" if streaming else "record 7 (column 'text')"
    with pytest.raises(DataError, match=re.escape(found)) as refusal:
        data.setup("fit")
        list(data.train_stream(0, 1, endless=False))
    assert where in str(refusal.value) and "data.tokenizer_path" in str(refusal.value)


def test_a_csv_s_empty_cell_is_an_empty_document_as_in_the_other_formats(tmp_path: Path) -> None:
    texts = _documents()
    texts[3] = texts[10] = ""
    settings = {"seq_len": 16, "batch_size": 2, "val_fraction": 0.1, "seed": 3}
    data = HFDatasetData(str(_write(tmp_path, "csv", texts)), **settings)
    cells = datasets.load_dataset("csv", data_files=data.path, streaming=True)["train"]
    assert next(iter(cells.skip(3)))["text"] is None, "datasets reads an empty csv cell as null"
    data.setup("fit")
    reference = _text_reference(tmp_path, texts, **settings)
    assert torch.equal(data.train_set.tensors[0], reference.train_set.tensors[0])
    streams = [HFDatasetData(str(_write(tmp_path / layout, layout, texts)), streaming=True, seq_len=4, seed=3,
                             val_fraction=0.3).val_stream() for layout in ("csv", "jsonl")]
    csv_blocks, jsonl_blocks = ([block for (block,) in stream] for stream in streams)
    assert len(csv_blocks) == len(jsonl_blocks) and all(map(torch.equal, csv_blocks, jsonl_blocks))
