"""A context-parallel degree per sample for variable-length global batches (pure Python, no process group).

A fixed degree ``c`` splits every sample over the ``c`` ranks of a context-parallel group: short samples then pay
the attention exchange and ``c`` kernel launches for a sliver of work each, and at degree 1 the group's
longest sample sets the step (and may not fit one rank's memory). :func:`plan_context_degrees` gives each sample
its own degree ``k`` (a divisor of ``c``): the ranks of the group form ``c / k`` subgroups of ``k`` consecutive
ranks, each running its own samples split ``k`` ways, and degree 1 is plain data parallelism inside the group.

The plan is a list of :class:`Round` per batch replica, the same count for every replica, each round one forward
and backward on every rank: a round of degree ``k`` gives each subgroup one sample (ranks of a subgroup run it
together, collectives inside the subgroup only); a round of degree 1 gives each rank its own short samples, at
most ``token_cap`` tokens in all. Degrees are chosen greedily on :class:`DegreeCost`: every sample starts at
the least rank-seconds its memory allows, then samples, longest first, move to a higher degree (with every
longer sample below it) while that shortens the group's predicted step. Samples are dealt longest first to the
subgroup of their degree whose busiest rank is least loaded (LPT; a split sample loads every rank of its
subgroup), and the predicted step is the busiest rank's load: ranks wait only for those they share a sample
with. The plan depends on its arguments only, so every rank computes the same one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

from lightning_merak.parallel.micro_batching.plan import CostModel, karmarkar_karp

__all__ = ["DEGREE_MODES", "ContextPlan", "DegreeCost", "Round", "plan_context_degrees", "split_length"]

DEGREE_MODES = ("fixed", "per_micro_batch")


def split_length(length: int, degree: int) -> int:
    """Tokens a sample runs with at ``degree``: padded to a multiple of ``2 · degree`` when split (the
    load-balanced layout's chunks), as is at degree 1."""
    return length if degree == 1 else -(-length // (2 * degree)) * 2 * degree


@dataclass(frozen=True)
class DegreeCost:
    """Seconds each of ``k`` ranks spends on one sample of ``L`` tokens split over them:
    ``overhead + (per_token · L + per_token² · L²) / k + (k − 1) · (exchange_per_step + exchange_per_token · L / k)``.

    ``compute`` is the micro-batch planner's model of one sample on one rank; the balanced causal chunks give each
    of ``k`` ranks ``1/k`` of it, and every ring step passes one ``L/k``-token key/value shard (``exchange_per_step``
    the step's fixed cost, ``exchange_per_token`` its exposed transfer per token)."""

    compute: CostModel
    exchange_per_step: float = 0.0
    exchange_per_token: float = 0.0

    def time(self, length: int, degree: int) -> float:
        tokens = split_length(length, degree)
        work = self.compute.per_token * tokens + self.compute.per_token_squared * tokens * tokens
        exchange = (degree - 1) * (self.exchange_per_step + self.exchange_per_token * tokens / degree)
        return self.compute.overhead + work / degree + exchange

    @classmethod
    def from_shape(cls, hidden_size: int, vocab_size: int) -> "DegreeCost":
        """FLOP ratios of the model's shape (:meth:`CostModel.from_shape`); a ring step priced like a quarter of
        a forward's fixed overhead, its transfer hidden behind the step's kernel (as the layout planner's ring)."""
        compute = CostModel.from_shape(hidden_size, vocab_size)
        return cls(compute, exchange_per_step=compute.overhead / 4)


@dataclass(frozen=True)
class Round:
    """One forward and backward on every rank of a group: ``slots[j]`` are the samples the ranks
    ``[j · degree, (j + 1) · degree)`` run (at most one when ``degree > 1``; none: that subgroup idles)."""

    degree: int
    slots: tuple[tuple[int, ...], ...]

    def samples_of(self, rank: int) -> tuple[int, ...]:
        return self.slots[rank // self.degree]


@dataclass(frozen=True)
class ContextPlan:
    """One global batch's rounds per batch replica (``replicas[r]``, the same count for every replica) and
    each sample's degree."""

    replicas: tuple[tuple[Round, ...], ...]
    degrees: tuple[int, ...]

    def group_times(self, lengths: Sequence[int], cost: DegreeCost) -> list[float]:
        """Each replica's predicted step: its busiest rank's time over its samples (a part of each split one)."""
        times = []
        for rounds in self.replicas:
            ranks = len(rounds[0].slots) * rounds[0].degree if rounds else 1
            times.append(max(sum(cost.time(lengths[i], rnd.degree) for rnd in rounds for i in rnd.samples_of(rank))
                             for rank in range(ranks)))
        return times


def _divisors(group_size: int) -> list[int]:
    return [k for k in range(1, group_size + 1) if group_size % k == 0]


def _assign(lengths: Sequence[int], degrees: dict[int, int], group_size: int,
            cost: DegreeCost) -> tuple[dict[int, list[list[int]]], float]:
    """Samples dealt longest first (by time at their degree) to the subgroup of their degree whose busiest rank is
    least loaded, a split sample loading each rank of its subgroup; returns each degree's subgroups' samples and
    the predicted step, the busiest rank's load (ranks wait only for their own subgroups)."""
    loads = [0.0] * group_size
    slots = {degree: [[] for _ in range(group_size // degree)] for degree in set(degrees.values())}
    timed = sorted(((cost.time(lengths[i], k), i, k) for i, k in degrees.items()), key=lambda item: (-item[0], item[1]))
    for time, index, degree in timed:
        slot = min(range(group_size // degree), key=lambda j: (max(loads[j * degree:(j + 1) * degree]), j))
        slots[degree][slot].append(index)
        for rank in range(slot * degree, (slot + 1) * degree):
            loads[rank] += time
    return slots, max(loads, default=0.0)


def _choose_degrees(lengths: Sequence[int], samples: Sequence[int], allowed: dict[int, list[int]],
                    group_size: int, cost: DegreeCost) -> dict[int, int]:
    degrees = {i: min(allowed[i], key=lambda k: (k * cost.time(lengths[i], k), k)) for i in samples}
    if not degrees:
        return degrees
    best = _assign(lengths, degrees, group_size, cost)[1]
    for _ in range(len(_divisors(group_size))):
        improved = False
        for i in sorted(samples, key=lambda s: (-lengths[s], s)):
            for degree in (k for k in allowed[i] if k > degrees[i]):  # this sample and every longer one below it
                trial = {**degrees, **{j: degree for j in samples
                                       if lengths[j] >= lengths[i] and degrees[j] < degree and degree in allowed[j]}}
                predicted = _assign(lengths, trial, group_size, cost)[1]
                if predicted < best * (1 - 1e-9):
                    degrees, best, improved = trial, predicted, True
        if not improved:
            break
    return degrees


def _rounds(lengths: Sequence[int], degrees: dict[int, int], group_size: int, cost: DegreeCost,
            token_cap: int) -> list[Round]:
    """Split rounds (highest degree first), then local rounds of at most ``token_cap`` tokens per rank."""
    rounds: list[Round] = []
    assigned = _assign(lengths, degrees, group_size, cost)[0]
    for degree in sorted(assigned, reverse=True):
        slots = assigned[degree]
        if degree > 1:
            for step in range(max(len(slot) for slot in slots)):
                rounds.append(Round(degree, tuple(tuple(slot[step:step + 1]) for slot in slots)))
            continue
        chunks: list[list[list[int]]] = []
        for slot in slots:
            mine: list[list[int]] = []
            for index in slot:
                if mine and sum(lengths[i] for i in mine[-1]) + lengths[index] <= token_cap:
                    mine[-1].append(index)
                else:
                    mine.append([index])
            chunks.append(mine)
        for step in range(max(len(mine) for mine in chunks)):
            rounds.append(Round(1, tuple(tuple(mine[step]) if step < len(mine) else () for mine in chunks)))
    return rounds


def plan_context_degrees(lengths: Sequence[int], replicas: int, group_size: int, cost: DegreeCost, token_cap: int,
                         degree: Union[str, int] = "per_micro_batch") -> ContextPlan:
    """Rounds for one global batch over ``replicas`` context-parallel groups of ``group_size`` ranks.

    ``degree``: ``"per_micro_batch"`` chooses each sample's (module docstring); an integer dividing
    ``group_size`` runs every sample at that degree (``group_size``: the fixed context parallelism, 1: data
    parallelism inside the group). A sample runs at degree ``k`` only if ``split_length(L, k) / k <= token_cap``.
    Samples are first dealt to replicas by Karmarkar–Karp on their least rank-seconds.
    """
    if not lengths or min(lengths) < 1:
        raise ValueError(f"a global batch needs samples of at least one token, got lengths {list(lengths)[:8]}")
    if replicas < 1 or group_size < 1:
        raise ValueError(f"replicas and group_size must be at least 1, got {replicas} and {group_size}")
    divisors = _divisors(group_size)
    if degree != "per_micro_batch" and degree not in divisors:
        raise ValueError(f"degree={degree!r} must be 'per_micro_batch' or a divisor of the group size {group_size}")
    candidates = divisors if degree == "per_micro_batch" else [int(degree)]
    allowed = {i: [k for k in candidates if split_length(length, k) // k <= token_cap]
               for i, length in enumerate(lengths)}
    for i, ks in allowed.items():
        if not ks:
            most = max(candidates)
            raise ValueError(
                f"a sample of {lengths[i]} tokens needs {math.ceil(split_length(lengths[i], most) / most)} tokens per "
                f"rank at context-parallel degree {most}, over the cap of {token_cap}; raise "
                "strategy.micro_batch_tokens or strategy.context_parallel, or cut the samples")
    work = [min(k * cost.time(lengths[i], k) for k in allowed[i]) for i in range(len(lengths))]
    shares = karmarkar_karp(work, replicas)
    plans: list[list[Round]] = []
    degrees = [1] * len(lengths)
    for share in shares:
        chosen = _choose_degrees(lengths, share, allowed, group_size, cost)
        for i, k in chosen.items():
            degrees[i] = k
        plans.append(_rounds(lengths, chosen, group_size, cost, token_cap))
    count = max(len(rounds) for rounds in plans)
    empty = Round(1, ((),) * group_size)
    return ContextPlan(tuple(tuple(rounds + [empty] * (count - len(rounds))) for rounds in plans), tuple(degrees))
