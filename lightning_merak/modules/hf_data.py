"""Training data from a local Hugging Face ``datasets`` corpus: ``data=hf_dataset``.

The corpus is json/jsonl, parquet, csv or arrow files (read by ``datasets.load_dataset(<format>, ...)``),
one file or a folder of them, or a folder written by ``save_to_disk`` (``datasets.load_from_disk``). Its text
column is tokenised with a local tokenizer or, without one, with the byte-level
:class:`~lightning_merak.modules.data.ByteTokenizer`.

Without streaming the whole corpus is tokenised once in ``setup`` and cut exactly as ``data=text`` cuts a file
(the shared :func:`~lightning_merak.modules.data.packed_blocks` and
:func:`~lightning_merak.modules.data.variable_samples`), so both resume mid-epoch the same way. With
``streaming=True`` nothing is materialised: each data-parallel rank reads its own documents
(``datasets.distributed.split_dataset_by_node``), shuffles them in a buffer and packs blocks as it goes. The
stream never ends (each pass reshuffled), so every rank can always take another step and the run stops at the
Trainer's ``max_steps``; a resumed run reads the trained batches again and drops them, as the in-memory loader
does. A document is held out for validation by a seeded hash of its text, which needs no count of the corpus
and sends a duplicated document to the same side; every rank validates on all held-out documents.

Too little text for two blocks, or for a training batch on each rank, is refused in ``setup`` and when the training
loader is made, not in the constructor: counting the tokens means reading and tokenising the whole corpus, which
``merak-train``'s launcher would then do once more before the ranks do. So is a file ``datasets`` cannot parse (bad
JSON, bytes that are not UTF-8, a damaged parquet file) where it is first read (the constructor reads the first
records): a :class:`DataError` naming the file, the line where one can be found, and the fix (:class:`Corpus`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset as TorchIterableDataset

from lightning_merak.modules.config import DataError
from lightning_merak.modules.data import (
    DataFileNotFound,
    TokenDataModule,
    document_tokens,
    load_tokenizer,
    packed_blocks,
    packed_split,
    variable_samples,
)
from lightning_merak.modules.text_files import not_utf8
from lightning_merak.util.values import is_count, is_finite_number

try:
    import datasets
    from datasets.distributed import split_dataset_by_node
except ImportError as missing:  # an optional dependency: the `data` extra
    raise ImportError("data=hf_dataset reads corpora with Hugging Face datasets, which is not installed: "
                      "pip install 'lightning-merak[data]' (or pip install datasets)") from missing

__all__ = ["FORMATS", "Corpus", "HFDatasetData", "PackedStream", "held_out", "resolve_format"]

SUFFIX_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
FORMATS = ("json", "jsonl", "parquet", "csv", "arrow", "save_to_disk")
"""``format`` values: ``datasets``' packaged readers (``jsonl`` is ``json``) and ``save_to_disk`` folders."""
SAVED_MARKERS = ("state.json", "dataset_dict.json")
"""Files ``save_to_disk`` writes at a folder's top (a dataset, or a dataset dict of splits)."""
DISK_SHARDS = 64
"""Shards a ``save_to_disk`` dataset is streamed in (at most one per row): ranks and loader workers read
disjoint runs of rows instead of every one reading all and skipping."""
READ_BATCH = 1024
"""Records read from ``datasets`` at a time: its row-by-row iteration costs a Python object per column."""


