"""Expert placement plans and the token accounting every other module shares.

A plan says which experts are replicated to which expert-parallel (EP) ranks; a
replica rank computes its *own* tokens for that expert instead of sending them to
the owner. From a count matrix ``counts[r][e]`` (tokens EP rank ``r`` routes to expert
``e``) and a plan, :func:`block_rows` gives the rows each (source rank, expert) block
puts on the wire and :func:`rank_loads` the per-rank traffic and compute. The
planner, the cost model and the dispatcher all use these, so the model prices
exactly what the layer does. Pure Python: no process groups, no tensors needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal, Sequence

Counts = Sequence[Sequence[int]]
PaddingMode = Literal["dropless", "fixed", "max"]

__all__ = [
    "computed_max_over_mean",
    "Counts",
    "Padding",
    "PlacementPlan",
    "RankLoads",
    "Replication",
    "block_rows",
    "owner_of",
    "rank_loads",
    "replica_rows",
    "validate_counts",
]


def owner_of(expert: int, experts_per_rank: int) -> int:
    """EP rank holding ``expert``: DeepSpeed lays experts out EP-rank-major."""
    return expert // experts_per_rank


@dataclass(frozen=True)
class Replication:
    """``expert`` (owned by EP rank ``owner``) is replicated to EP ranks ``replicas``."""

    expert: int
    owner: int
    replicas: tuple[int, ...]


@dataclass(frozen=True)
class PlacementPlan:
    """The replicated experts of one layer; identical on every rank of an EP group."""

    num_experts: int
    ep_size: int
    replications: tuple[Replication, ...] = ()

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for rep in self.replications:
            if rep.expert in seen:
                raise ValueError(f"expert {rep.expert} appears twice in the plan")
            seen.add(rep.expert)
            if rep.owner in rep.replicas or any(not 0 <= r < self.ep_size for r in rep.replicas):
                raise ValueError(f"invalid replica set {rep.replicas} for expert {rep.expert} owned by {rep.owner}")

    @cached_property
    def replica_sets(self) -> dict[int, frozenset[int]]:
        return {rep.expert: frozenset(rep.replicas) for rep in self.replications}

    def hosted_by(self, rank: int) -> list[Replication]:
        """Replications that ``rank`` computes as a replica, in plan order."""
        return [rep for rep in self.replications if rank in rep.replicas]

    def owned_by(self, rank: int) -> list[Replication]:
        return [rep for rep in self.replications if rep.owner == rank]

    @property
    def num_replicas(self) -> int:
        return sum(len(rep.replicas) for rep in self.replications)


@dataclass(frozen=True)
class Padding:
    """How a (source rank, expert) block is sized on the wire.

    ``dropless``: exactly its token count. ``fixed``: DeepSpeed's capacity ``capacity``
    (``drop_tokens=True``). ``max``: the largest count among the blocks still sent
    (``drop_tokens=False`` padded dispatch; replication lowers this maximum).
    """

    mode: PaddingMode = "dropless"
    capacity: int = 0


def validate_counts(counts: Counts, ep_size: int, num_experts: int) -> None:
    if len(counts) != ep_size or any(len(row) != num_experts for row in counts):
        raise ValueError(f"counts must be {ep_size} x {num_experts} (EP ranks x experts)")
    if any(c < 0 for row in counts for c in row):
        raise ValueError("counts must be non-negative")


def _max_sent_count(counts: Counts, plan: PlacementPlan) -> int:
    sets = plan.replica_sets
    sent = [c for r, row in enumerate(counts) for e, c in enumerate(row) if r not in sets.get(e, ())]
    return max(sent, default=0)


def block_rows(counts: Counts, plan: PlacementPlan, padding: Padding) -> list[list[int]]:
    """Rows that source rank ``r`` sends for expert ``e`` (0 where ``r`` hosts a replica of ``e``)."""
    sets = plan.replica_sets
    if padding.mode == "max":
        size = _max_sent_count(counts, plan)
    rows = []
    for r, row in enumerate(counts):
        out = []
        for e, count in enumerate(row):
            if r in sets.get(e, ()):
                out.append(0)
            elif padding.mode == "dropless":
                out.append(int(count))
            elif padding.mode == "fixed":
                out.append(padding.capacity)
            else:
                out.append(size)
        rows.append(out)
    return rows


def replica_rows(counts: Counts, rank: int, expert: int, padding: Padding) -> int:
    """Rows a replica rank computes locally for ``expert`` (locations stay below this)."""
    return padding.capacity if padding.mode == "fixed" else int(counts[rank][expert])


@dataclass(frozen=True)
class RankLoads:
    """Per EP rank: rows computed, rows sent to / received from other ranks, replica traffic."""

    computed: list[int]
    sent: list[int]
    received: list[int]
    params_sent: list[int]
    params_received: list[int]


def rank_loads(counts: Counts, plan: PlacementPlan, padding: Padding, experts_per_rank: int) -> RankLoads:
    """H_d (computed), R_d (received) etc. of the Pro-Prophet model, for any padding.

    The rows are :func:`block_rows`' without building its matrix: the planners call this tens of times
    per layer call, on the critical path between the count exchange and the dispatch, so each owner's
    block is one slice sum and replicas then take their hosted rows back out.
    """
    ep_size = len(counts)
    fixed = padding.capacity if padding.mode == "fixed" else None
    if padding.mode == "max":
        fixed = _max_sent_count(counts, plan)
    computed = [0] * ep_size
    sent = [0] * ep_size
    received = [0] * ep_size
    for r, row in enumerate(counts):
        for owner in range(ep_size):
            first = owner * experts_per_rank
            n = int(sum(row[first:first + experts_per_rank])) if fixed is None else fixed * experts_per_rank
            computed[owner] += n
            if owner != r:
                sent[r] += n
                received[owner] += n
    params_sent = [0] * ep_size
    params_received = [0] * ep_size
    for rep in plan.replications:
        owner = rep.expert // experts_per_rank
        params_sent[rep.owner] += len(rep.replicas)
        for r in rep.replicas:
            n = int(counts[r][rep.expert]) if fixed is None else fixed
            computed[owner] -= n
            sent[r] -= n
            received[owner] -= n
            params_received[r] += 1
            computed[r] += replica_rows(counts, r, rep.expert, padding)
    return RankLoads(computed, sent, received, params_sent, params_received)


def computed_max_over_mean(counts: list[list[int]], plan: PlacementPlan, experts_per_rank: int) -> float:
    """The routed rows each rank computes under ``plan`` (padding aside), max over mean."""
    computed = rank_loads(counts, plan, Padding("dropless"), experts_per_rank).computed
    mean = sum(computed) / len(computed)
    return max(computed) / mean if mean > 0 else 1.0
