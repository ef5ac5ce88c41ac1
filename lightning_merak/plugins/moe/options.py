"""What the MoE layer adds to DeepSpeed's: its options, declared and checked once.

Plain Python (no torch, no DeepSpeed): ``merak-train``'s ``moe`` options derive their schema
from :class:`MoEOptions`'s fields, so composing a configuration stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from lightning_merak.util.fields import option

__all__ = ["DispatchPath", "MoEOptions", "PlacementPolicy", "PlanFrom"]

DispatchPath = Literal["capacity", "dropless"]
PlacementPolicy = Literal["none", "pro_prophet", "shadowing", "auto"]
PlanFrom = Literal["auto", "current", "previous"]


@dataclass
class MoEOptions:
    """What this layer adds to DeepSpeed's: dispatch path, placement policy, overlap, and the online check of
    the placement planner (:mod:`.core.plan_check`). The defaults are plain DeepSpeed-MoE's behaviour. Layers
    sharing a scheduler share the check (the first one's settings); block-scope Lancet's sub-batches run the
    model's choice unchecked."""

    dispatch: DispatchPath = option(
        "capacity", "`capacity` (DeepSpeed's: an expert takes at most its capacity of tokens, the rest are dropped) "
        "or `dropless` (every routed token reaches its expert; needs `drop_tokens=False`).")
    placement: PlacementPolicy = option(
        "none", "`none` (experts stay where DeepSpeed puts them), `pro_prophet` (Pro-Prophet's replica sets against "
        "no replication), `shadowing` (the FasterMoE baseline: hot experts to every rank, from this step's "
        "counts) or `auto` (one planner picks, per call, between no replication, dropless dispatch, shadowing and "
        "Pro-Prophet sets by predicted cost).")
    lancet_chunks: Union[int, str] = option(
        1, "Chunks each call's exchange is split into, so that one chunk's all-to-all overlaps another's expert "
        "compute (Lancet); `auto` simulates 1, 2, 4 and 8 and keeps the fastest; 1: no overlap. Digits in a config "
        "file become an integer.")
    lancet_backward: bool = option(
        True, "With chunks, compute the experts' weight gradients after their input gradient, while that chunk's "
        "input-gradient all-to-all is in flight.")
    overlap_transfer: bool = option(
        True, "Move replicated experts' parameters in the background (under the dispatch all-to-all, or prefetched "
        "under the previous layer) rather than before the exchange.")
    replan_every: int = option(1, "Make a new placement plan every this many calls of the layer (1: every call).")
    replan_threshold: Optional[float] = option(
        None, "Also re-plan sooner when the routed counts drifted from those of the last plan by more than this "
        "fraction of its tokens (`null`: only every `replan_every` calls).")
    exclude_fewest: int = option(
        0, "Pro-Prophet: leave out this many ranks, those sending an expert the fewest tokens, when choosing where to "
        "replicate it (the paper's n).")
    slots_per_rank: Optional[int] = option(None, "Pro-Prophet: the most replicas one rank may hold (`null`: no cap).")
    alpha: float = option(
        0.25, "Pro-Prophet's balance rule: loads count as balanced when max − min < alpha × tokens / experts (the "
        "paper's α = 3 never replicated anything at Zipf 1.2 in our measurements, hence 0.25).")
    plan_from: PlanFrom = option(
        "auto", "`current` plans from this call's counts (transfers overlap the dispatch), `previous` from the "
        "previous call's (Pro-Prophet's prediction, transfers prefetched under the previous layer), `auto` "
        "prefetches only while the cost model says the prediction pays.")
    online_check: bool = option(
        True, "With `auto` and `pro_prophet`: correct the planner's predictions per plan kind, timing and chunking "
        "by the layer time measured when each ran; each such arm runs once to be measured.")
    explore_every: int = option(
        16, "With the online check: about every this many calls, an arm whose measurements say it could still be "
        "the fastest runs instead, if its corrected prediction is within `explore_regret` of the best (0: never).")
    explore_regret: float = option(0.25, "How far (relative) above the best an arm's prediction may be to explore it.")
    explore_seed: int = option(0, "Seed of the exploration's random schedule.")
    balance_tolerance: float = option(
        0.05, "Arms measured within this fraction of the fastest run the one whose plan balances the load best "
        "(0: speed alone).")

    def __post_init__(self) -> None:
        if isinstance(self.lancet_chunks, str) and self.lancet_chunks.isdigit():
            self.lancet_chunks = int(self.lancet_chunks)

    def validate(self, drop_tokens: bool) -> None:
        if self.dispatch not in ("capacity", "dropless"):
            raise ValueError(f"dispatch={self.dispatch!r}: choose 'capacity' or 'dropless'")
        if self.placement not in ("none", "pro_prophet", "shadowing", "auto"):
            raise ValueError(f"placement={self.placement!r}: choose 'none', 'pro_prophet', 'shadowing' or 'auto'")
        if self.plan_from not in ("auto", "current", "previous"):
            raise ValueError(f"plan_from={self.plan_from!r}: choose 'auto', 'current' or 'previous'")
        if self.dispatch == "dropless" and drop_tokens:
            raise ValueError("dispatch='dropless' never drops tokens; pass drop_tokens=False")
        if self.lancet_chunks != "auto" and not (isinstance(self.lancet_chunks, int) and self.lancet_chunks >= 1):
            raise ValueError(f"lancet_chunks={self.lancet_chunks!r}: use 'auto' or an integer >= 1")
        if self.replan_every < 1:
            raise ValueError(f"replan_every={self.replan_every} must be at least 1")
        if self.explore_every < 0 or self.explore_regret < 0:
            raise ValueError(f"explore_every={self.explore_every} (0: never) and explore_regret={self.explore_regret} "
                             "must be >= 0")
        if not 0.0 <= self.balance_tolerance < 1.0:
            raise ValueError(f"balance_tolerance={self.balance_tolerance} must lie in [0, 1) "
                             "(0: choose on speed alone)")
        if self.exclude_fewest < 0 or (self.slots_per_rank is not None and self.slots_per_rank < 1):
            raise ValueError("exclude_fewest must be >= 0 and slots_per_rank >= 1 (or None)")
