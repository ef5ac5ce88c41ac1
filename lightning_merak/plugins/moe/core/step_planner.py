"""One search space per MoE layer call: every placement kind, priced on this step's counts.

The gate's counts for this step are known before dispatch, so no plan has to be stale. The
candidates, each priced by :class:`~.placement_cost_model.CostModel` from the profiled constants:

* ``none``: no replication, the layer's own padding (DeepSpeed-MoE's placement and dispatch);
* ``dropless``: no replication, split-size dispatch (offered where the layer pads without dropping
  — ``drop_tokens=False`` — as the rows computed are the same; a dropless layer's ``none`` is this);
* ``shadowing``: FasterMoE's hot experts to every rank, planned from this step's counts;
* ``pro_prophet``: Pro-Prophet's replica sets, planned from this step's counts;
* the plan made from the previous step's counts whose parameters were prefetched during the
  previous layer (timing ``predicted``): its transfers are paid, only its fit to this step counts.

Current-step plans move their parameters while the dispatch all-to-all runs (timing ``current``).
The cheapest prediction wins, ties to the earlier candidate above, so a plan predicted slower
than no replication is never used. Whether to prefetch for the next step is decided by the same
model (:func:`prefetch_pays`): the previous step's plan, priced on this step's counts with its
transfer hidden, must beat the best current-step plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Sequence

from lightning_merak.plugins.moe.core.placement import Counts, Padding, PlacementPlan
from lightning_merak.plugins.moe.core.placement_cost_model import CostModel, TransferTiming
from lightning_merak.plugins.moe.core.placement_planner import plan_pro_prophet
from lightning_merak.plugins.moe.core.shadowing import plan_shadowing

__all__ = ["PLAN_KINDS", "PlanKind", "PlannerSettings", "StepChoice", "choose_step_plan", "predicted_plan",
           "prefetch_pays", "step_candidates"]

PlanKind = Literal["none", "dropless", "shadowing", "pro_prophet"]
PLAN_KINDS: tuple[str, ...] = ("none", "dropless", "shadowing", "pro_prophet")
Timing = Literal["current", "predicted"]


@dataclass(frozen=True)
class PlannerSettings:
    """Which kinds compete, and Pro-Prophet's search knobs (see :func:`plan_pro_prophet`)."""

    kinds: tuple[str, ...] = PLAN_KINDS
    exclude_fewest: int = 0
    alpha: float = 0.25
    slots_per_rank: int | None = None

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(PLAN_KINDS)
        if unknown or "none" not in self.kinds:
            raise ValueError(f"kinds={self.kinds}: use a subset of {PLAN_KINDS} that includes 'none'")


@dataclass(frozen=True)
class StepChoice:
    """The plan a layer call runs, why (its predicted seconds) and how its transfers happen.

    ``chunks`` is the Lancet chunk count where the online check chose it too (None: the layer's
    own rule); ``corrected_s`` the prediction after the check's correction, ``explored`` whether
    the check ran this runner-up to measure it (:mod:`.plan_check`).
    """

    kind: str
    timing: Timing
    plan: PlacementPlan
    padding: Padding
    predicted_s: float
    best_current_s: float = float("inf")
    chunks: int | None = None
    corrected_s: float | None = None
    explored: bool = False

    @property
    def kind_index(self) -> int:
        """A number for loggers that take only floats: the position in :data:`PLAN_KINDS`."""
        return PLAN_KINDS.index(self.kind)

    @property
    def arm(self) -> str:
        """What the online check keeps a correction for: kind, timing, and whether chunked."""
        chunked = "/chunked" if self.chunks is not None and self.chunks > 1 else ""
        return f"{self.kind}/{self.timing}{chunked}"


def _replicating_plan(
    kind: str, counts: Counts, cost: CostModel, padding: Padding, settings: PlannerSettings, timing: TransferTiming
) -> PlacementPlan:
    if kind == "shadowing":
        return plan_shadowing(counts, cost)
    return plan_pro_prophet(counts, cost, padding, exclude_fewest=settings.exclude_fewest, alpha=settings.alpha,
                            slots_per_rank=settings.slots_per_rank, transfer_timing=timing)