def resolve_format(path: Path, data_format: Optional[str]) -> str:
    """The reader for ``path``: ``data_format`` checked, or inferred from the file's suffix, the folder's
    ``save_to_disk`` files or the suffix its data files share."""
    if data_format is not None:
        if data_format not in FORMATS:
            raise ValueError(f"data.format={data_format!r} is unknown; choose one of {', '.join(FORMATS)}, or null "
                             "to infer it from data.path")
        return "json" if data_format == "jsonl" else data_format
    if path.is_file():
        if path.suffix not in SUFFIX_FORMATS:
            raise ValueError(f"data.path={str(path)!r}: cannot infer the format from suffix {path.suffix!r}; "
                             f"set data.format to one of {', '.join(FORMATS)}")
        return SUFFIX_FORMATS[path.suffix]
    if any((path / marker).is_file() for marker in SAVED_MARKERS):
        return "save_to_disk"
    suffixes = {file.suffix for file in path.rglob("*") if file.is_file() and file.suffix in SUFFIX_FORMATS}
    formats = {SUFFIX_FORMATS[suffix] for suffix in suffixes}
    if len(formats) != 1:
        found = f"data files of several formats ({', '.join(sorted(suffixes))})" if formats else "no data files"
        raise ValueError(f"data.path={str(path)!r} is a folder with {found} and no save_to_disk files "
                         f"({' or '.join(SAVED_MARKERS)}); point data.path at one file or set data.format")
    return formats.pop()


class _DropReadFailures(logging.Filter):
    """Drops ``datasets``' log line of a file it failed to read: the refusal raised instead says more."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to ")


_READER_LOGGERS = tuple(logging.getLogger(f"datasets.packaged_modules.{name}.{name}")
                        for name in ("json", "csv", "parquet", "arrow"))
"""The loggers of ``datasets``' file readers, which log a failure to read before raising it."""


def _json_problem(file: Path, text_field: str) -> Optional[DataError]:
    """The refusal naming where the UTF-8 ``file`` stops being JSON: its first line that is not a JSON value (JSON
    lines, as ``datasets`` reads first), or where a file that is one JSON document breaks; None where it parses."""
    fix = (f"each line of a JSON-lines file must be one JSON object, such as {{\"{text_field}\": \"...\"}}, and a "
           ".json file may instead be one JSON document; fix or drop what is broken")
    with file.open(encoding="utf-8") as lines:
        numbered = ((number, line) for number, line in enumerate(lines, start=1) if line.strip())
        for index, (line_number, line) in enumerate(numbered):
            try:
                json.loads(line.rstrip("\r\n"))  # so an object left open is placed at the line's end, not the next
            except json.JSONDecodeError as error:
                if index == 0 and file.suffix != ".jsonl":
                    break  # not JSON lines, perhaps one document over several lines
                return DataError(f"{file}:{line_number} is not valid JSON ({error.msg} at column {error.colno}); "
                                 f"{fix}")
        else:
            return None
    try:
        json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        return DataError(f"{file}:{error.lineno} is not valid JSON ({error.msg} at column {error.colno}); {fix}")
    return None


