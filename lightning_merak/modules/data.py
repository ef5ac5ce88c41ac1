"""Training data for ``merak-train``: a generated language, or the user's own text.

The generated language is a first-order Markov chain in which every token has only a
few likely successors. A model that learns the transition table reaches the chain's
entropy rate, which :attr:`SyntheticLanguage.entropy_rate` reports, so the loss falls
visibly from ``ln(vocab_size)`` towards a known floor. Nothing is downloaded.

User data is a ``.txt`` file (one document) or a ``.jsonl`` file (one JSON object per
line, text under ``text_field``), tokenized with a tokenizer loaded from local files or,
without one, with a byte-level tokenizer (256 byte values plus an end-of-text token). A file that is missing, not
UTF-8, not JSON lines or holding token ids outside the tokenizer's vocabulary is refused in the constructor, naming the
file, the line and the fix; where the token counts are known without tokenising (the byte-level tokenizer, or token
ids in the file), so are too few blocks or documents for the run, before ``merak-train`` launches any rank. With a
tokenizer those checks wait for ``setup``: the launcher would otherwise tokenise the whole corpus once more.
Generated sequences too few for a batch on each data-parallel rank are refused by
:meth:`LanguageModelingData.check_before_launch`, which ``merak-train`` calls.

:class:`TokenDataModule` and the functions that cut documents into blocks or samples are shared with
:class:`~lightning_merak.modules.hf_data.HFDatasetData`, so every source is split and resumed the same way.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_merak.modules.config import DataConfig, DataError
from lightning_merak.modules.resumable import ResumableDataLoader
from lightning_merak.modules.text_files import (
    DataFileNotFound,
    MissingTextField,
    checked_token_ids,
    load_text_documents,
)
from lightning_merak.parallel.micro_batching.samples import (
    check_consumer,
    global_batch_loader,
    synthetic_samples,
    token_samples,
)

__all__ = [
    "ByteTokenizer",
    "DataFileNotFound",
    "LanguageModelingData",
    "MissingTextField",
    "ResumableDataLoader",
    "SyntheticLanguage",
    "SyntheticSequences",
    "TokenDataModule",
    "checked_token_ids",
    "check_training_batches",
    "document_tokens",
    "load_text_documents",
    "load_tokenizer",
    "packed_blocks",
    "packed_split",
    "variable_samples",
]

DATA_NAMES = ("synthetic", "text")

PACKED_DATA_FIX = "use more data, a smaller data.batch_size or data.seq_len, or a smaller data.val_fraction"
"""How to get more training blocks out of packed documents, for the refusals of too few."""


class SyntheticLanguage:
    """A seeded Markov chain over ``vocab_size`` tokens with ``branching`` successors each."""

    def __init__(self, vocab_size: int, branching: int, seed: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"data.vocab_size must be at least 2, got {vocab_size}")
        if not 1 <= branching <= vocab_size:
            raise ValueError(
                f"data.branching={branching} must lie in [1, vocab_size={vocab_size}]"
            )
        generator = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.successors = torch.stack(
            [torch.randperm(vocab_size, generator=generator)[:branching] for _ in range(vocab_size)]
        )
        self.successor_probs = torch.softmax(
            torch.randn(vocab_size, branching, generator=generator) * 1.5, dim=-1
        )
        self._seed = seed
        # the chain's tables as plain lists: :meth:`sequence` steps token by token
        self._successor_lists: list[list[int]] = self.successors.tolist()
        self._thresholds: list[list[float]] = self.successor_probs.double().cumsum(-1)[:, :-1].tolist()

    @property
    def entropy_rate(self) -> float:
        """Expected next-token entropy in nats under a uniform start distribution."""
        probs = self.successor_probs
        return float(-(probs * probs.log()).sum(-1).mean())

    def sequence(self, index: int, length: int, seed_offset: int = 0) -> torch.Tensor:
        """Sequence ``index`` of the set ``seed_offset`` names, ``length`` token ids (int64).

        Drawn from a generator seeded by ``(seed, seed_offset, index)`` alone, so a rank reads any sequence
        without generating those before it, and every rank reads the same tokens at an index. A shorter
        ``length`` gives a prefix of the longer sequence. One Python step per token: a chain is sequential, and
        a step on plain ints costs a fraction of a microsecond where a tensor operation costs several.
        """
        if index < 0 or length < 1:
            raise ValueError(f"a synthetic sequence needs index >= 0 and length >= 1, got {index} and {length}")
        generator = torch.Generator().manual_seed(mixed_seed(self._seed, seed_offset, index))
        draws = torch.rand(length, dtype=torch.float64, generator=generator).tolist()
        token = min(int(draws[0] * self.vocab_size), self.vocab_size - 1)
        tokens = [token]
        thresholds, successors = self._thresholds, self._successor_lists
        for draw in draws[1:]:
            token = successors[token][bisect_right(thresholds[token], draw)]
            tokens.append(token)
        return torch.tensor(tokens, dtype=torch.long)

    def sample(self, num_sequences: int, seq_len: int, seed_offset: int = 0) -> torch.Tensor:
        """Sequences ``0 .. num_sequences - 1`` of :meth:`sequence`, ``(num_sequences, seq_len)`` token ids."""
        return torch.stack([self.sequence(index, seq_len, seed_offset) for index in range(num_sequences)])


_MASK64 = (1 << 64) - 1


def mixed_seed(*values: int) -> int:
    """A 63-bit generator seed from ``values`` by SplitMix64 steps: tuples that differ in any value (neighbouring
    indices, another seed offset) give unrelated streams, where a sum of them would collide."""
    state = 0
    for value in values:
        state = (state + value + 0x9E3779B97F4A7C15) & _MASK64
        state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK64
        state ^= state >> 31
    return state >> 1


class SyntheticSequences(Dataset):
    """``count`` sequences of ``seq_len`` tokens of a :class:`SyntheticLanguage`, each generated when read.

    Nothing is generated at setup: a rank pays for the samples its loader reads (at 16k tokens, materialising
    the default 8192 sequences took a minute per process). Items are ``(tokens,)`` like a ``TensorDataset``'s.
    """

    def __init__(self, language: SyntheticLanguage, count: int, seq_len: int, seed_offset: int = 0) -> None:
        if count < 1 or seq_len < 1:
            raise ValueError(f"SyntheticSequences needs count >= 1 and seq_len >= 1, got {count} and {seq_len}")
        self.language, self.count, self.seq_len, self.seed_offset = language, count, seq_len, seed_offset

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        if not -self.count <= index < self.count:
            raise IndexError(f"sequence {index} of {self.count}")
        return (self.language.sequence(index % self.count, self.seq_len, self.seed_offset),)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, with id 256 ending each document."""

    eos_token_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def load_tokenizer(tokenizer_path: Optional[str]) -> tuple[Callable[[str], list[int]], int, Optional[int]]:
    """Return ``(encode, vocab_size, eos_token_id)`` for a local tokenizer or the byte fallback; a tokenizer without an
    end-of-text token is said, not refused (its documents run together; a pre-tokenised corpus needs none)."""
    if tokenizer_path is None:
        byte_tokenizer = ByteTokenizer()
        return byte_tokenizer.encode, byte_tokenizer.vocab_size, byte_tokenizer.eos_token_id
    path = Path(tokenizer_path).expanduser()
    if not path.is_dir():
        raise DataFileNotFound(
            f"data.tokenizer_path={tokenizer_path!r} is not a directory; point it at a folder "
            "holding tokenizer files (tokenizer.json / tokenizer_config.json), or leave it "
            "unset to use the byte-level tokenizer"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as error:
        raise DataError(f"data.tokenizer_path={tokenizer_path!r} holds no tokenizer transformers can load ({error}); "
                        "point it at a save_pretrained tokenizer folder, or leave it unset to use the byte-level "
                        "tokenizer") from error

    if tokenizer.eos_token_id is None:
        rank_zero_warn(f"data.tokenizer_path={tokenizer_path!r} has no end-of-text token (eos_token), so text "
                       "documents are put back to back with no id between them, as transformers' run_clm example "
                       "packs them; to end each with an end-of-text id, give the tokenizer an eos_token "
                       "(tokenizer_config.json's \"eos_token\", or tokenizer.add_special_tokens({'eos_token': ...}) "
                       "and save_pretrained)")

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return encode, len(tokenizer), tokenizer.eos_token_id


def document_tokens(document: Any, encode: Callable[[str], list[int]], eos_token_id: Optional[int]) -> list[int]:
    """A document's token ids: text encoded and ended with the end-of-text id, or a list of ids (an already
    tokenised corpus) used as it is."""
    if isinstance(document, list):
        return document
    return encode(str(document)) + ([eos_token_id] if eos_token_id is not None else [])


def known_token_counts(documents: Sequence[Any], byte_level: bool) -> Optional[list[int]]:
    """Each document's token count as :func:`document_tokens` will give it, where that needs no tokenising: a list
    of ids is its own length, and with the byte-level tokenizer a text is its UTF-8 bytes and the end id. None where
    a tokenizer has to run."""
    counts = []
    for document in documents:
        if isinstance(document, list):
            counts.append(len(document))
        elif byte_level:
            counts.append(len(str(document).encode("utf-8")) + 1)
        else:
            return None
    return counts


def block_count(token_count: int, seq_len: int, source: str) -> int:
    """Blocks of ``seq_len`` in ``token_count`` packed tokens; refused below two (a training and a validation one)."""
    blocks = token_count // seq_len
    if blocks < 2:
        raise DataError(f"{source} yields {token_count} tokens, fewer than two blocks of data.seq_len={seq_len}; "
                        "use more data or a smaller seq_len")
    return blocks


def validation_block_count(num_blocks: int, val_fraction: float) -> int:
    """Blocks held out for validation: ``val_fraction`` of them, rounded up, at least one."""
    return max(1, math.ceil(num_blocks * val_fraction))


def packed_split(source: str, train_blocks: int, held_out: int, seq_len: int,
                 val_fraction: float) -> tuple[str, str]:
    """The terms of :func:`check_training_batches` for blocks packed from documents."""
    return (f"{source} makes {train_blocks + held_out} blocks of data.seq_len={seq_len}, {train_blocks} for training "
            f"once data.val_fraction={val_fraction} holds out {held_out}", PACKED_DATA_FIX)


def check_training_batches(train_count: int, batch_size: int, replicas: int, split: str, fix: str) -> None:
    """Refuse a training set that gives a data-parallel rank no full batch: its loader drops the partial one, so
    Lightning would train no step ("No training batches") and the run would end as done, untrained.

    ``replicas``: the ranks a distributed sampler splits the set over, each reading ``ceil(train_count / replicas)``
    samples (1 where every rank reads every global batch); ``split`` says what the set is, ``fix`` how to enlarge it.
    """
    per_rank = math.ceil(train_count / replicas)
    if per_rank >= batch_size:
        return
    if replicas > 1:
        split = f"{split}, {per_rank} for each of {replicas} data-parallel ranks"
        fix = f"{fix}; or train on fewer data-parallel ranks"
    raise DataError(f"{split}: fewer than one batch of data.batch_size={batch_size}"
                    f"{' per rank' if replicas > 1 else ''}, so nothing would train; {fix}")


def variable_validation_count(sample_count: int, batch_size: int, val_fraction: float, source: str) -> int:
    """Samples held out for validation with ``lengths=variable`` (``val_fraction``, at least one global batch);
    refused unless a training global batch is left too."""
    num_val = max(batch_size, math.ceil(sample_count * val_fraction))
    if sample_count < num_val + batch_size:
        raise DataError(f"{source} has {sample_count} samples (documents of 2 tokens or more), too few for a "
                        f"validation and a training global batch of data.batch_size={batch_size}: that takes "
                        f"{num_val + batch_size} (data.val_fraction={val_fraction} holds out {num_val}, at least one "
                        "global batch); use more documents or a smaller data.batch_size")
    return num_val


def packed_blocks(token_lists: Iterable[Sequence[int]], seq_len: int, val_fraction: float, seed: int,
                  source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(training, validation)`` blocks of ``seq_len`` ids: the documents back to back, cut into blocks, and a
    seeded ``val_fraction`` of the blocks held out. ``source`` names the data in errors (``data.path='...'``)."""
    token_ids: list[int] = []
    for tokens in token_lists:
        token_ids.extend(tokens)
    num_blocks = block_count(len(token_ids), seq_len, source)
    blocks = torch.tensor(token_ids[:num_blocks * seq_len], dtype=torch.long).view(-1, seq_len)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    num_val = validation_block_count(num_blocks, val_fraction)
    return blocks[order[num_val:]], blocks[order[:num_val]]


def variable_samples(token_lists: Iterable[Sequence[int]], max_length: int, batch_size: int, val_fraction: float,
                     seed: int, source: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(training, validation)`` samples of their own lengths (one per document, cut to ``max_length``), a seeded
    ``val_fraction`` of them (at least one global batch) held out."""
    samples = token_samples(list(token_lists), max_length)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    num_val = variable_validation_count(len(samples), batch_size, val_fraction, source)
    return [samples[i] for i in order[num_val:]], [samples[i] for i in order[:num_val]]


class TokenDataModule(pl.LightningDataModule):
    """Training and validation samples of token ids behind the loaders every data module here shares.

    ``lengths="fixed"``: blocks of token ids; ``"variable"``: samples of their own lengths in global batches
    (:class:`~lightning_merak.parallel.micro_batching.VariableBatch`) for merak3d's ``micro_batching``. Either way
    the training loader is a :class:`ResumableDataLoader` (mid-epoch resume). A subclass
    sets ``vocab_size`` in its constructor (so the model can be built to match before the data is materialised)
    and returns its two sets from :meth:`build_samples`. Under a distributed strategy Lightning inserts the
    distributed sampler, so each data-parallel rank sees its own share of the blocks; a share without one full batch
    is refused when the training loader is made (:func:`check_training_batches`), where the share is known.
    """

    vocab_size: int

    def __init__(self, batch_size: int, lengths: str, num_workers: int, seed: int) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be at least 1, got {batch_size}")
        if lengths not in ("fixed", "variable"):
            raise ValueError(f"data.lengths={lengths!r}; choose fixed (blocks of seq_len) or variable")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be at least 0, got {num_workers}")
        self.batch_size, self.lengths, self.num_workers, self.seed = batch_size, lengths, num_workers, seed
        self.train_set: Optional[Dataset | list[torch.Tensor]] = None
        self.val_set: Optional[Dataset | list[torch.Tensor]] = None

    def build_samples(self) -> tuple[Any, Any]:
        """``(training, validation)``: with fixed lengths, block tensors ``(n, seq_len)`` or datasets of ``(block,)``
        items; with variable ones, lists of 1-D samples."""
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        if self.lengths == "variable" and self.trainer is not None:
            check_consumer(self.trainer.strategy)
        train, val = self.build_samples()
        if self.lengths == "fixed" and isinstance(train, torch.Tensor):
            train, val = TensorDataset(train), TensorDataset(val)
        self.train_set, self.val_set = train, val

    def _epoch(self) -> Optional[int]:
        return None if self.trainer is None else self.trainer.current_epoch

    def _trained_batches(self) -> int:
        """Batches of the current epoch the fit loop has trained (0 outside a fit)."""
        trainer = self.trainer
        return 0 if trainer is None else trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def resumable_loader(self, dataset: Dataset, num_workers: Optional[int] = None,
                         loader: type[ResumableDataLoader] = ResumableDataLoader, **kwargs: Any) -> ResumableDataLoader:
        """A training loader of ``dataset`` in batches of ``batch_size`` that resumes where the fit loop stopped
        (``num_workers``: ``data.num_workers`` unless the dataset can feed fewer; ``loader``: a subclass that saves
        more of its state)."""
        return loader(dataset, batch_size=self.batch_size,
                      num_workers=self.num_workers if num_workers is None else num_workers,
                      **self._resume_arguments(), **kwargs)

    def _batches_per_pass(self) -> Optional[int]:
        """Batches the fit loop trains an epoch, ``trainer.limit_train_batches`` applied (an int or a fraction of the
        loader); None outside a fit or before the loader is counted (Lightning holds infinity then)."""
        batches = None if self.trainer is None else self.trainer.num_training_batches
        return int(batches) if batches is not None and math.isfinite(batches) else None

    def _resume_arguments(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "trained_batches": self._trained_batches, "shuffle_seed": self.seed,
                "next_pass_epoch": self.align_loops_after_finished_pass,
                "batches_per_pass": self._batches_per_pass}

    def align_loops_after_finished_pass(self) -> Optional[int]:
        """Make the fit loop agree with a restored loader whose pass is finished, and give the epoch in which it begins
        the next pass; None where the loop first closes the finished pass's epoch (the loader then yields nothing
        for it). Asked by the loader only under a fit.

        Under ``max_steps`` Lightning 2.x restarts the epoch loop with the finished epoch's batch counters (so that an
        epoch ``max_steps`` cut short continues). A checkpoint written between epochs (``Trainer.save_checkpoint``
        once ``max_steps`` stopped the run at a pass's end, as ``merak-train``'s final.ckpt) would have it count the
        next pass's first batch as the closed epoch's last, or train none, and begin the pass after: here the next
        epoch begins afresh instead, as Lightning does without ``max_steps``. A checkpoint of the epoch's end
        (``on_train_epoch_end``) has it close the epoch again before the next; one of the last batch's end has it
        begin the next epoch itself, but only once the loader is open: the next pass's epoch is not yet the
        trainer's ``current_epoch`` then.
        """
        assert self.trainer is not None, "asked only under a fit"
        fit_loop = self.trainer.fit_loop
        epochs = fit_loop.epoch_progress.current
        if epochs.processed > epochs.completed:
            return None
        if epochs.ready == epochs.started == epochs.processed == epochs.completed:
            fit_loop.epoch_loop.restarting = False  # its reset() then starts the batch counters at 0
        return epochs.started  # the epochs begun, the finished pass's the last: the next pass's epoch index

    def describe_training_split(self, train_count: int, held_out: int) -> tuple[str, str]:
        """``(what the training set is, how to enlarge it)``: the terms of :func:`check_training_batches`."""
        return (f"the data has {train_count} training samples ({held_out} held out for validation)",
                "use more data or a smaller data.batch_size")

    def _sampler_replicas(self) -> int:
        """Ranks Lightning's distributed sampler splits the training blocks over: 1 where it inserts none (no
        trainer, one process, or ``use_distributed_sampler=False``, which only the connector holds)."""
        trainer = self.trainer
        connector = getattr(trainer, "_accelerator_connector", None)  # private in Lightning 2.x: feature-detected
        if trainer is None or not getattr(connector, "use_distributed_sampler", True):
            return 1
        sampler_kwargs = trainer.distributed_sampler_kwargs
        return int(sampler_kwargs["num_replicas"]) if sampler_kwargs else 1

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() must run before the data loaders are requested"
        assert self.val_set is not None
        # every rank reads every global batch of variable lengths; blocks are split over the data-parallel ranks
        replicas = 1 if self.lengths == "variable" else self._sampler_replicas()
        check_training_batches(len(self.train_set), self.batch_size, replicas,
                               *self.describe_training_split(len(self.train_set), len(self.val_set)))
        if self.lengths == "variable":  # global batches resume mid-epoch as blocks do
            return global_batch_loader(self.train_set, self.batch_size, self.seed, shuffle=True,
                                       loader_class=ResumableDataLoader, **self._resume_arguments())
        return self.resumable_loader(self.train_set, shuffle=True, drop_last=True, generator=torch.Generator())

    def val_dataloader(self) -> DataLoader:
        """Full batches only: a pipeline splits every batch into a fixed number of micro-batches."""
        assert self.val_set is not None, "setup() must run before the data loaders are requested"
        if self.lengths == "variable":
            return global_batch_loader(self.val_set, self.batch_size, self.seed, shuffle=False)
        replicas = self._sampler_replicas()
        per_rank = math.ceil(len(self.val_set) / replicas)
        validates = getattr(self.trainer, "limit_val_batches", 1) != 0
        if validates and per_rank < self.batch_size:  # said, not refused: validation is optional, training is not
            needed = self.batch_size * replicas / (len(self.val_set) + len(self.train_set))
            rank_zero_warn(f"the validation set has {len(self.val_set)} samples, {per_rank} per data-parallel rank: "
                           f"fewer than one batch of data.batch_size={self.batch_size}, so validation runs no batch "
                           f"and logs no val/loss; raise data.val_fraction (about {needed:.2g} holds out a batch "
                           "per rank) or lower data.batch_size")
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.num_workers)


class LanguageModelingData(TokenDataModule):
    """``merak-train``'s ``synthetic`` and ``text`` data (:class:`DataConfig`): blocks of ``seq_len`` token ids for
    causal language modelling, or (``lengths="variable"``) samples of their own lengths; see
    :class:`TokenDataModule`."""

    def __init__(self, config: DataConfig) -> None:
        if config.name not in DATA_NAMES:
            raise ValueError(f"unknown data {config.name!r}; choose one of {', '.join(DATA_NAMES)}")
        if config.seq_len < 2:
            raise ValueError(f"data.seq_len must be at least 2, got {config.seq_len}")
        if config.lengths == "variable" and config.max_length < 2:
            raise ValueError(f"data.max_length={config.max_length} with data.lengths=variable must be at least 2 "
                             "(a sample of fewer tokens has no next token to learn): raise data.max_length")
        if not 0.0 < config.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must lie in (0, 1), got {config.val_fraction}")
        super().__init__(config.batch_size, config.lengths, config.num_workers, config.seed)
        self.config = config
        self.language: Optional[SyntheticLanguage] = None
        self._documents: list[Any] = []
        if config.name == "synthetic":
            self.language = SyntheticLanguage(config.vocab_size, config.branching, config.seed)
            self.vocab_size = config.vocab_size
        else:
            if config.path is None:
                raise ValueError("data=text needs data.path=/path/to/file.txt or .jsonl")
            self._encode, self.vocab_size, self._eos = load_tokenizer(config.tokenizer_path)
            self._documents = load_text_documents(config.path, config.text_field, self.vocab_size)
            token_counts = known_token_counts(self._documents, byte_level=config.tokenizer_path is None)
            if token_counts is not None:  # build_samples' checks, before merak-train launches any rank
                self._check_token_counts(token_counts)

    @property
    def source(self) -> str:
        """How errors name the data."""
        return "data=synthetic" if self.language is not None else f"data.path={self.config.path!r}"

    def _check_token_counts(self, token_counts: list[int]) -> None:
        """Refuse what :meth:`build_samples` and a single rank's training loader would, from each document's token
        count: the data-parallel share is checked again when the loader is made."""
        config = self.config
        if self.lengths == "variable":
            variable_validation_count(sum(count >= 2 for count in token_counts), config.batch_size,
                                      config.val_fraction, self.source)
            return
        num_blocks = block_count(sum(token_counts), config.seq_len, self.source)
        held_out = validation_block_count(num_blocks, config.val_fraction)
        check_training_batches(num_blocks - held_out, config.batch_size, 1,
                               *self.describe_training_split(num_blocks - held_out, held_out))

    def check_before_launch(self, data_parallel: int) -> None:
        """Refuse what the training loader of each rank would once the ranks run, where the count is a setting:
        generated sequences too few for a batch on each of the ``data_parallel`` ranks a distributed sampler will
        split them over (1 where that is not known before launch; variable lengths: every rank reads each global
        batch)."""
        if self.language is None:
            return
        replicas = 1 if self.lengths == "variable" else data_parallel
        check_training_batches(self.config.num_sequences, self.batch_size, replicas,
                               *self.describe_training_split(self.config.num_sequences, 0))

    def describe_training_split(self, train_count: int, held_out: int) -> tuple[str, str]:
        if self.language is not None:
            return (f"data=synthetic has data.num_sequences={train_count} training sequences",
                    "raise data.num_sequences or lower data.batch_size")
        if self.lengths == "fixed":
            return packed_split(self.source, train_count, held_out, self.config.seq_len, self.config.val_fraction)
        return super().describe_training_split(train_count, held_out)

    def build_samples(self) -> tuple[Any, Any]:
        if self.language is not None:
            return self._synthetic_samples(self.language)
        config = self.config
        token_lists = (document_tokens(document, self._encode, self._eos) for document in self._documents)
        if self.lengths == "variable":
            return variable_samples(token_lists, config.max_length, config.batch_size, config.val_fraction,
                                    config.seed, self.source)
        return packed_blocks(token_lists, config.seq_len, config.val_fraction, config.seed, self.source)

    def _synthetic_samples(self, language: SyntheticLanguage) -> tuple[Any, Any]:
        """Generated blocks, or (``lengths=variable``) samples of generated multi-task lengths."""
        config = self.config
        if self.lengths == "variable":
            num_val = max(config.batch_size, int(config.num_sequences * config.val_fraction))
            return (synthetic_samples(language.sequence, config.num_sequences, config.seed, config.max_length),
                    synthetic_samples(lambda index, length: language.sequence(index, length, seed_offset=1),
                                      num_val, config.seed + 1, config.max_length))
        # At least one full validation batch on every rank (the loader drops partial ones).
        world_size = 1 if self.trainer is None else self.trainer.world_size
        num_val = max(config.batch_size * world_size, int(config.num_sequences * config.val_fraction))
        return (SyntheticSequences(language, config.num_sequences, config.seq_len),
                SyntheticSequences(language, num_val, config.seq_len, seed_offset=1))
