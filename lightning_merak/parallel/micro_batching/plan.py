"""Split one global batch of variable-length samples into micro-batches, per data-parallel replica (pure Python).

Three plans, each a :class:`StepPlan` (micro-batches of rows of sample indices, per replica):

* :func:`plan_padded` — loader order, equal sample counts per replica and micro-batch, every row padded
  to the longest sample of its micro-batch (the usual baseline);
* :func:`plan_packed` — loader order, samples packed first-fit into rows of ``row_length`` tokens, rows
  dealt out evenly (the other baseline; the model must keep documents apart);
* :func:`plan_dynamic` — DynaPipe (arXiv 2311.10418): samples sorted by length, cut into consecutive
  micro-batches of any sample count by dynamic programming over a cost model under a token limit, with
  the pipeline-aware objective ``(stages − 1)·t_max + Σ time / replicas``; micro-batches are then dealt to
  replicas by Karmarkar–Karp so each gets about the same work (not the same sample count).

Every replica gets the same number of micro-batches, at least ``stages`` (a pipeline needs one per stage to
fill); a replica short of them gets empty ones (one row of padding, no real token).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["ALIGN", "CostModel", "MicroBatch", "StepPlan", "karmarkar_karp", "plan_dynamic", "plan_packed",
           "plan_padded", "round_up"]

ALIGN = 8
"""Row lengths are rounded up to a multiple of this (DynaPipe does the same; it also keeps sequence
parallelism's split of the sequence exact for tensor-parallel degrees dividing it)."""


def round_up(length: int, align: int = ALIGN) -> int:
    return max(align, -(-length // align) * align)


@dataclass(frozen=True)
class CostModel:
    """Time of one micro-batch of ``rows`` rows of ``length`` tokens: ``overhead + rows·(a·length + b·length²)``.

    ``a`` prices the per-token work (projections, MLP, head), ``b`` attention's score matrix;
    ``overhead`` the per-micro-batch cost (kernel launches, the pipeline's sends). Fit it on the
    machine with :meth:`fit`, or take :meth:`from_shape` (FLOP ratios, no measurement).
    """

    per_token: float
    per_token_squared: float
    overhead: float = 0.0

    def time(self, rows: int, length: int) -> float:
        return self.overhead + rows * (self.per_token * length + self.per_token_squared * length * length)

    @classmethod
    def fit(cls, measurements: Sequence[tuple[int, int, float]]) -> "CostModel":
        """Least squares of the relative error over ``(rows, length, seconds)`` measurements, coefficients kept
        non-negative. Relative, because the measurements span orders of magnitude: an absolute fit matches the
        longest micro-batches and may price a short one at a fraction of its time (dropping the overhead), which
        makes a plan of many small micro-batches look cheap."""
        if len(measurements) < 3:
            raise ValueError(f"fitting the cost model needs at least 3 measurements, got {len(measurements)}")
        rows = np.array([m[0] for m in measurements], dtype=float)
        length = np.array([m[1] for m in measurements], dtype=float)
        seconds = np.array([m[2] for m in measurements], dtype=float)
        if (seconds <= 0).any():
            raise ValueError(f"measured seconds must be positive, got {seconds.min()}")
        design = np.stack([rows * length, rows * length ** 2, np.ones_like(rows)], axis=1) / seconds[:, None]
        active = [0, 1, 2]
        while True:  # drop a negative coefficient and refit: a tiny active-set NNLS
            solution, *_ = np.linalg.lstsq(design[:, active], np.ones_like(seconds), rcond=None)
            if (solution >= 0).all() or len(active) == 1:
                break
            active.pop(int(np.argmin(solution)))
        coefficients = [0.0, 0.0, 0.0]
        for index, value in zip(active, solution):
            coefficients[index] = max(0.0, float(value))
        return cls(*coefficients)

    @classmethod
    def from_shape(cls, hidden_size: int, vocab_size: int, overhead_tokens: int = 256) -> "CostModel":
        """FLOP ratios of a decoder: per token ~12·h² per layer plus 2·h·V once for the head; attention
        ~2·h per token pair per layer (the layer count cancels out of the plan, so it is left out).
        ``overhead_tokens`` prices a micro-batch like that many extra tokens."""
        per_token = 12.0 * hidden_size ** 2 + 2.0 * hidden_size * vocab_size
        return cls(per_token, 2.0 * hidden_size, overhead_tokens * per_token)


@dataclass(frozen=True)
class MicroBatch:
    """Rows of ``length`` tokens; each row holds the samples named (one when padded, several when packed).

    A row with no sample is padding only (an empty micro-batch that keeps a pipeline filled).
    """

    rows: tuple[tuple[int, ...], ...]
    length: int

    @property
    def samples(self) -> tuple[int, ...]:
        return tuple(index for row in self.rows for index in row)

    @property
    def packed(self) -> bool:
        return any(len(row) > 1 for row in self.rows)

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * self.length

    def real_tokens(self, lengths: Sequence[int]) -> int:
        return sum(lengths[index] for index in self.samples)

    def time(self, cost: CostModel) -> float:
        return cost.time(len(self.rows), self.length)


EMPTY = MicroBatch(rows=((),), length=ALIGN)


@dataclass(frozen=True)
class StepPlan:
    """One step's micro-batches, per data-parallel replica (``replicas[r]`` runs in that order)."""

    replicas: tuple[tuple[MicroBatch, ...], ...]

    def padding_fraction(self, lengths: Sequence[int]) -> float:
        padded = sum(mb.padded_tokens for replica in self.replicas for mb in replica)
        real = sum(mb.real_tokens(lengths) for replica in self.replicas for mb in replica)
        return 1.0 - real / padded if padded else 0.0

    def replica_times(self, cost: CostModel) -> list[float]:
        return [sum(mb.time(cost) for mb in replica) for replica in self.replicas]


def _filled(replicas: list[list[MicroBatch]], stages: int) -> StepPlan:
    """Every replica topped up with empty micro-batches to the same count, at least ``stages``: the data-parallel
    reduction averages gradients summed over a count of micro-batches that must be the same on every replica."""
    count = max(stages, *(len(replica) for replica in replicas))
    return StepPlan(tuple(tuple(replica + [EMPTY] * (count - len(replica))) for replica in replicas))


def _check(lengths: Sequence[int], replicas: int, stages: int) -> None:
    if not lengths:
        raise ValueError("a global batch needs at least one sample")
    if min(lengths) < 1:
        raise ValueError(f"sample lengths must be positive, got {min(lengths)}")
    if replicas < 1 or stages < 1:
        raise ValueError(f"replicas and stages must be at least 1, got {replicas} and {stages}")


def _even_chunks(items: list, parts: int) -> list[list]:
    """``items`` in order, cut into ``parts`` runs whose sizes differ by at most one (empty runs dropped)."""
    base, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for part in range(parts):
        size = base + (part < extra)
        if size:
            chunks.append(items[start:start + size])
        start += size
    return chunks


def plan_padded(lengths: Sequence[int], replicas: int, micro_batches: int, stages: int = 1) -> StepPlan:
    """Loader order; each replica ``micro_batches`` micro-batches of equal sample counts, padded to their longest."""
    _check(lengths, replicas, stages)
    plans = []
    for share in _even_chunks(list(range(len(lengths))), replicas) + [[]] * max(0, replicas - len(lengths)):
        plans.append([MicroBatch(tuple((index,) for index in chunk), round_up(max(lengths[i] for i in chunk)))
                      for chunk in _even_chunks(share, micro_batches)])
    return _filled(plans, stages)


def plan_packed(lengths: Sequence[int], replicas: int, micro_batches: int, row_length: int,
                stages: int = 1) -> StepPlan:
    """Loader order packed first-fit into rows of ``row_length`` tokens; rows split evenly over replicas
    and ``micro_batches`` micro-batches. ``row_length`` is a row's capacity: each micro-batch is as long as its
    fullest row (aligned), so short samples do not pay for a whole row of padding."""
    _check(lengths, replicas, stages)
    row_length = round_up(row_length)
    if max(lengths) > row_length:
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit a packed row of {row_length}; "
                         "raise the row length (strategy.micro_batch_tokens) or cut the samples")
    rows: list[list[int]] = []
    free: list[int] = []
    for index, length in enumerate(lengths):
        slot = next((r for r, space in enumerate(free) if space >= length), None)
        if slot is None:
            rows.append([])
            free.append(row_length)
            slot = len(rows) - 1
        rows[slot].append(index)
        free[slot] -= length
    shares = _even_chunks(rows, replicas) + [[]] * max(0, replicas - len(rows))

    def micro_batch(chunk: list[list[int]]) -> MicroBatch:
        return MicroBatch(tuple(tuple(row) for row in chunk),
                          round_up(max(sum(lengths[index] for index in row) for row in chunk)))

    plans = [[micro_batch(chunk) for chunk in _even_chunks(share, micro_batches)] for share in shares]
    return _filled(plans, stages)


def karmarkar_karp(costs: Sequence[float], bins: int) -> list[list[int]]:
    """Partition item indices into ``bins`` sets of near-equal total cost (largest differencing method).

    Each heap entry is a partial ``bins``-way partition; the two whose spread is largest are merged,
    the heaviest set of one joined with the lightest of the other, until one partition is left.
    """
    if bins < 1:
        raise ValueError(f"bins must be at least 1, got {bins}")
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for index, cost in enumerate(costs):
        sets = [(float(cost), [index])] + [(0.0, []) for _ in range(bins - 1)]
        heapq.heappush(heap, (-float(cost), index, sets))
    if not heap:
        return [[] for _ in range(bins)]
    counter = len(costs)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))]
        merged.sort(key=lambda item: -item[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [sorted(items) for _, items in heap[0][2]]


def _candidate_limits(times: np.ndarray, count: int) -> np.ndarray:
    """At most ``count`` values of t_max: quantiles of the feasible micro-batch times (DynaPipe thins its
    candidates by a minimum interval; quantiles bound the count whatever the time scale)."""
    values = np.unique(times[np.isfinite(times)])
    if len(values) <= count:
        return values
    return np.unique(np.quantile(values, np.linspace(0.0, 1.0, count), method="higher"))


def plan_dynamic(lengths: Sequence[int], replicas: int, stages: int, cost: CostModel, token_limit: int,
                 candidates: int = 48) -> StepPlan:
    """DynaPipe's plan: consecutive runs of the length-sorted samples, chosen by dynamic programming.

    For each candidate ``t_max`` the DP finds the partition of least total time whose micro-batches all
    take at most ``t_max`` and hold at most ``token_limit`` padded tokens (the memory limit); the plan
    kept minimises ``(stages − 1)·t_max + total / replicas`` (the pipeline's fill and drain plus each
    replica's share of the work). Karmarkar–Karp then balances the micro-batches' times over replicas.
    """
    _check(lengths, replicas, stages)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    sorted_lengths = [round_up(lengths[i]) for i in order]
    if sorted_lengths[0] > token_limit:
        raise ValueError(f"a sample of {lengths[order[0]]} tokens exceeds the micro-batch token limit {token_limit}; "
                         "raise strategy.micro_batch_tokens")
    count = len(order)
    times = np.full((count + 1, count + 1), np.inf)
    for start in range(count):
        length = sorted_lengths[start]  # the longest of any run starting here
        most = min(count - start, token_limit // length)
        for size in range(1, most + 1):
            times[start, start + size] = cost.time(size, length)
    best: tuple[float, list[tuple[int, int]]] | None = None
    for limit in _candidate_limits(times, candidates):
        allowed = np.where(times <= limit, times, np.inf)
        total = np.full(count + 1, np.inf)
        back = np.zeros(count + 1, dtype=int)
        total[0] = 0.0
        for end in range(1, count + 1):
            options = total[:end] + allowed[:end, end]
            start = int(np.argmin(options))
            total[end], back[end] = options[start], start
        if not math.isfinite(total[count]):
            continue
        objective = (stages - 1) * float(limit) + float(total[count]) / replicas
        if best is None or objective < best[0]:
            runs, end = [], count
            while end > 0:
                runs.append((int(back[end]), end))
                end = int(back[end])
            best = (objective, runs[::-1])
    assert best is not None  # single-sample runs always fit the token limit
    micro = [MicroBatch(tuple((order[i],) for i in range(start, end)), sorted_lengths[start])
             for start, end in best[1]]
    bins = karmarkar_karp([mb.time(cost) for mb in micro], replicas)
    plans = [sorted((micro[i] for i in chosen), key=lambda mb: -mb.time(cost)) for chosen in bins]
    return _filled(plans, stages)