@dataclass(frozen=True)
class Corpus:
    """The files ``datasets`` reads the documents from, for refusals of what it cannot parse."""

    path: Path
    data_format: str
    text_field: str

    @property
    def source(self) -> str:
        """How errors name the data."""
        return f"data.path={str(self.path)!r}"

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around a read by ``datasets``: its parse errors (``ValueError``s of pyarrow, pandas, json and UTF-8
        decoding, each library's own) are refused by :meth:`refusal`, its log line of them dropped."""
        drop = _DropReadFailures()
        for logger in _READER_LOGGERS:
            logger.addFilter(drop)
        try:
            yield
        except ValueError as error:
            raise self.refusal(error) from error
        except StopIteration as error:  # a reader that infers the columns from the first record found none
            raise self.empty() from error
        finally:
            for logger in _READER_LOGGERS:
                logger.removeFilter(drop)

    def refusal(self, error: ValueError) -> DataError:
        """The first line of a text data file that is not UTF-8, or (json) not JSON, where one is; else ``datasets``'
        reason, with the path and the fix."""
        for file in self._text_files():
            problem = not_utf8(file, str(file))
            if problem is None and self.data_format == "json":
                problem = _json_problem(file, self.text_field)
            if problem is not None:
                return problem
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return DataError(f"{self.source} cannot be read as {self.data_format} by datasets ({reason}); fix or replace "
                         "the broken file, or set data.format to the format of its files")

    def empty(self) -> DataError:
        """The refusal of a corpus without a record, naming its empty files."""
        if self.path.is_file():
            found = " (an empty file)" if self.path.stat().st_size == 0 else ""
        else:
            empty = [str(file) for file in sorted(self.path.rglob("*")) if file.is_file() and file.stat().st_size == 0]
            found = f" (empty files: {', '.join(empty)})" if empty else ""
        return DataError(f"{self.source} holds no records{found}; point data.path at a corpus with documents")

    def _text_files(self) -> list[Path]:
        """The corpus's data files that are text (json, csv): the file, or those of the folder in the format."""
        if self.data_format not in ("json", "csv"):
            return []
        if self.path.is_file():
            return [self.path]
        return sorted(file for file in self.path.rglob("*")
                      if file.is_file() and SUFFIX_FORMATS.get(file.suffix) == self.data_format)


def open_documents(corpus: Corpus, split: str) -> datasets.Dataset | datasets.IterableDataset:
    """The split's records, opened lazily: memory-mapped (``save_to_disk``) or streamed from the files."""
    path = corpus.path
    with corpus.reading():
        if corpus.data_format == "save_to_disk":
            splits = datasets.load_from_disk(str(path))
        else:
            source = {"data_files": str(path)} if path.is_file() else {"data_dir": str(path)}
            splits = datasets.load_dataset(corpus.data_format, streaming=True, **source)
    if isinstance(splits, datasets.Dataset):  # a single save_to_disk dataset is its own one split
        return splits
    if split not in splits:
        raise ValueError(f"data.split={split!r} is not in data.path={str(path)!r}; its splits are "
                         f"{', '.join(sorted(splits))}: set data.split to one of them")
    return splits[split]


def column_names(documents: datasets.Dataset | datasets.IterableDataset, corpus: Corpus) -> list[str]:
    """The records' columns: from the schema, or (a stream whose reader infers it) from the first record."""
    if documents.column_names is not None:
        return list(documents.column_names)
    with corpus.reading():
        first = next(iter(documents.take(1)), None)
    return [] if first is None else list(first)


def held_out(document: Any, seed: int, val_fraction: float) -> bool:
    """Whether a streamed document belongs to validation: a seeded hash of its text below ``val_fraction``."""
    digest = hashlib.blake2b(f"{seed}\0{document}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def _on_side(record: dict[str, Any], text_field: str, seed: int, val_fraction: float, validation: bool) -> bool:
    return held_out(record[text_field], seed, val_fraction) == validation


def _record_batches(documents: Any, corpus: Corpus) -> Iterator[dict[str, list[Any]]]:
    """The records in batches of :data:`READ_BATCH`, what ``datasets`` cannot parse refused as it is read."""
    batches = iter(documents.iter(batch_size=READ_BATCH))
    while True:
        with corpus.reading():
            batch = next(batches, None)
        if batch is None:
            return
        yield batch


def _token_lists(documents: Any, corpus: Corpus, encode: Callable[[str], list[int]],
                 eos_token_id: Optional[int]) -> Iterator[list[int]]:
    """Each record's token ids, read in batches of records; empty (null) documents skipped."""
    for batch in _record_batches(documents, corpus):
        for document in batch[corpus.text_field]:
            if document is not None:
                yield document_tokens(document, encode, eos_token_id)


class PackedStream(TorchIterableDataset):
    """Blocks of ``seq_len`` ids packed from a document stream as it is read, one pass or endlessly.

    ``set_epoch`` numbers the first pass; each pass reshuffles the documents (``datasets`` seeds its shuffle
    with the seed plus the pass), and tokens left over at a pass's end open the next one.
    """

    def __init__(self, documents: datasets.IterableDataset, corpus: Corpus, encode: Callable[[str], list[int]],
                 eos_token_id: Optional[int], seq_len: int, endless: bool, shares: int = 1) -> None:
        super().__init__()
        self.documents, self.corpus, self.seq_len, self.endless = documents, corpus, seq_len, endless
        self.encode, self.eos_token_id = encode, eos_token_id
        self.shares = shares
        """The data-parallel shares the documents are split into (this stream reads one): what a resumed run's
        trained batch count means."""
        self.first_pass = 0

    def set_epoch(self, epoch: int) -> None:
        self.first_pass = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor]]:
        buffer: list[int] = []
        for pass_number in itertools.count(self.first_pass) if self.endless else (self.first_pass,):
            self.documents.set_epoch(pass_number)
            read_any = False
            for tokens in _token_lists(self.documents, self.corpus, self.encode, self.eos_token_id):
                read_any = True
                buffer.extend(tokens)
                while len(buffer) >= self.seq_len:
                    yield (torch.tensor(buffer[:self.seq_len], dtype=torch.long),)
                    del buffer[:self.seq_len]
            if self.endless and not read_any:  # an empty share would loop forever without a batch
                raise DataError(f"{self.corpus.source}: this rank's share of the training documents is empty; use more "
                                 "documents, fewer ranks or data.num_workers, or a smaller data.val_fraction")


