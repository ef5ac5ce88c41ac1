"""Pro-Prophet's per-layer cost model, generalised to any padding and replica sets.

All constants come from :mod:`.cost_measurement` measurements on the running machine (or
from a caller who measured elsewhere); nothing here is hard-coded. Times are per
MoE layer per training step. Traffic is priced per rank (the busiest sender or
receiver sets an all-to-all's time), which is what a switch-connected cluster
shows; the paper's ``s·(D−n)/D`` form is the same for uniform replica sets.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Literal

from lightning_merak.plugins.moe.core.placement import Counts, Padding, PlacementPlan, RankLoads, rank_loads

__all__ = ["CommCurve", "CostModel", "CostTerms", "TransferTiming"]

TransferTiming = Literal["prefetched", "current", "done"]


@dataclass(frozen=True)
class CommCurve:
    """Seconds to move a message of a given size, from timings at increasing sizes.

    Linear interpolation between measured points (time is affine in size, so this is
    exact for a latency + size/bandwidth link); the last bandwidth extrapolates.
    """

    sizes_bytes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes_bytes) != len(self.seconds) or not self.sizes_bytes:
            raise ValueError("CommCurve needs as many timings as sizes, at least one")
        if list(self.sizes_bytes) != sorted(self.sizes_bytes):
            raise ValueError("CommCurve sizes must increase")

    @classmethod
    def from_bandwidth(cls, bytes_per_s: float, latency_s: float = 0.0) -> CommCurve:
        return cls((1.0, 1e9), (latency_s + 1.0 / bytes_per_s, latency_s + 1e9 / bytes_per_s))

    def time(self, size_bytes: float) -> float:
        if size_bytes <= 0:
            return 0.0
        sizes, secs = self.sizes_bytes, self.seconds
        if size_bytes <= sizes[0]:
            return secs[0]
        if size_bytes >= sizes[-1]:
            tail_rate = sizes[-1] / secs[-1]
            return secs[-1] + (size_bytes - sizes[-1]) / tail_rate
        i = bisect.bisect_right(sizes, size_bytes)
        frac = (size_bytes - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return secs[i - 1] + frac * (secs[i] - secs[i - 1])

    def bandwidth(self, size_bytes: float) -> float:
        return size_bytes / self.time(size_bytes)


@dataclass(frozen=True)
class CostTerms:
    """One layer's predicted times (seconds): one all-to-all, forward expert compute, Trans, Agg."""

    all_to_all: float
    expert_forward: float
    transfer: float
    aggregate: float
    total: float