def _paddings(stock: Padding, kinds: Sequence[str]) -> list[Padding]:
    if stock.mode == "max" and "dropless" in kinds:
        return [stock, Padding("dropless")]
    return [stock]


def _plain_kind(padding: Padding) -> str:
    return "dropless" if padding.mode == "dropless" else "none"


def step_candidates(
    counts: Counts,
    cost: CostModel,
    stock_padding: Padding,
    settings: PlannerSettings = PlannerSettings(),
    *,
    prefetched: tuple[str, PlacementPlan] | None = None,
    current: bool = True,
) -> list[StepChoice]:
    """Every candidate for this step's ``counts``, priced, in the tie-breaking order above.

    ``prefetched`` is (kind, plan) whose parameters already arrived; ``current=False`` leaves
    out the plans made from this step's counts (Pro-Prophet's original, prediction-only timing).
    """
    empty = PlacementPlan(len(counts[0]), len(counts))
    candidates: list[StepChoice] = []
    for padding in _paddings(stock_padding, settings.kinds):
        candidates.append(StepChoice(_plain_kind(padding), "current", empty, padding,
                                     cost.total(counts, empty, padding)))
        if prefetched is not None and prefetched[1].replications:
            candidates.append(StepChoice(prefetched[0], "predicted", prefetched[1], padding,
                                         cost.total(counts, prefetched[1], padding, "done")))
        for kind in ("shadowing", "pro_prophet"):
            if current and kind in settings.kinds:
                plan = _replicating_plan(kind, counts, cost, padding, settings, "current")
                if plan.replications:
                    candidates.append(StepChoice(kind, "current", plan, padding,
                                                 cost.total(counts, plan, padding, "current")))
    return candidates


def choose_step_plan(
    counts: Counts,
    cost: CostModel,
    stock_padding: Padding,
    settings: PlannerSettings = PlannerSettings(),
    *,
    prefetched: tuple[str, PlacementPlan] | None = None,
    current: bool = True,
) -> StepChoice:
    """The cheapest of :func:`step_candidates` (all ranks derive the same one).

    The choice carries the best current-step price too, for :func:`prefetch_pays`.
    """
    candidates = step_candidates(counts, cost, stock_padding, settings, prefetched=prefetched, current=current)
    best = candidates[0]
    for candidate in candidates[1:]:
        if candidate.predicted_s < best.predicted_s:
            best = candidate
    best_current_s = min(c.predicted_s for c in candidates if c.timing == "current")
    return replace(best, best_current_s=best_current_s)


def predicted_plan(
    counts: Counts, cost: CostModel, padding: Padding, settings: PlannerSettings
) -> tuple[str, PlacementPlan] | None:
    """The plan to prefetch for the next step, made from this step's counts (None: nothing to move).

    Among the replicating kinds allowed, the one the model prices lowest on these counts with
    Pro-Prophet's scheduler timing (transfers hidden under the previous layer).
    """
    best: tuple[float, str, PlacementPlan] | None = None
    for kind in ("shadowing", "pro_prophet"):
        if kind not in settings.kinds:
            continue
        plan = _replicating_plan(kind, counts, cost, padding, settings, "prefetched")
        if not plan.replications:
            continue
        time = cost.total(counts, plan, padding, "prefetched")
        if best is None or time < best[0]:
            best = (time, kind, plan)
    return None if best is None else (best[1], best[2])


def prefetch_pays(counts: Counts, cost: CostModel, previous: PlacementPlan, padding: Padding,
                  best_current_s: float, correction: float = 1.0) -> bool:
    """Would the plan predicted from the previous step's counts have beaten this step's best current plan?

    The previous plan is priced on this step's counts with its transfer as the scheduler issues
    it, so routing that changes between steps (a rotating hot set) turns prefetching off and
    routing that holds still turns it on. ``correction`` scales that price as the online check
    scales prefetched plans' (then ``best_current_s`` is the corrected best too).
    """
    return bool(previous.replications) and (
        correction * cost.total(counts, previous, padding, "prefetched") < best_current_s)