class HFDatasetData(TokenDataModule):
    """A local Hugging Face ``datasets`` corpus as blocks of ``seq_len`` token ids (or, ``lengths="variable"``,
    one sample per document for merak3d's ``micro_batching``), with a held-out validation split.

    Every argument is checked, the tokenizer loaded and the corpus opened (its split and text column checked)
    in the constructor, before any tokenising; ``vocab_size`` is then the tokenizer's, for the model to match.
    ``format=None`` infers the reader from ``path``; ``split`` names the split of a ``save_to_disk`` dataset
    dict, or of a folder whose file names mark splits (a file alone is ``train``).
    """

    def __init__(self, path: str, format: Optional[str] = None, split: str = "train", text_field: str = "text",
                 tokenizer_path: Optional[str] = None, seq_len: int = 64, batch_size: int = 16,
                 lengths: str = "fixed", max_length: int = 2048, val_fraction: float = 0.02,
                 streaming: bool = False, shuffle_buffer: int = 10_000, num_workers: int = 0,
                 seed: int = 1234) -> None:
        _check_types(seq_len=seq_len, batch_size=batch_size, max_length=max_length, shuffle_buffer=shuffle_buffer,
                     num_workers=num_workers, seed=seed, val_fraction=val_fraction, streaming=streaming)
        super().__init__(batch_size, lengths, num_workers, seed)
        if seq_len < 2:
            raise ValueError(f"data.seq_len must be at least 2, got {seq_len}")
        if max_length < 2:
            raise ValueError(f"data.max_length must be at least 2, got {max_length}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must lie in (0, 1), got {val_fraction}")
        if shuffle_buffer < 1:
            raise ValueError(f"data.shuffle_buffer must be at least 1, got {shuffle_buffer}")
        if streaming and lengths == "variable":
            raise ValueError("data.streaming=true packs blocks of seq_len as it reads; data.lengths=variable needs "
                             "the whole corpus to shuffle samples into global batches: set data.streaming=false "
                             "or data.lengths=fixed")
        if not path:
            raise ValueError("data=hf_dataset needs data.path: a json/jsonl, parquet, csv or arrow file, a folder "
                             "of them, or a save_to_disk folder, by absolute path")
        local = Path(path).expanduser()
        if not local.exists():
            raise DataFileNotFound(f"data.path={path!r} does not exist; pass a local data file or folder (e.g. "
                                   "data=hf_dataset data.path=/abs/path/train.parquet)")
        self.path, self.format = str(local), resolve_format(local, format)
        self.split, self.text_field, self.seq_len, self.max_length = split, text_field, seq_len, max_length
        self.val_fraction, self.streaming, self.shuffle_buffer = val_fraction, streaming, shuffle_buffer
        self._encode, self.vocab_size, self._eos = load_tokenizer(tokenizer_path)
        self.corpus = Corpus(local, self.format, text_field)
        self.documents = open_documents(self.corpus, split)
        columns = column_names(self.documents, self.corpus)
        if text_field not in columns:
            raise ValueError(f"data.path={path!r} has no column {text_field!r} (columns: {', '.join(columns)}); "
                             "set data.text_field to the column holding the text")

    @property
    def source(self) -> str:
        """How errors name the data."""
        return self.corpus.source

    def describe_training_split(self, train_count: int, held_out: int) -> tuple[str, str]:
        if self.lengths == "fixed":
            return packed_split(self.source, train_count, held_out, self.seq_len, self.val_fraction)
        return super().describe_training_split(train_count, held_out)

    def build_samples(self) -> tuple[Any, Any]:
        token_lists = _token_lists(self.documents, self.corpus, self._encode, self._eos)
        if self.lengths == "variable":
            return variable_samples(token_lists, self.max_length, self.batch_size, self.val_fraction, self.seed,
                                    self.source)
        return packed_blocks(token_lists, self.seq_len, self.val_fraction, self.seed, self.source)

    def setup(self, stage: str) -> None:
        if not self.streaming:
            super().setup(stage)
        elif self.trainer is not None and self.trainer.max_steps < 0:
            raise ValueError("data.streaming=true reads an endless stream (each pass reshuffled), so an epoch never "
                             "ends: set the Trainer's max_steps (trainer.max_steps) and an integer "
                             "val_check_interval")

    def _stream(self, validation: bool) -> datasets.IterableDataset:
        """The documents of one side of the split, as a stream, with only the text column read."""
        documents = self.documents
        if isinstance(documents, datasets.Dataset):
            documents = documents.to_iterable_dataset(num_shards=max(1, min(len(documents), DISK_SHARDS)))
        on_side = functools.partial(_on_side, text_field=self.text_field, seed=self.seed,
                                    val_fraction=self.val_fraction, validation=validation)
        return documents.select_columns([self.text_field]).filter(on_side)

    def _packed(self, documents: datasets.IterableDataset, endless: bool, shares: int = 1) -> PackedStream:
        return PackedStream(documents, self.corpus, self._encode, self._eos, self.seq_len, endless, shares)

    def train_stream(self, rank: int, world_size: int, endless: bool = True) -> PackedStream:
        """Data-parallel rank ``rank``'s stream of training blocks (``streaming=True``); ``endless=False``: one
        pass, this rank's share of the documents in one shuffle."""
        documents = split_dataset_by_node(self._stream(validation=False), rank=rank, world_size=world_size)
        return self._packed(documents.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer), endless=endless,
                            shares=world_size)

    def val_stream(self) -> PackedStream:
        """One pass over every held-out block (``streaming=True``): each rank validates on all of them."""
        return self._packed(self._stream(validation=True), endless=False)

    def train_dataloader(self) -> DataLoader:
        if not self.streaming:
            return super().train_dataloader()
        strategy = None if self.trainer is None else self.trainer.strategy
        replica = getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        stream = self.train_stream(replica["rank"], replica["num_replicas"])
        # A worker beyond the stream's shards would read nothing.
        return self.resumable_loader(stream, num_workers=min(self.num_workers, stream.documents.num_shards))

    def val_dataloader(self) -> DataLoader:
        if not self.streaming:
            return super().val_dataloader()
        stream = self.val_stream()
        return DataLoader(stream, batch_size=self.batch_size, drop_last=True,
                          num_workers=min(self.num_workers, stream.documents.num_shards))


def _check_types(**values: Any) -> None:
    """Refuse a value of the wrong type, naming its key: ``data=hf_dataset``'s keys reach the constructor untyped
    (Hydra's ``_target_``), so ``data.seq_len=16.5`` would otherwise fail mid-run."""
    for key, value in values.items():
        if key == "streaming":
            wanted, ok = "true or false", isinstance(value, bool)
        elif key == "val_fraction":
            wanted, ok = "a number", is_finite_number(value)
        else:
            wanted, ok = "a whole number", is_count(value)
        if not ok:
            raise ValueError(f"data.{key} must be {wanted}, got {value!r}")
