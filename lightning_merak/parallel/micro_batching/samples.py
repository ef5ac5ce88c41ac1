"""Variable-length samples: a long-tailed multi-task length mix, global batches that keep each sample's length,
and the tensors of one planned micro-batch.

A :class:`VariableBatch` is one *global* batch (every data-parallel rank reads the same one and takes its
share by the plan, so the plan, the token count and the balance need no communication). Iterating it
yields a short padded block of its samples, so code written for fixed blocks (``split_batch``, the
strategy's first-batch build, batch-size logging) still finds a plain ``(samples, tokens)`` tensor.

Labels are the next token, already shifted (``-100`` where there is none: a sample's last token, padding);
the loss is the sum of token cross-entropies, which the step divides by the global batch's real targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

from lightning_merak.parallel.micro_batching.plan import MicroBatch, round_up

__all__ = ["IGNORE", "TASK_MIX", "GlobalBatches", "MicroBatchTensors", "TaskLengths", "VariableBatch",
           "check_consumer", "fixed_blocks_problem", "global_batch_loader", "micro_batch_tensors", "multi_task_lengths",
           "summed_token_loss", "synthetic_samples", "target_count", "token_samples"]

IGNORE = -100
PROBE_TOKENS = 64
"""Width of the block iterating a :class:`VariableBatch` yields (what a first-batch build traces)."""


@dataclass(frozen=True)
class TaskLengths:
    """One task's sample lengths: log-normal around ``median`` tokens with spread ``sigma``, drawn with ``weight``."""

    name: str
    weight: float
    median: float
    sigma: float


TASK_MIX = (
    TaskLengths("classification", 0.35, 40, 0.5),
    TaskLengths("question_answering", 0.30, 140, 0.6),
    TaskLengths("chat", 0.20, 380, 0.7),
    TaskLengths("summarisation", 0.12, 900, 0.5),
    TaskLengths("long_document", 0.03, 1700, 0.3),
)
"""A FLAN-like mix: most samples short, a long tail up to 2048 tokens (mean ≈ 290, max/min ≈ 100×)."""


def multi_task_lengths(count: int, seed: int, tasks: Sequence[TaskLengths] = TASK_MIX, min_length: int = 16,
                       max_length: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, task ids)`` of ``count`` samples drawn from the mixture, clipped to ``[min_length, max_length]``."""
    if not tasks:
        raise ValueError("the task mix needs at least one task")
    if not 2 <= min_length <= max_length:
        raise ValueError(f"need 2 <= min_length <= max_length, got {min_length} and {max_length}")
    rng = np.random.default_rng(seed)
    weights = np.array([task.weight for task in tasks], dtype=float)
    task_ids = rng.choice(len(tasks), size=count, p=weights / weights.sum())
    medians = np.array([task.median for task in tasks])[task_ids]
    sigmas = np.array([task.sigma for task in tasks])[task_ids]
    lengths = np.exp(np.log(medians) + sigmas * rng.standard_normal(count))
    return np.clip(np.round(lengths), min_length, max_length).astype(np.int64), task_ids


@dataclass
class VariableBatch:
    """A global batch: ``tokens`` right-padded to a multiple of 8 (``(samples, width)``), each sample's ``lengths``."""

    tokens: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def of(cls, samples: Sequence[torch.Tensor]) -> "VariableBatch":
        lengths = torch.tensor([len(sample) for sample in samples], dtype=torch.long)
        tokens = torch.zeros(len(samples), round_up(int(lengths.max())), dtype=torch.long)
        for row, sample in enumerate(samples):
            tokens[row, :len(sample)] = sample
        return cls(tokens, lengths)

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield self.tokens[:, :PROBE_TOKENS]

    def __len__(self) -> int:
        return 1

    def sample(self, index: int) -> torch.Tensor:
        return self.tokens[index, :int(self.lengths[index])]


class GlobalBatches(IterableDataset):
    """Samples grouped into global batches of ``batch_size`` by a seeded shuffle, the same on every rank.

    Iterable, so Lightning inserts no distributed sampler: every data-parallel rank reads every global
    batch and its step takes the micro-batches the plan gives it. Each pass reshuffles (seed + pass): passes
    count up from 0, or from the epoch :meth:`set_epoch` names (a resumable loader numbers them).
    Needs ``num_workers=0`` (workers would each yield every batch).
    """

    def __init__(self, samples: Sequence[torch.Tensor], batch_size: int, seed: int, shuffle: bool = True) -> None:
        super().__init__()
        if len(samples) < batch_size:
            raise ValueError(f"{len(samples)} samples make no global batch of data.batch_size={batch_size}; "
                             "lower data.batch_size or add data")
        self.samples, self.batch_size, self.seed, self.shuffle = list(samples), batch_size, seed, shuffle
        self._passes = 0

    def __len__(self) -> int:
        return len(self.samples) // self.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass pass number ``epoch`` (its shuffle is ``seed + epoch``)."""
        self._passes = epoch

    def __iter__(self) -> Iterator[VariableBatch]:
        order = (torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(self.seed + self._passes))
                 if self.shuffle else torch.arange(len(self.samples)))
        self._passes += 1
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            yield VariableBatch.of([self.samples[int(i)] for i in order[start:start + self.batch_size]])


