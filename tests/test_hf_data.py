"""``HFDatasetData``: local Hugging Face ``datasets`` corpora in every format read into the same blocks and samples
as ``data=text``; streams split across data-parallel ranks; mid-epoch resume; every refusal names its fix; and a
2-rank merak3d run on a parquet corpus that matches a single-process run."""

from __future__ import annotations

import inspect
import json
import math
import random
from pathlib import Path
from typing import Any

import datasets
import lightning.pytorch as pl
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_merak
from lightning_merak.modules import HFDatasetData as exported
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import DataConfig, ModelConfig
from lightning_merak.modules.data import ByteTokenizer, LanguageModelingData
from lightning_merak.modules.hf_data import HFDatasetData, held_out
from lightning_merak.testing import run_distributed

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
MODEL = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2})


def _documents(count: int = 48, seed: int = 0) -> list[str]:
    """Distinct documents of varied lengths (3 to 30 words)."""
    rng = random.Random(seed)
    return [f"doc{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for i in range(count)]


def _write(directory: Path, layout: str, texts: list[str], column: str = "text") -> Path:
    """``texts`` as a corpus of ``layout``: a file of each format, a folder of parquet files, or save_to_disk."""
    directory.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(texts))), column: texts})
    if layout == "jsonl":
        path = directory / "corpus.jsonl"
        path.write_text("\n".join(json.dumps(row) for row in table.to_pylist()))
    elif layout == "parquet":
        pyarrow.parquet.write_table(table, path := directory / "corpus.parquet")
    elif layout == "csv":
        pyarrow.csv.write_csv(table, path := directory / "corpus.csv")
    elif layout == "arrow":
        with pa.OSFile(str(path := directory / "corpus.arrow"), "wb") as sink, pa.ipc.new_stream(
                sink, table.schema) as writer:
            writer.write_table(table)
    elif layout == "parquet_folder":
        (path := directory / "shards").mkdir()
        half = len(texts) // 2
        pyarrow.parquet.write_table(table.slice(0, half), path / "part-0.parquet")
        pyarrow.parquet.write_table(table.slice(half), path / "part-1.parquet")
    elif layout == "save_to_disk":
        datasets.Dataset(table).save_to_disk(str(path := directory / "saved"))
    else:  # save_to_disk_dict: a dataset dict whose training split is "train"
        datasets.DatasetDict({"train": datasets.Dataset(table), "test": datasets.Dataset(table.slice(0, 2))}
                             ).save_to_disk(str(path := directory / "saved_dict"))
    return path


def _text_reference(directory: Path, texts: list[str], **settings: Any) -> LanguageModelingData:
    """The same documents read by ``data=text`` (a .jsonl file)."""
    corpus = directory / "reference.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": text}) for text in texts))
    data = LanguageModelingData(DataConfig(name="text", path=str(corpus), **settings))
    data.setup("fit")
    return data


