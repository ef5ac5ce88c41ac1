import json
import math
import time

import pytest
import torch

from lightning_merak.modules.config import DataConfig
from lightning_merak.modules.data import ByteTokenizer, LanguageModelingData, SyntheticLanguage, SyntheticSequences


def test_synthetic_language_is_seeded_and_structured():
    language = SyntheticLanguage(vocab_size=64, branching=3, seed=7)
    first = language.sample(32, 20)
    assert torch.equal(first, SyntheticLanguage(64, 3, seed=7).sample(32, 20))
    assert not torch.equal(first, SyntheticLanguage(64, 3, seed=8).sample(32, 20))
    for row in first:
        for previous, token in zip(row[:-1].tolist(), row[1:].tolist()):
            assert token in language.successors[previous].tolist()
    assert 0.0 < language.entropy_rate < math.log(3) + 1e-6 < math.log(64)


def test_synthetic_datamodule_shapes():
    data = LanguageModelingData(DataConfig(name="synthetic", seq_len=16, batch_size=4, num_sequences=64))
    data.setup("fit")
    (batch,) = next(iter(data.train_dataloader()))
    assert batch.shape == (4, 16) and batch.max() < data.vocab_size


def test_text_file_with_byte_tokenizer(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello merak " * 200, encoding="utf-8")
    data = LanguageModelingData(DataConfig(name="text", path=str(corpus), seq_len=32, batch_size=2))
    assert data.vocab_size == ByteTokenizer.vocab_size
    data.setup("fit")
    (batch,) = next(iter(data.train_dataloader()))
    assert set(bytes(batch[0].tolist()).decode()) <= set("hello merak ")


def test_jsonl_file(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"body": f"document {i} " * 20}) for i in range(20)))
    data = LanguageModelingData(DataConfig(name="text", path=str(corpus), text_field="body", seq_len=32))
    data.setup("fit")
    assert len(data.train_set) > len(data.val_set) >= 1


def test_missing_file_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path=.*does not exist"):
        LanguageModelingData(DataConfig(name="text", path=str(tmp_path / "nope.txt")))


def test_missing_jsonl_field_names_the_fix(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(KeyError, match="set data.text_field"):
        LanguageModelingData(DataConfig(name="text", path=str(corpus)))


def test_unknown_data_name():
    with pytest.raises(ValueError, match="choose one of synthetic, text"):
        LanguageModelingData(DataConfig(name="imagenet"))


def test_missing_tokenizer_dir(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("x" * 1000)
    with pytest.raises(FileNotFoundError, match="tokenizer_path"):
        LanguageModelingData(DataConfig(name="text", path=str(corpus), tokenizer_path=str(tmp_path / "tok")))


def _variable_loader():
    data = LanguageModelingData(DataConfig(name="synthetic", lengths="variable", num_sequences=64, batch_size=4,
                                           seq_len=32))
    data.setup("fit")
    return data.train_dataloader()


def _global_batches(passes):
    return [[tuple(batch.lengths.tolist()) for batch in one_pass] for one_pass in passes]


def test_variable_global_batches_resume_mid_pass_and_then_reshuffle_as_the_straight_run():
    straight = _variable_loader()
    first, second = _global_batches([straight, straight])
    assert first != second, "each pass reshuffles"
    resumed = _variable_loader()
    resumed.load_state_dict({"pass": 0, "batches": 3})  # a checkpoint taken after 3 batches of the first pass
    assert _global_batches([resumed, resumed]) == [first[3:], second]
    finished = _variable_loader()
    finished.load_state_dict({"pass": 0, "batches": len(first)})  # taken at the pass's end: the next one follows
    assert _global_batches([finished]) == [second]


def test_a_synthetic_sequence_depends_on_its_index_alone():
    """Sequence ``i`` is the same however many sequences the set has, whoever reads it and in which order, and a
    shorter one is its prefix: every rank reads the same tokens without generating the others."""
    language = SyntheticLanguage(vocab_size=64, branching=3, seed=7)
    rows = language.sample(6, 40)
    assert torch.equal(rows[:4], language.sample(4, 40))
    assert torch.equal(language.sequence(5, 40), rows[5])
    assert torch.equal(language.sequence(3, 12), rows[3, :12])
    assert not torch.equal(language.sequence(3, 40), rows[2])
    assert not torch.equal(language.sequence(3, 40, seed_offset=1), rows[3])
    small, large = SyntheticSequences(language, 8, 40), SyntheticSequences(language, 8192, 40)
    assert [small[i][0].tolist() for i in (7, 0, 3)] == [large[i][0].tolist() for i in (7, 0, 3)]
    assert torch.equal(small[-1][0], small[7][0])
    with pytest.raises(IndexError):
        small[8]
    first = LanguageModelingData(DataConfig(name="synthetic", seq_len=40, num_sequences=8, vocab_size=64, seed=7))
    first.setup("fit")
    assert torch.equal(first.train_set[5][0], rows[5]) and torch.equal(first.val_set[0][0],
                                                                    language.sequence(0, 40, seed_offset=1))


def test_synthetic_sequences_follow_the_chain_s_transition_probabilities():
    language = SyntheticLanguage(vocab_size=6, branching=3, seed=2)
    tokens = language.sequence(0, 60_000).tolist()
    counts = torch.zeros(6, 3)
    for previous, token in zip(tokens[:-1], tokens[1:]):
        counts[previous, language.successors[previous].tolist().index(token)] += 1
    visited = counts.sum(1) >= 2000  # a token no other token leads to is never left
    assert visited.sum() >= 3
    frequencies = counts[visited] / counts[visited].sum(1, keepdim=True)
    assert (frequencies - language.successor_probs[visited]).abs().max() < 0.03


def test_synthetic_setup_generates_nothing_until_a_sample_is_read():
    """At 16k tokens the default 8192 sequences took about a minute to generate up front on one process (four
    ranks on two cores: minutes, past the watchdog); now setup is immediate and a read costs one sequence."""
    data = LanguageModelingData(DataConfig(name="synthetic", seq_len=16384, num_sequences=8192, batch_size=1))
    started = time.perf_counter()
    data.setup("fit")
    (batch,) = next(iter(data.train_dataloader()))
    assert time.perf_counter() - started < 5.0
    assert batch.shape == (1, 16384) and len(data.train_set) == 8192
