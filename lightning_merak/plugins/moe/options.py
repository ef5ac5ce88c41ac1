"""What the MoE layer adds to DeepSpeed's: its options, declared and checked once.

Plain Python (no torch, no DeepSpeed): ``merak-train``'s ``moe`` options derive their schema
from :class:`MoEOptions`'s fields, so composing a configuration stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

__all__ = ["DispatchPath", "MoEOptions", "PlacementPolicy", "PlanFrom"]

DispatchPath = Literal["capacity", "dropless"]
PlacementPolicy = Literal["none", "pro_prophet", "shadowing", "auto"]
PlanFrom = Literal["auto", "current", "previous"]


@dataclass
class MoEOptions:
    """What this layer adds to DeepSpeed's: dispatch path, placement policy, overlap.

    The defaults are plain DeepSpeed-MoE's behaviour. ``lancet_chunks`` is ``"auto"`` or a chunk
    count; a count written as digits (as a config file may hold it) becomes an integer.

    ``placement``: ``auto`` lets one planner pick, per call, between no replication, dropless
    dispatch, FasterMoE shadowing and Pro-Prophet replica sets by predicted cost
    (:mod:`.core.step_planner`); ``pro_prophet`` offers only Pro-Prophet's sets against no
    replication; ``shadowing`` is the FasterMoE baseline (its own rule, this step's counts).
    ``plan_from``: ``current`` plans from this call's counts (transfers overlap the dispatch),
    ``previous`` from the previous call's (Pro-Prophet's prediction, transfers prefetched under
    the previous layer), ``auto`` prefetches only while the cost model says the prediction pays.
    ``online_check`` (``auto`` and ``pro_prophet``): the planner's predictions are corrected per plan
    kind, timing and chunking by the layer time measured when each ran; each of these arms runs once
    to be measured, then, about every ``explore_every`` calls (0: never; seeded by ``explore_seed``), an
    arm whose measurements say it could still be the fastest runs instead if its corrected prediction is
    within ``explore_regret`` of the best; corrections are read against the load of their moment
    (:mod:`.core.plan_check`). Arms measured within the check's noise of the fastest (at most
    ``balance_tolerance``, relative; 0: speed alone) run the one whose plan balances the load best.
    Layers sharing a scheduler share the check (the first one's settings);
    block-scope Lancet's sub-batches run the model's choice unchecked.
    """

    dispatch: DispatchPath = "capacity"
    placement: PlacementPolicy = "none"
    lancet_chunks: Union[int, str] = 1
    lancet_backward: bool = True
    overlap_transfer: bool = True
    replan_every: int = 1
    replan_threshold: Optional[float] = None
    exclude_fewest: int = 0
    slots_per_rank: Optional[int] = None
    alpha: float = 0.25
    plan_from: PlanFrom = "auto"
    online_check: bool = True
    explore_every: int = 16
    explore_regret: float = 0.25
    explore_seed: int = 0
    balance_tolerance: float = 0.05

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