@dataclass(frozen=True)
class CostModel:
    """T′ of Pro-Prophet §1.2 for a count matrix and a plan.

    ``all_to_all`` prices one rank's traffic in one all-to-all by its total bytes;
    ``point_to_point`` prices one expert's parameters (or gradients) between two ranks.
    ``nonmoe_forward_s``/``nonmoe_backward_s`` are the adjacent dense layer's times under
    which the scheduler hides Trans and Agg. ``overlap_efficiency`` (measured: the share of a
    transfer that compute running beside it hides; near 0 on an oversubscribed CPU) scales every
    window that hides a transfer; ``all_to_all_overlap_efficiency`` is the same for an all-to-all,
    which Lancet's chunks hide under expert compute.

    ``expert_tokens_per_s`` is measured with every rank computing at once; ``expert_tokens_per_s_alone``
    (None: the same) with the other ranks idle. Where ranks share cores (an oversubscribed CPU) the
    busiest rank runs faster while the others wait for it, so an imbalance costs less than its
    rows at the shared rate: expert compute is the larger of the busiest rank's rows at the lone rate
    and the mean rows at the shared rate. On one device per rank the two rates agree and this is the
    busiest rank's rows at that rate.
    """

    all_to_all: CommCurve
    point_to_point: CommCurve
    expert_tokens_per_s: float
    bytes_per_token: int
    expert_param_bytes: int
    experts_per_rank: int
    nonmoe_forward_s: float = 0.0
    nonmoe_backward_s: float = 0.0
    overlap: bool = True
    overlap_efficiency: float = 1.0
    all_to_all_overlap_efficiency: float = 1.0
    expert_tokens_per_s_alone: float | None = None
    measured: dict[str, float] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.expert_tokens_per_s <= 0 or self.bytes_per_token <= 0 or self.experts_per_rank <= 0:
            raise ValueError("expert_tokens_per_s, bytes_per_token and experts_per_rank must be positive")
        if self.expert_tokens_per_s_alone is not None and self.expert_tokens_per_s_alone < self.expert_tokens_per_s:
            raise ValueError(f"expert_tokens_per_s_alone={self.expert_tokens_per_s_alone} is below the shared rate "
                             f"{self.expert_tokens_per_s}: pass None where ranks do not share cores")
        for name in ("overlap_efficiency", "all_to_all_overlap_efficiency"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must lie in [0, 1]")

    def expert_compute(self, computed: list[int]) -> float:
        """Seconds until every rank has run its expert rows (see the class docstring for shared cores)."""
        if self.expert_tokens_per_s_alone is None:
            return max(computed) / self.expert_tokens_per_s
        return max(max(computed) / self.expert_tokens_per_s_alone,
                   sum(computed) / len(computed) / self.expert_tokens_per_s)

    def _issued_all_to_all(self, size_bytes: float) -> float:
        """One all-to-all's seconds: the layer issues it on every call, with no rows too (a plan that
        replicates every expert still pays its latency), so it never costs less than the smallest message."""
        return self.all_to_all.time(max(size_bytes, 1.0))

    def terms(
        self, counts: Counts, plan: PlacementPlan, padding: Padding, transfer_timing: TransferTiming = "prefetched",
        loads: RankLoads | None = None,
    ) -> CostTerms:
        """Predicted times; ``transfer_timing`` says when the replicas' parameters move.

        ``loads`` is :func:`rank_loads` of these arguments where the caller has it already (a planner
        pricing one plan several ways); None computes it.

        ``prefetched``: planned from the previous step's counts, Trans issued during the previous
        layer and hidden under its dense and expert compute (Pro-Prophet's scheduler). ``current``:
        planned from this step's counts, Trans issued with the dispatch all-to-all; it shares each
        rank's links with it, and what outlasts the all-to-all and the expert compute after it is
        exposed. ``done``: already transferred (a prefetch that arrived), nothing left to pay.
        """
        if loads is None:
            loads = rank_loads(counts, plan, padding, self.experts_per_rank)
        traffic = max(max(s, r) for s, r in zip(loads.sent, loads.received))
        all_to_all = self._issued_all_to_all(traffic * self.bytes_per_token)
        expert_forward = self.expert_compute(loads.computed)
        copies = max(max(s, r) for s, r in zip(loads.params_sent, loads.params_received))
        per_copy = self.point_to_point.time(self.expert_param_bytes) if copies else 0.0
        transfer = copies * per_copy
        aggregate = transfer
        if not self.overlap:
            exposed_transfer, exposed_aggregate = transfer, aggregate
        else:
            hide = self.overlap_efficiency
            exposed_aggregate = max(0.0, aggregate - hide * (2 * expert_forward + self.nonmoe_backward_s))
            if transfer_timing == "current":
                shared = max(
                    max(self._issued_all_to_all(sent * self.bytes_per_token) + p_sent * per_copy,
                        self._issued_all_to_all(received * self.bytes_per_token) + p_received * per_copy)
                    for sent, received, p_sent, p_received
                    in zip(loads.sent, loads.received, loads.params_sent, loads.params_received))
                exposed_transfer = max(0.0, shared - all_to_all - hide * expert_forward)
            else:
                exposed_transfer = max(0.0, transfer - hide * (expert_forward + self.nonmoe_forward_s))
        if transfer_timing == "done":
            exposed_transfer = 0.0
        total = 4 * all_to_all + 3 * expert_forward + exposed_transfer + exposed_aggregate
        return CostTerms(all_to_all, expert_forward, transfer, aggregate, total)

    def total(
        self, counts: Counts, plan: PlacementPlan, padding: Padding, transfer_timing: TransferTiming = "prefetched",
        loads: RankLoads | None = None,
    ) -> float:
        return self.terms(counts, plan, padding, transfer_timing, loads).total
