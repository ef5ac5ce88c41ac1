"""Data that cannot train is refused as a ``DataError`` (a ``ValueError``, which ``merak-train`` prints without a
traceback) naming the file, the line, the counts and the fix: missing paths, unreadable lines, and too few blocks or
documents for one training batch, in the constructor where counting needs no tokeniser and otherwise when the
training loader is made, where each data-parallel rank's share is known."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest

from lightning_merak.modules.config import DataConfig, DataError
from lightning_merak.modules.data import LanguageModelingData, checked_token_ids
from lightning_merak.modules.hf_data import HFDatasetData


def _text(path: Path, **settings: object) -> LanguageModelingData:
    return LanguageModelingData(DataConfig(name="text", path=str(path), **settings))


def _blocks_of_text(tmp_path: Path, blocks: int, seq_len: int = 8) -> Path:
    """A ``.txt`` file of exactly ``blocks`` blocks of ``seq_len`` byte tokens (its bytes and the end id)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("x" * (blocks * seq_len - 1), encoding="utf-8")
    return corpus


def _ddp_trainer(devices: int, use_distributed_sampler: bool = True) -> pl.Trainer:
    """A Trainer of ``devices`` CPU ranks, made but never fitted (no process starts)."""
    return pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=use_distributed_sampler)


def test_a_missing_data_file_is_a_refusal_and_still_a_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=re.escape(f"data.path='{missing}' does not exist; pass an existing")) as text:
        _text(missing)
    with pytest.raises(DataError, match="does not exist; pass a local data file") as hf:
        HFDatasetData(str(tmp_path / "nope.parquet"))
    assert isinstance(text.value, FileNotFoundError) and isinstance(hf.value, FileNotFoundError)


def test_a_missing_tokenizer_folder_is_a_refusal_and_still_a_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data.tokenizer_path=.*is not a directory") as refused:
        _text(_blocks_of_text(tmp_path, 40), tokenizer_path=str(tmp_path / "no_tokenizer"))
    assert isinstance(refused.value, FileNotFoundError)


def test_a_tokenizer_folder_without_a_tokenizer_names_the_setting(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data.tokenizer_path='.*empty' holds no tokenizer transformers can load"):
        _text(_blocks_of_text(tmp_path, 40), tokenizer_path=str(tmp_path / "empty"))


def test_a_record_without_the_text_field_is_a_refusal_shown_unquoted(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError) as refused:
        _text(corpus)
    assert isinstance(refused.value, KeyError)
    assert str(refused.value) == (f"{corpus}:2 has no field 'text' (fields: ['body']); set data.text_field to the "
                                  "field holding the text")


@pytest.mark.parametrize("value", [None, 3, {"a": 1}])
def test_a_text_field_that_is_neither_text_nor_token_ids_names_the_line(tmp_path: Path, value: object) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": [1, 2]}) + "\n"
                      + json.dumps({"text": value}) + "\n")
    with pytest.raises(DataError, match=rf"{corpus}:3 field 'text' holds .*, neither text nor a list of token ids"):
        _text(corpus)


