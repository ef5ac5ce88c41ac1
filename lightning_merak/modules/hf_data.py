"""Training data from a local Hugging Face ``datasets`` corpus: ``data=hf_dataset``.

The corpus is json/jsonl, parquet, csv or arrow files (read by ``datasets.load_dataset(<format>, ...)``),
one file or a folder of them, or a folder written by ``save_to_disk`` (``datasets.load_from_disk``). Its text
column is tokenised with a local tokenizer or, without one, with the byte-level
:class:`~lightning_merak.modules.data.ByteTokenizer`.

Without streaming the whole corpus is tokenised once in ``setup`` and cut exactly as ``data=text`` cuts a file
(the shared :func:`~lightning_merak.modules.data.packed_blocks` and
:func:`~lightning_merak.modules.data.variable_samples`), so both resume mid-epoch the same way. With
``streaming=True`` nothing is materialised: each data-parallel rank reads its own documents
(``datasets.distributed.split_dataset_by_node``), each of its loader workers its share of those (the
corpus's shards dealt to the workers first, :func:`worker_share`), shuffles them in a buffer and packs blocks as it
goes. The stream never ends (each pass reshuffled), so every rank can always take another step and the run stops at
the Trainer's ``max_steps``; a resumed run reads the trained batches again and drops them, as the in-memory loader
does, which needs the checkpoint's count of loader workers (their batches take turns). A document is held out for
validation by a seeded hash of its text, which needs no count of the corpus and sends a duplicated document to the
same side; every rank validates on all held-out documents.

Too little text for two blocks, or for a training batch on each rank, is refused in ``setup`` and when the training
loader is made, not in the constructor: counting the tokens means reading and tokenising the whole corpus, which
``merak-train``'s launcher would then do once more before the ranks do. So is a file ``datasets`` cannot parse (bad
JSON, bytes that are not UTF-8, a damaged parquet file) where it is first read (the constructor reads the first
records): a :class:`DataError` naming the file, the line where one can be found, and the fix (:class:`Corpus`).
A text column that holds neither text nor lists of integer token ids is refused in the constructor, token ids
outside the tokenizer's vocabulary where they are read.
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

import pyarrow as pa
import torch
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset as TorchIterableDataset

from lightning_merak.modules.config import DataError
from lightning_merak.modules.data import (
    DataFileNotFound,
    ResumableDataLoader,
    TokenDataModule,
    block_count,
    checked_token_ids,
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

__all__ = ["FORMATS", "Corpus", "HFDatasetData", "PackedStream", "held_out", "resolve_format", "streaming_loop_problem",
           "text_column_problem", "worker_share"]

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


def _text_or_token_ids(feature: Any) -> bool:
    """Whether a column of ``feature`` holds documents: strings, or lists of integer token ids."""
    if isinstance(feature, datasets.Value):
        return pa.types.is_string(feature.pa_type) or pa.types.is_large_string(feature.pa_type)
    ids = getattr(feature, "feature", None)  # List, LargeList and Sequence name their items' feature
    return isinstance(ids, datasets.Value) and pa.types.is_integer(ids.pa_type)


def text_column_problem(documents: datasets.Dataset | datasets.IterableDataset, corpus: Corpus) -> Optional[str]:
    """Why the text column cannot be tokenised, from its type (a reader that infers the columns while reading, as
    csv's does: from the first record's value); None where it holds text or token ids. Refused before any rank
    starts: tokenising would otherwise fail after launch, or turn a number or a dict into its text and train on it."""
    features = documents.features
    if features is not None and corpus.text_field in features:
        feature = features[corpus.text_field]
        if _text_or_token_ids(feature):
            return None
        holds = f"{feature} values"
    else:
        with corpus.reading():
            first = next(iter(documents.take(1)), {})
        value = first.get(corpus.text_field)
        if value is None or isinstance(value, (str, list)):  # a list's ids are checked as they are read
            return None
        holds = f"{type(value).__name__} values such as {value!r}"
        if corpus.data_format == "csv":
            holds += " (datasets reads a csv column of numbers alone as numbers)"
    return (f"{corpus.source}: column {corpus.text_field!r} holds {holds}, neither text (strings) nor token ids "
            "(lists of integers); set data.text_field to the column of text or token ids, or convert this one to "
            "text first")


SHORT_CORPUS_RECORD_BUDGET = 10_000


def refuse_short_corpus(documents: Any, corpus: Corpus, encode: Callable[[str], list[int]],
                        eos_token_id: Optional[int], vocab_size: int, seq_len: int) -> None:
    """Refuse a corpus of fewer than two blocks of ``seq_len`` tokens (the rank-side :func:`block_count`'s refusal)
    before the ranks start. Reads records only until two blocks' worth is seen, or ``SHORT_CORPUS_RECORD_BUDGET``
    records (the rank-side count judges the rest), so a large corpus costs a few records here."""
    seen = 0
    try:
        for read, tokens in enumerate(_token_lists(documents, corpus, encode, eos_token_id, vocab_size), start=1):
            seen += len(tokens)
            if seen >= 2 * seq_len or read >= SHORT_CORPUS_RECORD_BUDGET:
                return
    except DataError:  # a bad record is refused, with its own wording, where the records are read for training
        return
    block_count(seen, seq_len, corpus.source)


def held_out(document: Any, seed: int, val_fraction: float) -> bool:
    """Whether a streamed document belongs to validation: a seeded hash of its text below ``val_fraction``."""
    digest = hashlib.blake2b(f"{seed}\0{document}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def _on_side(record: dict[str, Any], text_field: str, seed: int, val_fraction: float, validation: bool) -> bool:
    text = record[text_field]  # a csv's empty cell (null) is the empty text, as in the other formats
    return held_out("" if text is None else text, seed, val_fraction) == validation


def _record_batches(documents: Any, corpus: Corpus) -> Iterator[dict[str, list[Any]]]:
    """The records in batches of :data:`READ_BATCH`, what ``datasets`` cannot parse refused as it is read."""
    batches = iter(documents.iter(batch_size=READ_BATCH))
    while True:
        with corpus.reading():
            batch = next(batches, None)
        if batch is None:
            return
        yield batch


def _token_lists(documents: Any, corpus: Corpus, encode: Callable[[str], list[int]], eos_token_id: Optional[int],
                 vocab_size: int, numbered: bool = True) -> Iterator[list[int]]:
    """Each record's token ids, read in batches of records: text encoded and ended by the end-of-text id, a list of
    ids checked against the ``vocab_size`` of the tokenizer. A null is skipped, except a csv's empty cell, the empty
    text (a lone end-of-text id, as an empty string is in the other formats). ``numbered``: errors name a record
    by its place in the split's read order (not in a shuffled stream)."""
    field = corpus.text_field
    for start, batch in enumerate(_record_batches(documents, corpus)):
        for offset, document in enumerate(batch[field]):
            if document is None and corpus.data_format == "csv":
                document = ""
            if isinstance(document, str):
                yield document_tokens(document, encode, eos_token_id)
                continue
            if document is None:
                continue
            where = (f"{corpus.source} record {start * READ_BATCH + offset + 1} (column {field!r})" if numbered
                     else f"{corpus.source}: a streamed record's column {field!r}")
            if not isinstance(document, list):  # csv types each chunk of rows apart: numbers past the first
                raise DataError(f"{where} holds {type(document).__name__} {repr(document)[:40]}, neither text nor a "
                                "list of token ids; set data.text_field to the column of text or token ids, or fix "
                                "or drop that record")
            yield checked_token_ids(document, vocab_size, where)


def streaming_loop_problem(max_steps: int, val_check_interval: Any, limit_train_batches: Any, validates: bool,
                           fast_dev_run: Any = False) -> Optional[str]:
    """Why a Trainer loop of these settings would train a stream (``streaming=True``) wrongly, or None. The stream
    never ends, so neither does an epoch: what waits for an epoch's end never happens, and an epoch cut short by
    ``limit_train_batches`` restarts the stream at the head of a fresh pass. Checked by ``merak-train`` before
    launch (``val_check_interval`` None there is Lightning's once-per-epoch float) and in each rank's ``setup``."""
    if fast_dev_run:  # one short epoch, its batches bounded
        return None
    if max_steps < 0:
        return ("data.streaming=true reads an endless stream (each pass reshuffled), so an epoch never ends: set the "
                "Trainer's max_steps (trainer.max_steps) and an integer val_check_interval")
    if isinstance(limit_train_batches, int) and not isinstance(limit_train_batches, bool):
        return (f"data.streaming=true with the Trainer's limit_train_batches={limit_train_batches} "
                "(trainer.limit_train_batches): each epoch would restart the stream at the head of a freshly shuffled "
                f"pass, so only the first {limit_train_batches} batches of every pass would train; bound the run by "
                "max_steps (trainer.max_steps) alone, or set data.streaming=false")
    if validates and not (isinstance(val_check_interval, int) and not isinstance(val_check_interval, bool)):
        shown = "null" if val_check_interval is None else val_check_interval
        return (f"data.streaming=true with the Trainer's val_check_interval={shown} (trainer.val_check_interval) "
                "validates when an epoch ends, and a stream's epoch never ends, so validation would never run: set "
                "val_check_interval to an integer number of steps (or limit_val_batches=0 not to validate)")
    return None


def worker_share(documents: datasets.IterableDataset) -> datasets.IterableDataset:
    """The documents this DataLoader worker reads: every ``num_workers``-th shard of the corpus, then the rank's part of
    those (``split_dataset_by_node`` splits at iteration, below this); all of them outside a worker. ``datasets``'
    batched reading (``iter(batch_size=...)``) does not split among workers as its ``__iter__`` does, so without this
    each worker would read, and train, every document of the rank's share. Every rank deals the shards alike."""
    worker = torch.utils.data.get_worker_info()
    if worker is None or worker.num_workers == 1:
        return documents
    return documents.shard(num_shards=worker.num_workers, index=worker.id, contiguous=False)


class PackedStream(TorchIterableDataset):
    """Blocks of ``seq_len`` ids packed from a document stream as it is read, one pass or endlessly.

    ``set_epoch`` numbers the first pass; each pass reshuffles the documents (``datasets`` seeds its shuffle
    with the seed plus the pass), and tokens left over at a pass's end open the next one. Read by DataLoader
    workers, each packs its own share of the documents. Token ids in the corpus are checked against ``vocab_size``.
    """

    def __init__(self, documents: datasets.IterableDataset, corpus: Corpus, encode: Callable[[str], list[int]],
                 eos_token_id: Optional[int], vocab_size: int, seq_len: int, endless: bool, shares: int = 1) -> None:
        super().__init__()
        self.documents, self.corpus, self.seq_len, self.endless = documents, corpus, seq_len, endless
        self.encode, self.eos_token_id, self.vocab_size = encode, eos_token_id, vocab_size
        self.shares = shares
        """The data-parallel shares the documents are split into (this stream reads one): what a resumed run's
        trained batch count means."""
        self.first_pass = 0

    def set_epoch(self, epoch: int) -> None:
        self.first_pass = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor]]:
        buffer: list[int] = []
        documents = worker_share(self.documents)
        for pass_number in itertools.count(self.first_pass) if self.endless else (self.first_pass,):
            documents.set_epoch(pass_number)
            read_any = False
            for tokens in _token_lists(documents, self.corpus, self.encode, self.eos_token_id, self.vocab_size,
                                       numbered=False):
                read_any = True
                buffer.extend(tokens)
                while len(buffer) >= self.seq_len:
                    yield (torch.tensor(buffer[:self.seq_len], dtype=torch.long),)
                    del buffer[:self.seq_len]
            if self.endless and not read_any:  # an empty share would loop forever without a batch
                raise DataError(f"{self.corpus.source}: this rank's share of the training documents is empty; use more "
                                 "documents, fewer ranks or data.num_workers, or a smaller data.val_fraction")