@dataclass
class MicroBatchTensors:
    """What the model and the loss take for one micro-batch: ``position_ids`` only when rows are packed."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: Optional[torch.Tensor]


def micro_batch_tensors(batch: VariableBatch, micro: MicroBatch, packed: bool = False) -> MicroBatchTensors:
    """The rows of ``micro`` filled from ``batch``: samples back to back, padding (id 0) after them.

    ``packed``: position ids restarting at every sample (and for the trailing padding), which is what
    transformers' masks read to keep documents apart (a padded row needs none: causal attention never
    lets a real token see the padding after it). The padding restarts every ``longest`` tokens, the global
    batch's longest sample, so that no position id passes the longest real one: a model with a table of
    positions (GPT-2's) embeds every position id of a micro-batch, scored or not, and the row may be far
    longer than its table (``micro_batch_tokens``).
    """
    rows = len(micro.rows)
    device = batch.tokens.device
    longest = int(batch.lengths.max())
    input_ids = torch.zeros(rows, micro.length, dtype=torch.long, device=device)
    labels = torch.full((rows, micro.length), IGNORE, dtype=torch.long, device=device)
    positions = torch.zeros(rows, micro.length, dtype=torch.long, device=device) if packed else None
    for row, samples in enumerate(micro.rows):
        start = 0
        for index in samples:
            length = int(batch.lengths[index])
            input_ids[row, start:start + length] = batch.tokens[index, :length]
            labels[row, start:start + length - 1] = batch.tokens[index, 1:length]
            if positions is not None:
                positions[row, start:start + length] = torch.arange(length, device=device)
            start += length
        if positions is not None and start < micro.length:
            positions[row, start:] = torch.arange(micro.length - start, device=device) % longest
    return MicroBatchTensors(input_ids, labels, positions)


def target_count(lengths: torch.Tensor | Sequence[int]) -> int:
    """Real next-token targets of a set of samples: one fewer than each sample's tokens."""
    return int(sum(int(length) - 1 for length in lengths))


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropies of every labelled position (``-100`` skipped), in float32."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")




def check_consumer(strategy: object) -> None:
    """Refuse global batches a strategy would read as fixed blocks (iterating one yields only its probe block)."""
    if not getattr(getattr(strategy, "micro_batching", None), "consumes_global_batches", False):
        raise ValueError("data.lengths=variable yields global batches of samples of their own lengths, which only "
                         "merak3d's micro-batching consumes: set strategy=merak3d strategy.pipeline_parallel=2 "
                         "strategy.micro_batching=dynamic (or pad, pack), or strategy.context_parallel=2 "
                         "strategy.context_parallel_degree=per_micro_batch, or data.lengths=fixed")


def fixed_blocks_problem(strategy: object) -> Optional[str]:
    """Why ``strategy`` cannot train on fixed-length blocks (``data.lengths=fixed``), or None: per-sample
    context-parallel degrees plan global batches of samples of their own lengths (:class:`VariableBatch`), and
    would find a block only at their first step."""
    if not getattr(getattr(strategy, "micro_batching", None), "context_rounds", False):
        return None
    return ("strategy.context_parallel_degree=per_micro_batch plans each global batch's samples at their own "
            "lengths, but data.lengths=fixed yields blocks of data.seq_len tokens: set data.lengths=variable (samples "
            "of up to data.max_length tokens), or strategy.context_parallel_degree=fixed to split every block")


def _keep(batch: VariableBatch) -> VariableBatch:
    return batch


def global_batch_loader(samples: Sequence[torch.Tensor], batch_size: int, seed: int, shuffle: bool,
                        loader_class: type[DataLoader] = DataLoader, **loader_kwargs: Any) -> DataLoader:
    """A ``loader_class`` (given ``loader_kwargs``) of :class:`VariableBatch` global batches (no worker processes:
    each would yield every batch)."""
    return loader_class(GlobalBatches(samples, batch_size, seed, shuffle), batch_size=None, collate_fn=_keep,
                        **loader_kwargs)


def token_samples(token_lists: Sequence[Sequence[int]], max_length: int) -> list[torch.Tensor]:
    """One sample per document, cut to ``max_length`` tokens; documents of fewer than 2 tokens (no target) dropped."""
    return [torch.tensor(tokens[:max_length], dtype=torch.long) for tokens in token_lists if len(tokens) >= 2]


def synthetic_samples(sample_one: Callable[[int, int], torch.Tensor], count: int, seed: int,
                      max_length: int) -> list[torch.Tensor]:
    """``count`` samples of multi-task lengths (16 to ``max_length``), sample ``i`` being ``sample_one(i, length)``:
    generated at its own length, so the cost is the tokens kept rather than ``count`` times the longest."""
    lengths, _ = multi_task_lengths(count, seed, min_length=min(16, max_length), max_length=max_length)
    return [sample_one(index, int(length)) for index, length in enumerate(lengths)]
