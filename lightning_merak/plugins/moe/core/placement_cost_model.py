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

from lightning_merak.plugins.moe.core.placement import Counts, Padding, PlacementPlan, rank_loads

__all__ = ["CommCurve", "CostModel", "CostTerms"]


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
    which the scheduler hides Trans and Agg.
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
    measured: dict[str, float] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.expert_tokens_per_s <= 0 or self.bytes_per_token <= 0 or self.experts_per_rank <= 0:
            raise ValueError("expert_tokens_per_s, bytes_per_token and experts_per_rank must be positive")

    def terms(self, counts: Counts, plan: PlacementPlan, padding: Padding) -> CostTerms:
        loads = rank_loads(counts, plan, padding, self.experts_per_rank)
        traffic = max(max(s, r) for s, r in zip(loads.sent, loads.received))
        all_to_all = self.all_to_all.time(traffic * self.bytes_per_token)
        expert_forward = max(loads.computed) / self.expert_tokens_per_s
        copies = max(max(s, r) for s, r in zip(loads.params_sent, loads.params_received))
        transfer = copies * self.point_to_point.time(self.expert_param_bytes) if copies else 0.0
        aggregate = transfer
        if self.overlap:
            hidden_transfer = max(0.0, transfer - expert_forward - self.nonmoe_forward_s)
            hidden_aggregate = max(0.0, aggregate - 2 * expert_forward - self.nonmoe_backward_s)
            total = 4 * all_to_all + 3 * expert_forward + hidden_transfer + hidden_aggregate
        else:
            total = 4 * all_to_all + 3 * expert_forward + transfer + aggregate
        return CostTerms(all_to_all, expert_forward, transfer, aggregate, total)

    def total(self, counts: Counts, plan: PlacementPlan, padding: Padding) -> float:
        return self.terms(counts, plan, padding).total