@pytest.mark.parametrize(("ids", "problem"), [
    ([1, 257], "token id 257 at position 1, outside the vocabulary of 257 tokens (ids 0 to 256); set "
               "data.tokenizer_path to the tokenizer that made these ids (the model's vocab_size is that tokenizer's)"),
    ([-1, 2], "token id -1 at position 0, outside the vocabulary of 257 tokens"),
    ([2, 4.5], "4.5 at position 1, not an integer token id; write the document's token ids as integers"),
    ([2, 4.0], "4.0 at position 1, not an integer token id"),
    (["a", "b"], "'a' at position 0, not an integer token id"),
    ([True], "True at position 0, not an integer token id"),
])
def test_token_ids_outside_the_vocabulary_are_refused_in_the_constructor(tmp_path: Path, ids: list[object],
                                                                          problem: str) -> None:
    """Before launch, naming the line: past the vocabulary the embedding fails on every rank after launch, and a
    negative or float id was read as another token."""
    corpus = tmp_path / "ids.jsonl"
    corpus.write_text(json.dumps({"text": list(range(256))}) + "\n\n" + json.dumps({"text": ids}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{corpus}:3 field 'text' holds {problem}")):
        _text(corpus)


def test_token_ids_are_checked_against_the_tokenizer_s_vocabulary(tmp_path: Path) -> None:
    """Also where text documents beside them wait for the tokenizer; numpy integers come back as Python ints."""
    tokenizer = _word_tokenizer(tmp_path / "tok", ["alpha beta"])  # [UNK], </s>, alpha, beta
    corpus = tmp_path / "mixed.jsonl"
    corpus.write_text(json.dumps({"text": "alpha beta"}) + "\n" + json.dumps({"text": [2, 3, 4]}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{corpus}:2 field 'text' holds token id 4 at position 2, outside "
                                                  "the vocabulary of 4 tokens")):
        _text(corpus, tokenizer_path=tokenizer)
    ids = checked_token_ids(np.array([0, 3]), 4, "row 1")
    assert ids == [0, 3] and all(type(i) is int for i in ids)


@pytest.mark.parametrize(("line", "reason"), [
    ("{not json}", r"is not valid JSON \(Expecting property name enclosed in double quotes at column 2\)"),
    ('["a", "list"]', "is a JSON list, not an object"),
])
def test_a_jsonl_line_that_is_not_a_json_object_names_the_file_and_line(tmp_path: Path, line: str,
                                                                         reason: str) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n\n" + line + "\n")
    expected = f"{re.escape(str(corpus))}:3 {reason}; each line of a .jsonl file must be one JSON object, such as "
    with pytest.raises(DataError, match=expected + re.escape('{"text": "..."}')):
        _text(corpus)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_bytes_that_are_not_utf8_name_the_line_and_the_re_encoding(tmp_path: Path, suffix: str) -> None:
    corpus = tmp_path / f"latin1{suffix}"
    first = json.dumps({"text": "fine"}).encode() if suffix == ".jsonl" else b"first line"
    corpus.write_bytes(first + b"\n" + b'{"te\xff' + b"\n")
    with pytest.raises(DataError, match=re.escape(f"{corpus}:2 is not UTF-8 text (byte 0xff at column 5: invalid "
                                                  "start byte); re-encode the file as UTF-8")):
        _text(corpus)


def test_fewer_training_blocks_than_a_batch_are_refused_in_the_constructor(tmp_path: Path) -> None:
    """10 blocks, one held out: 9 cannot make a batch of 16, so nothing would train; found before any rank starts."""
    corpus = _blocks_of_text(tmp_path, 10)
    expected = (f"data.path='{corpus}' makes 10 blocks of data.seq_len=8, 9 for training once data.val_fraction=0.02 "
                "holds out 1: fewer than one batch of data.batch_size=16, so nothing would train; use more data, a "
                "smaller data.batch_size or data.seq_len, or a smaller data.val_fraction")
    with pytest.raises(DataError, match=re.escape(expected)):
        _text(corpus, seq_len=8, batch_size=16)


def test_exactly_one_training_batch_is_enough(tmp_path: Path) -> None:
    data = _text(_blocks_of_text(tmp_path, 17), seq_len=8, batch_size=16)  # 16 for training, 1 held out
    data.setup("fit")
    assert len(data.train_dataloader()) == 1
    with pytest.raises(DataError, match="15 for training once data.val_fraction=0.1 holds out 2: fewer than one"):
        _text(_blocks_of_text(tmp_path, 17), seq_len=8, batch_size=16, val_fraction=0.1)


def test_a_rank_s_share_without_a_batch_is_refused_when_the_loader_is_made(tmp_path: Path) -> None:
    """39 training blocks make two batches of 16 on one rank, but a distributed sampler gives each of 4 ranks 10."""
    data = _text(_blocks_of_text(tmp_path, 40), seq_len=8, batch_size=16)
    data.setup("fit")
    data.trainer = _ddp_trainer(devices=4)
    with pytest.raises(DataError, match=re.escape(
            "makes 40 blocks of data.seq_len=8, 39 for training once data.val_fraction=0.02 holds out 1, 10 for each "
            "of 4 data-parallel ranks: fewer than one batch of data.batch_size=16 per rank, so nothing would train; "
            "use more data, a smaller data.batch_size or data.seq_len, or a smaller data.val_fraction; or train on "
            "fewer data-parallel ranks")):
        data.train_dataloader()
    data.trainer = _ddp_trainer(devices=2)  # 20 each
    data.train_dataloader()
    data.trainer = _ddp_trainer(devices=4, use_distributed_sampler=False)  # every rank reads all 39
    data.train_dataloader()


def _word_tokenizer(directory: Path, words: list[str], eos_token: str | None = "</s>") -> str:
    """A saved transformers tokenizer with a token per word: the token count needs it to run."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]",
                            eos_token=eos_token).save_pretrained(directory)
    return str(directory)


def test_a_tokenizer_without_an_end_of_text_token_is_said_and_packs_documents_back_to_back(tmp_path: Path) -> None:
    """The guide promises an end-of-text id after each document: where there is none, the user is told how to add
    one, and the documents run together as transformers' run_clm packs them."""
    tokenizer = _word_tokenizer(tmp_path / "tok", ["alpha beta"], eos_token=None)
    corpus = tmp_path / "words.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": "alpha beta alpha beta"}) for _ in range(8)))
    with pytest.warns(UserWarning, match=re.escape(f"data.tokenizer_path={tokenizer!r} has no end-of-text token "
                                                   "(eos_token), so text documents are put back to back")):
        data = _text(corpus, seq_len=4, batch_size=1, tokenizer_path=tokenizer)
    data.setup("fit")
    blocks = sorted(block.tolist() for (block,) in [*data.train_set, *data.val_set])
    assert blocks == [[2, 3, 2, 3]] * 8  # alpha, beta: "</s>" (id 1) is a token here but not the eos_token