LAYOUTS = ["jsonl", "parquet", "csv", "arrow", "parquet_folder", "save_to_disk", "save_to_disk_dict"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_format_packs_the_blocks_data_text_reads(tmp_path: Path, layout: str) -> None:
    texts = _documents()
    settings = {"seq_len": 16, "batch_size": 2, "val_fraction": 0.1, "seed": 3}
    data = HFDatasetData(str(_write(tmp_path, layout, texts)), **settings)
    assert data.vocab_size == ByteTokenizer.vocab_size
    data.setup("fit")
    reference = _text_reference(tmp_path, texts, **settings)
    assert torch.equal(data.train_set.tensors[0], reference.train_set.tensors[0])
    assert torch.equal(data.val_set.tensors[0], reference.val_set.tensors[0])
    (batch,) = next(iter(data.train_dataloader()))
    assert batch.shape == (2, 16)


def test_variable_lengths_keep_each_document_as_data_text_does(tmp_path: Path) -> None:
    texts = _documents()
    settings = {"lengths": "variable", "max_length": 40, "batch_size": 4, "val_fraction": 0.1, "seed": 5}
    data = HFDatasetData(str(_write(tmp_path, "parquet", texts)), **settings)
    data.setup("fit")
    reference = _text_reference(tmp_path, texts, **settings)
    for ours, theirs in ((data.train_set, reference.train_set), (data.val_set, reference.val_set)):
        assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert max(len(sample) for sample in data.train_set) == 40, "cut to max_length"


def test_a_local_tokenizer_encodes_as_it_does_for_data_text(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = _documents()
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tokenizer_dir = tmp_path / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="</s>").save_pretrained(
        tokenizer_dir)
    settings = {"seq_len": 8, "batch_size": 2, "tokenizer_path": str(tokenizer_dir)}
    data = HFDatasetData(str(_write(tmp_path, "parquet", texts)), **settings)
    data.setup("fit")
    reference = _text_reference(tmp_path, texts, **settings)
    assert data.vocab_size == reference.vocab_size == tokenizer.get_vocab_size()
    assert torch.equal(data.train_set.tensors[0], reference.train_set.tensors[0])


def _one_block_documents(count: int, seq_len: int) -> list[str]:
    """Documents of exactly one block each with the byte tokenizer (``seq_len - 1`` bytes and the end id)."""
    return [f"{i:04d}".ljust(seq_len - 1, "abcdefgh"[i % 8]) for i in range(count)]


def _texts(stream: Any) -> list[str]:
    """The documents of a one-document-per-block stream."""
    return [bytes(block[:-1].tolist()).decode() for (block,) in stream]


@pytest.mark.parametrize("layout", ["jsonl", "save_to_disk"])
def test_a_stream_splits_the_training_documents_across_ranks(tmp_path: Path, layout: str) -> None:
    texts = _one_block_documents(40, seq_len=12)
    data = HFDatasetData(str(_write(tmp_path, layout, texts)), seq_len=12, batch_size=2, val_fraction=0.2,
                         streaming=True, shuffle_buffer=8, seed=7)
    training = [text for text in texts if not held_out(text, 7, 0.2)]
    assert 0 < len(training) < len(texts)
    for first_pass in (0, 1):
        shares = []
        for rank in range(2):
            stream = data.train_stream(rank, 2, endless=False)
            stream.set_epoch(first_pass)
            shares.append(_texts(stream))
        assert shares[0] and shares[1] and not set(shares[0]) & set(shares[1])
        assert sorted(shares[0] + shares[1]) == sorted(training)
        assert shares[0] != [text for text in training if text in shares[0]], "shuffled within the rank's share"
    assert sorted(_texts(data.val_stream())) == sorted(set(texts) - set(training))


def _batches(loader: Any, count: int) -> list[torch.Tensor]:
    batches = iter(loader)
    return [next(batches)[0] for _ in range(count)]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_restored_training_loader_continues_where_its_run_stopped(tmp_path: Path, streaming: bool) -> None:
    texts = _documents(96)
    data = HFDatasetData(str(_write(tmp_path, "jsonl", texts)), seq_len=16, batch_size=2, streaming=streaming,
                         shuffle_buffer=16)
    data.setup("fit")
    straight_loader = data.train_dataloader()
    if streaming:
        straight = _batches(straight_loader, 40)
        restored = data.train_dataloader()
        restored.load_state_dict({"pass": 0, "batches": 25})
        continued = _batches(restored, 15)
        assert all(torch.equal(a, b) for a, b in zip(continued, straight[25:]))
        return
    first_pass = _batches(straight_loader, len(straight_loader))
    second_pass = _batches(straight_loader, len(straight_loader))
    restored = data.train_dataloader()
    restored.load_state_dict({"pass": 1, "batches": 3})
    continued = [batch for (batch,) in restored]
    assert len(continued) == len(second_pass) - 3
    assert all(torch.equal(a, b) for a, b in zip(continued, second_pass[3:]))
    assert not torch.equal(first_pass[0], second_pass[0]), "each pass has its own order"


class _Record(pl.Callback):
    """Each step's loss (as logged: under a pipeline only the last stage computes it) and the ids trained on."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.batches.append(batch[0].detach().cpu().clone())


def _fit_batches(corpus: str, streaming: bool, max_steps: int, checkpoint_dir: Path,
                 resume_from: str | None = None) -> list[torch.Tensor]:
    """The batches a one-process fit trains on, checkpointing every 3 steps."""
    pl.seed_everything(0, workers=True)
    data = HFDatasetData(corpus, seq_len=16, batch_size=2, streaming=streaming, shuffle_buffer=16)
    record = _Record()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[record, ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=3,
                                                            save_top_k=-1, filename="{step}")])
    trainer.fit(CausalLMModule(build_causal_lm(MODEL, data.vocab_size)), datamodule=data, ckpt_path=resume_from)
    return record.batches


@pytest.mark.parametrize("streaming", [False, True])
def test_a_fit_resumed_mid_epoch_trains_on_the_batches_the_straight_run_did(tmp_path: Path, streaming: bool) -> None:
    corpus = str(_write(tmp_path, "jsonl", _documents(40)))
    straight = _fit_batches(corpus, streaming, 8, tmp_path / "straight")
    resumed = _fit_batches(corpus, streaming, 8, tmp_path / "resumed", str(tmp_path / "straight" / "step=3.ckpt"))
    assert len(resumed) == 5 and all(torch.equal(a, b) for a, b in zip(resumed, straight[3:]))


def test_streaming_validation_reads_every_held_out_block_once(tmp_path: Path) -> None:
    texts = _one_block_documents(40, seq_len=12)
    data = HFDatasetData(str(_write(tmp_path, "jsonl", texts)), seq_len=12, batch_size=1, val_fraction=0.3,
                         streaming=True)
    data.setup("fit")
    blocks = [bytes(block[0, :-1].tolist()).decode() for (block,) in data.val_dataloader()]
    assert sorted(blocks) == sorted(text for text in texts if held_out(text, 1234, 0.3))


def _refusal(tmp_path: Path, case: str) -> dict[str, Any]:
    """Constructor arguments of each bad input."""
    parquet = str(_write(tmp_path / "corpus", "parquet", _documents()))
    if case == "mixed_folder":
        _write(tmp_path / "mixed", "parquet", _documents())
        _write(tmp_path / "mixed", "csv", _documents())
    (tmp_path / "empty").mkdir(exist_ok=True)
    (tmp_path / "notes.txt").write_text("hello")
    return {
        "no_path": {"path": ""},
        "missing_path": {"path": str(tmp_path / "nope.parquet")},
        "unknown_format": {"path": parquet, "format": "xlsx"},
        "unknown_suffix": {"path": str(tmp_path / "notes.txt")},
        "empty_folder": {"path": str(tmp_path / "empty")},
        "mixed_folder": {"path": str(tmp_path / "mixed")},
        "missing_column": {"path": parquet, "text_field": "body"},
        "missing_split": {"path": parquet, "split": "validation"},
        "streaming_variable": {"path": parquet, "streaming": True, "lengths": "variable"},
        "short_blocks": {"path": parquet, "seq_len": 1},
        "val_fraction": {"path": parquet, "val_fraction": 1.0},
        "lengths": {"path": parquet, "lengths": "ragged"},
        "batch_size": {"path": parquet, "batch_size": 0},
        "tokenizer": {"path": parquet, "tokenizer_path": str(tmp_path / "no_tokenizer")},
    }[case]


REFUSALS = {
    "no_path": (ValueError, "needs data.path"),
    "missing_path": (FileNotFoundError, "nope.parquet' does not exist; pass a local data file"),
    "unknown_format": (ValueError, "data.format='xlsx' is unknown; choose one of json, jsonl, parquet"),
    "unknown_suffix": (ValueError, "cannot infer the format from suffix '.txt'; set data.format"),
    "empty_folder": (ValueError, "folder with no data files .*point data.path at one file or set data.format"),
    "mixed_folder": (ValueError, r"data files of several formats \(.csv, .parquet\)"),
    "missing_column": (ValueError, r"has no column 'body' \(columns: id, text\); set data.text_field"),
    "missing_split": (ValueError, "data.split='validation' is not in .*its splits are train: set data.split"),
    "streaming_variable": (ValueError, "set data.streaming=false or data.lengths=fixed"),
    "short_blocks": (ValueError, "data.seq_len must be at least 2"),
    "val_fraction": (ValueError, r"data.val_fraction must lie in \(0, 1\)"),
    "lengths": (ValueError, "data.lengths='ragged'; choose fixed"),
    "batch_size": (ValueError, "data.batch_size must be at least 1"),
    "tokenizer": (FileNotFoundError, "data.tokenizer_path=.*is not a directory"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_input_is_refused_in_the_constructor_naming_the_fix(tmp_path: Path, case: str) -> None:
    error, message = REFUSALS[case]
    with pytest.raises(error, match=message):
        HFDatasetData(**_refusal(tmp_path, case))


def test_too_little_text_for_two_blocks_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fewer than two blocks of data.seq_len=64; use more data or a smaller"):
        HFDatasetData(str(_write(tmp_path, "parquet", ["tiny"])), seq_len=64)  # before any rank starts


def test_a_stream_without_max_steps_is_refused_before_training(tmp_path: Path) -> None:
    data = HFDatasetData(str(_write(tmp_path, "parquet", _documents())), streaming=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = CausalLMModule(build_causal_lm(MODEL, data.vocab_size))
    with pytest.raises(ValueError, match="set the Trainer's max_steps"):
        trainer.fit(module, datamodule=data)


STEPS = 4


def _initial_state(directory: Path) -> str:
    """The weights every run starts from, saved once."""
    torch.manual_seed(0)
    path = directory / "initial.pt"
    torch.save(build_causal_lm(MODEL, ByteTokenizer.vocab_size).state_dict(), path)
    return str(path)


def _train(corpus: str, strategy: Any, devices: int, streaming: bool, initial: str) -> _Record:
    pl.seed_everything(0, workers=True)
    data = HFDatasetData(corpus, seq_len=16, batch_size=4, streaming=streaming, seed=11)
    model = build_causal_lm(MODEL, data.vocab_size)
    model.load_state_dict(torch.load(initial, weights_only=True))
    module = CausalLMModule(model)
    record = _Record()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[record],
                         use_distributed_sampler=streaming)  # one data-parallel replica: the single process's order
    trainer.fit(module, datamodule=data)
    return record


def _merak3d_rank(rank: int, world_size: int, corpus: str, layout: str, initial: str) -> dict[str, Any]:
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    if layout == "pipeline":
        strategy = Merak3DStrategy(pipeline_parallel=2, data_parallel=1, timeout_s=120)
        return {"losses": _train(corpus, strategy, 2, False, initial).losses}
    record = _train(corpus, Merak3DStrategy(data_parallel=2, timeout_s=120), 2, True, initial)
    data = HFDatasetData(corpus, seq_len=16, batch_size=4, streaming=True, seed=11)
    expected = _batches(data.resumable_loader(data.train_stream(rank, world_size)), STEPS)
    return {"losses": record.losses, "read_its_share": all(torch.equal(a, b) for a, b in
                                                           zip(record.batches, expected))}


@pytest.mark.distributed
def test_merak3d_pipeline_trains_on_a_parquet_corpus_as_one_process_does(tmp_path: Path) -> None:
    corpus, initial = str(_write(tmp_path, "parquet", _documents(96))), _initial_state(tmp_path)
    reference = _train(corpus, "auto", 1, False, initial).losses
    for result in run_distributed(_merak3d_rank, 2, args=(corpus, "pipeline", initial), timeout_s=120):
        assert result["losses"] == pytest.approx(reference, rel=1e-5)


@pytest.mark.distributed
def test_merak3d_data_parallel_ranks_each_stream_their_share(tmp_path: Path) -> None:
    corpus, initial = str(_write(tmp_path, "jsonl", _documents(96))), _initial_state(tmp_path)
    results = run_distributed(_merak3d_rank, 2, args=(corpus, "streaming", initial), timeout_s=120)
    assert all(result["read_its_share"] for result in results)
    assert all(len(result["losses"]) == STEPS and all(map(math.isfinite, result["losses"])) for result in results)


def test_the_config_group_option_declares_every_argument_with_its_default() -> None:
    source = (Path(lightning_merak.__file__).parent / "conf/data/hf_dataset.yaml").read_text()
    option = yaml.safe_load(source)
    assert option.pop("_target_") == "lightning_merak.modules.hf_data.HFDatasetData" and exported is HFDatasetData
    parameters = inspect.signature(HFDatasetData).parameters
    assert list(option) == list(parameters)
    assert option.pop("path") == "???"
    assert option == {name: parameters[name].default for name in option}
    assert all("#" in line for line in source.splitlines() if line and not line.startswith(("#", "_target_")))


@pytest.mark.parametrize(("key", "value", "wanted"), [("seq_len", 16.5, "a whole number"),
                                                      ("batch_size", "abc", "a whole number"),
                                                      ("streaming", "yes", "true or false"),
                                                      ("val_fraction", "0.1", "a number")])
def test_a_value_of_the_wrong_type_is_refused_naming_its_key(key: str, value: Any, wanted: str) -> None:
    """The CLI hands ``data=hf_dataset``'s keys over untyped: the constructor names a wrong type before any work."""
    with pytest.raises(ValueError, match=rf"data\.{key} must be {wanted}, got {value!r}"):
        HFDatasetData("/nonexistent/corpus.jsonl", **{key: value})