class _StreamLoader(ResumableDataLoader):
    """A training stream's loader: its state also holds how many processes read the stream. Each worker packs its
    own share and their batches take turns, so a trained batch count means other batches at another count: a
    resume there is refused (a stream's pass never ends, so every resume skips batches)."""

    @property
    def readers(self) -> int:
        """The processes reading the stream: the loader's workers, or the loader itself."""
        return max(1, self.num_workers)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "readers": self.readers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        readers, now = state.get("readers", self.readers), self.readers  # older checkpoints: unchecked
        if readers != now and state["batches"] > 0:
            raise DataError(f"the checkpoint's run read each rank's stream in {readers} loader worker share(s), this "
                            f"run reads it in {now} (data.num_workers, at most the share's shards): their batches take "
                            f"turns, so skipping its {state['batches']} trained batches would skip other documents "
                            "than it trained. Resume with the checkpoint's data.num_workers, or start a new run from "
                            "its weights (merak-export, then model.path)")
        super().load_state_dict(state)


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
        problem = text_column_problem(self.documents, self.corpus)
        if problem is not None:
            raise DataError(problem)
        if lengths == "fixed" and not streaming:  # a stream is read by the ranks alone
            refuse_short_corpus(self.documents, self.corpus, self._encode, self._eos, self.vocab_size, seq_len)

    @property
    def source(self) -> str:
        """How errors name the data."""
        return self.corpus.source

    def describe_training_split(self, train_count: int, held_out: int) -> tuple[str, str]:
        if self.lengths == "fixed":
            return packed_split(self.source, train_count, held_out, self.seq_len, self.val_fraction)
        return super().describe_training_split(train_count, held_out)

    def build_samples(self) -> tuple[Any, Any]:
        token_lists = _token_lists(self.documents, self.corpus, self._encode, self._eos, self.vocab_size)
        if self.lengths == "variable":
            return variable_samples(token_lists, self.max_length, self.batch_size, self.val_fraction, self.seed,
                                    self.source)
        return packed_blocks(token_lists, self.seq_len, self.val_fraction, self.seed, self.source)

    def setup(self, stage: str) -> None:
        if not self.streaming:
            super().setup(stage)
        elif self.trainer is not None:
            problem = streaming_loop_problem(self.trainer.max_steps, self.trainer.val_check_interval,
                                             self.trainer.limit_train_batches, self.trainer.limit_val_batches != 0,
                                             self.trainer.fast_dev_run)
            if problem is not None:
                raise ValueError(problem)

    def _stream(self, validation: bool) -> datasets.IterableDataset:
        """The documents of one side of the split, as a stream, with only the text column read."""
        documents = self.documents
        if isinstance(documents, datasets.Dataset):
            documents = documents.to_iterable_dataset(num_shards=max(1, min(len(documents), DISK_SHARDS)))
        on_side = functools.partial(_on_side, text_field=self.text_field, seed=self.seed,
                                    val_fraction=self.val_fraction, validation=validation)
        return documents.select_columns([self.text_field]).filter(on_side)

    def _packed(self, documents: datasets.IterableDataset, endless: bool, shares: int = 1) -> PackedStream:
        return PackedStream(documents, self.corpus, self._encode, self._eos, self.vocab_size, self.seq_len, endless,
                            shares)

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
        # At most a worker per shard of the rank's share: a worker beyond the corpus's shards would read nothing.
        return self.resumable_loader(stream, num_workers=min(self.num_workers, stream.documents.num_shards),
                                     loader=_StreamLoader)

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