def test_with_a_tokenizer_the_count_waits_for_the_training_loader(tmp_path: Path) -> None:
    corpus = tmp_path / "words.txt"
    corpus.write_text(" ".join(["alpha", "beta"] * 40))  # 80 words and the end id: 10 blocks of 8
    data = _text(corpus, seq_len=8, batch_size=16, tokenizer_path=_word_tokenizer(tmp_path / "tok", ["alpha beta"]))
    data.setup("fit")
    with pytest.raises(DataError, match="makes 10 blocks of data.seq_len=8, 9 for training .* fewer than one batch"):
        data.train_dataloader()


def test_a_hf_corpus_too_small_for_a_batch_is_refused_when_the_loader_is_made(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": "y" * 15}) for _ in range(10)))  # 10 documents of 2 blocks
    data = HFDatasetData(str(corpus), seq_len=8, batch_size=32)
    data.setup("fit")
    with pytest.raises(DataError, match=re.escape(
            f"data.path='{corpus}' makes 20 blocks of data.seq_len=8, 19 for training once data.val_fraction=0.02 "
            "holds out 1: fewer than one batch of data.batch_size=32")):
        data.train_dataloader()


def test_too_few_documents_for_variable_lengths_are_refused_in_the_constructor(tmp_path: Path) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"document {i}"}) for i in range(7)) + "\n"
                      + json.dumps({"text": ""}))  # an empty document gives one token: no sample
    with pytest.raises(DataError, match=re.escape(
            f"data.path='{corpus}' has 7 samples (documents of 2 tokens or more), too few for a validation and a "
            "training global batch of data.batch_size=4: that takes 8 (data.val_fraction=0.02 holds out 4, at least "
            "one global batch); use more documents or a smaller data.batch_size")):
        _text(corpus, lengths="variable", batch_size=4)


@pytest.mark.parametrize("lengths", ["fixed", "variable"])
def test_fewer_synthetic_sequences_than_a_batch_are_a_refusal(lengths: str) -> None:
    data = LanguageModelingData(DataConfig(name="synthetic", num_sequences=10, batch_size=16, seq_len=8,
                                           lengths=lengths))
    data.setup("fit")
    with pytest.raises(DataError, match=re.escape(
            "data=synthetic has data.num_sequences=10 training sequences: fewer than one batch of data.batch_size=16, "
            "so nothing would train; raise data.num_sequences or lower data.batch_size")):
        data.train_dataloader()


def test_a_validation_set_without_a_batch_per_rank_is_said_not_refused(tmp_path: Path) -> None:
    """17 blocks hold out 1 for validation: no batch of 16 to validate, so the run would log no val/loss."""
    data = _text(_blocks_of_text(tmp_path, 17), seq_len=8, batch_size=16)
    data.setup("fit")
    with pytest.warns(UserWarning, match=re.escape(
            "the validation set has 1 samples, 1 per data-parallel rank: fewer than one batch of data.batch_size=16, "
            "so validation runs no batch and logs no val/loss; raise data.val_fraction (about 0.94 holds out")):
        assert len(data.val_dataloader()) == 0
    enough = _text(_blocks_of_text(tmp_path, 40), seq_len=8, batch_size=4, val_fraction=0.1)
    enough.setup("fit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(enough.val_dataloader()) == 1
