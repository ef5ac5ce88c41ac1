"""Training data for ``merak-train``: a generated language, or the user's own text.

The generated language is a first-order Markov chain in which every token has only a
few likely successors. A model that learns the transition table reaches the chain's
entropy rate, which :attr:`SyntheticLanguage.entropy_rate` reports, so the loss falls
visibly from ``ln(vocab_size)`` towards a known floor. Nothing is downloaded.

User data is a ``.txt`` file (one document) or a ``.jsonl`` file (one JSON object per
line, text under ``text_field``), tokenized with a tokenizer loaded from local files or,
without one, with a byte-level tokenizer (256 byte values plus an end-of-text token).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_merak.modules.config import DataConfig
from lightning_merak.parallel.micro_batching.samples import (
    check_consumer,
    global_batch_loader,
    synthetic_samples,
    token_samples,
)

__all__ = [
    "ByteTokenizer",
    "LanguageModelingData",
    "ResumableDataLoader",
    "SyntheticLanguage",
    "load_text_documents",
    "load_tokenizer",
]

DATA_NAMES = ("synthetic", "text")
TEXT_SUFFIXES = (".txt", ".jsonl")


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

    @property
    def entropy_rate(self) -> float:
        """Expected next-token entropy in nats under a uniform start distribution."""
        probs = self.successor_probs
        return float(-(probs * probs.log()).sum(-1).mean())

    def sample(self, num_sequences: int, seq_len: int, seed_offset: int = 0) -> torch.Tensor:
        """``num_sequences`` sequences of ``seq_len`` token ids (int64)."""
        generator = torch.Generator().manual_seed(self._seed + 1 + seed_offset)
        tokens = torch.empty(num_sequences, seq_len, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (num_sequences,), generator=generator)
        for position in range(1, seq_len):
            previous = tokens[:, position - 1]
            choice = torch.multinomial(self.successor_probs[previous], 1, generator=generator)
            tokens[:, position] = self.successors[previous].gather(1, choice).squeeze(1)
        return tokens


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, with id 256 ending each document."""

    eos_token_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def load_tokenizer(tokenizer_path: Optional[str]) -> tuple[Callable[[str], list[int]], int, Optional[int]]:
    """Return ``(encode, vocab_size, eos_token_id)`` for a local tokenizer or the byte fallback."""
    if tokenizer_path is None:
        byte_tokenizer = ByteTokenizer()
        return byte_tokenizer.encode, byte_tokenizer.vocab_size, byte_tokenizer.eos_token_id
    path = Path(tokenizer_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"data.tokenizer_path={tokenizer_path!r} is not a directory; point it at a folder "
            "holding tokenizer files (tokenizer.json / tokenizer_config.json), or leave it "
            "unset to use the byte-level tokenizer"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return encode, len(tokenizer), tokenizer.eos_token_id


def load_text_documents(path: str, text_field: str) -> list[Any]:
    """Read the documents of a ``.txt`` or ``.jsonl`` file, with errors that name the fix."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"data.path={path!r} does not exist; pass an existing .txt or .jsonl file "
            "(e.g. data=text data.path=/abs/path/corpus.txt)"
        )
    if file.suffix not in TEXT_SUFFIXES:
        raise ValueError(
            f"data.path={path!r} has suffix {file.suffix!r}; supported are {', '.join(TEXT_SUFFIXES)}"
        )
    if file.suffix == ".txt":
        return [file.read_text(encoding="utf-8")]
    documents = []
    with file.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if text_field not in record:
                raise KeyError(
                    f"{path}:{line_number} has no field {text_field!r} (fields: {sorted(record)}); "
                    "set data.text_field to the field holding the text"
                )
            value = record[text_field]  # a list of token ids in a tokenised jsonl
            documents.append(value if isinstance(value, list) else str(value))
    return documents


def _chunk(token_ids: list[int], seq_len: int) -> torch.Tensor:
    usable = len(token_ids) // seq_len * seq_len
    return torch.tensor(token_ids[:usable], dtype=torch.long).view(-1, seq_len)


class ResumableDataLoader(DataLoader):
    """A training loader that resumes in the middle of a pass where the interrupted run stopped.

    Each pass over the data is numbered, and its shuffle order depends only on ``shuffle_seed``
    and that number: the loader's generator is reseeded, and a distributed sampler gets the
    number as its epoch. Lightning saves the loader's ``state_dict`` in checkpoints: the pass
    and how many of its batches the loop has trained (``trained_batches()``). On restore the
    run continues that pass (or starts the next one if it was done) and reads and drops the
    batches already trained.

    Passes follow the trainer's epoch (``epoch()``), shifted by what a restore found: Lightning
    counts an epoch as done when ``max_steps`` stops it half-way, and it may open the loader
    more than once for one epoch, so neither its epoch nor the number of passes opened alone
    names the pass. Without a trainer (``epoch()`` is None) every opening is a new pass.
    """

    def __init__(self, *args: Any, epoch: Callable[[], Optional[int]], trained_batches: Callable[[], int],
                 shuffle_seed: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch, self.trained_batches, self.shuffle_seed = epoch, trained_batches, shuffle_seed
        self._openings, self._current_pass = 0, 0
        self._resume: Optional[tuple[int, int]] = None
        self._epoch_shift: Optional[int] = None

    def state_dict(self) -> dict[str, int]:
        return {"pass": self._current_pass, "batches": self.trained_batches()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        finished = state["batches"] >= len(self)
        self._resume = (state["pass"] + finished, 0 if finished else state["batches"])
        self._epoch_shift, self._openings = None, 0

    def _pass_now(self) -> int:
        epoch = self.epoch()
        if epoch is None:
            return self._resume[0] + self._openings if self._resume is not None else self._openings
        if self._epoch_shift is None:
            self._epoch_shift = self._resume[0] - epoch if self._resume is not None else 0
        return epoch + self._epoch_shift

    def __iter__(self) -> Iterator[Any]:
        current = self._pass_now()
        self._openings += 1
        self._current_pass = current
        if self.generator is not None:
            self.generator.manual_seed(self.shuffle_seed + current)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(current)
        batches = super().__iter__()
        if self._resume is not None and self._resume[0] == current:
            for _ in range(self._resume[1]):
                next(batches)
        return batches


class LanguageModelingData(pl.LightningDataModule):
    """Blocks of ``seq_len`` token ids for causal language modelling, or (``lengths="variable"``) samples of their
    own lengths in global batches (:class:`~lightning_merak.parallel.micro_batching.VariableBatch`) for merak3d's
    ``micro_batching``.

    ``vocab_size`` is known right after construction, so the model can be built to match
    before the data is materialised. Under a distributed strategy Lightning inserts the
    distributed sampler, so each data-parallel rank sees its own share.
    """

    def __init__(self, config: DataConfig) -> None:
        super().__init__()
        if config.name not in DATA_NAMES:
            raise ValueError(f"unknown data {config.name!r}; choose one of {', '.join(DATA_NAMES)}")
        if config.seq_len < 2:
            raise ValueError(f"data.seq_len must be at least 2, got {config.seq_len}")
        if config.batch_size < 1:
            raise ValueError(f"data.batch_size must be at least 1, got {config.batch_size}")
        if not 0.0 < config.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must lie in (0, 1), got {config.val_fraction}")
        if config.lengths not in ("fixed", "variable"):
            raise ValueError(f"data.lengths={config.lengths!r}; choose fixed (blocks of seq_len) or variable")
        self.config = config
        self.language: Optional[SyntheticLanguage] = None
        self._documents: list[Any] = []
        if config.name == "synthetic":
            self.language = SyntheticLanguage(config.vocab_size, config.branching, config.seed)
            self.vocab_size = config.vocab_size
        else:
            if config.path is None:
                raise ValueError("data=text needs data.path=/path/to/file.txt or .jsonl")
            self._documents = load_text_documents(config.path, config.text_field)
            self._encode, self.vocab_size, self._eos = load_tokenizer(config.tokenizer_path)
        self.train_set: Optional[Dataset | list[torch.Tensor]] = None
        self.val_set: Optional[Dataset | list[torch.Tensor]] = None

    def _build_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.config
        if self.language is not None:
            # At least one full validation batch on every rank (the loader drops partial ones).
            world_size = 1 if self.trainer is None else self.trainer.world_size
            num_val = max(config.batch_size * world_size, int(config.num_sequences * config.val_fraction))
            return (
                self.language.sample(config.num_sequences, config.seq_len),
                self.language.sample(num_val, config.seq_len, seed_offset=1),
            )
        token_ids: list[int] = []
        for document in self._documents:
            token_ids.extend(self._encode(document))
            if self._eos is not None:
                token_ids.append(self._eos)
        blocks = _chunk(token_ids, config.seq_len)
        if len(blocks) < 2:
            raise ValueError(
                f"data.path={config.path!r} yields {len(token_ids)} tokens, fewer than two blocks of "
                f"data.seq_len={config.seq_len}; use a larger file or a smaller seq_len"
            )
        order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(config.seed))
        num_val = max(1, math.ceil(len(blocks) * config.val_fraction))
        return blocks[order[num_val:]], blocks[order[:num_val]]

    def _variable_samples(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Samples of their own lengths (``data.lengths=variable``): documents, or generated multi-task lengths."""
        config = self.config
        if self.language is not None:
            num_val = max(config.batch_size, int(config.num_sequences * config.val_fraction))
            return (synthetic_samples(self.language.sample, config.num_sequences, config.seed, config.max_length),
                    synthetic_samples(lambda n, length: self.language.sample(n, length, seed_offset=1), num_val,
                                      config.seed + 1, config.max_length))
        samples = token_samples([document if isinstance(document, list) else
                                 self._encode(document) + ([self._eos] if self._eos is not None else [])
                                 for document in self._documents], config.max_length)
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(config.seed)).tolist()
        num_val = max(config.batch_size, math.ceil(len(samples) * config.val_fraction))
        if len(samples) < num_val + config.batch_size:
            raise ValueError(f"data.path={config.path!r} has {len(samples)} documents, too few for a training and a "
                             f"validation global batch of data.batch_size={config.batch_size}; lower the batch size")
        return [samples[i] for i in order[num_val:]], [samples[i] for i in order[:num_val]]

    def setup(self, stage: str) -> None:
        if self.train_set is None and self.config.lengths == "variable":
            if self.trainer is not None:
                check_consumer(self.trainer.strategy)
            self.train_set, self.val_set = self._variable_samples()
        elif self.train_set is None:
            train_blocks, val_blocks = self._build_blocks()
            self.train_set = TensorDataset(train_blocks)
            self.val_set = TensorDataset(val_blocks)

    def _epoch(self) -> Optional[int]:
        return None if self.trainer is None else self.trainer.current_epoch

    def _trained_batches(self) -> int:
        """Batches of the current epoch the fit loop has trained (0 outside a fit)."""
        trainer = self.trainer
        return 0 if trainer is None else trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() must run before the data loaders are requested"
        if self.config.lengths == "variable":
            return global_batch_loader(self.train_set, self.config.batch_size, self.config.seed, shuffle=True)
        return ResumableDataLoader(
            self.train_set, batch_size=self.config.batch_size, shuffle=True, drop_last=True,
            num_workers=self.config.num_workers, generator=torch.Generator(),
            epoch=self._epoch, trained_batches=self._trained_batches, shuffle_seed=self.config.seed,
        )

    def val_dataloader(self) -> DataLoader:
        """Full batches only: a pipeline splits every batch into a fixed number of micro-batches."""
        assert self.val_set is not None, "setup() must run before the data loaders are requested"
        if self.config.lengths == "variable":
            return global_batch_loader(self.val_set, self.config.batch_size, self.config.seed, shuffle=False)
        return DataLoader(self.val_set, batch_size=self.config.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.config.num_workers)
