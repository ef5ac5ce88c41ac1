"""Online check of the step planner: each arm's predictions corrected by what it actually cost.

The cost model prices every candidate from profiled constants, but a machine can hide less than
its probes read (an oversubscribed CPU overlaps a transfer with compute in the probe, not in a full
step), so the cheapest prediction is not always the fastest plan. An *arm* is what the planner can
run: a plan kind and its timing, chunked or not (``"shadowing/current"``,
``"pro_prophet/current/chunked"``). After each call the measured layer time over its prediction is
kept per arm; the median of an arm's last ``window`` ratios multiplies its next predictions. An arm
never run borrows the median over every arm's ratios, so a machine uniformly slower than modelled
changes no ranking: only what each arm costs *relative to* the others does. A *variant* arm (the
same plan, chunked; its candidate names the ``base`` arm) never run borrows its base's correction
times what variants measured over their bases so far, so one chunked run teaches every kind's.

Exploration keeps a correction from staying wrong forever. Once some arm has been measured, each
arm that never ran and has nothing to borrow from but the pooled median runs once, whatever its
prediction: the model's ranking is what is being checked, and it can be off by more than any fixed
margin (on a 2-core CPU it priced dropless dispatch at 2.3× Pro-Prophet's sets, which measured about
as fast). That costs at most one call per arm, and the arms are few. After that, the runner-up
runs now and then, only if its corrected prediction is within ``max_regret`` of the best's, the
calls between two such runs drawn from a seeded generator (``explore_every`` on average, never
fewer than half of it). An arm measured fewer than ``confident`` times is chosen on its *worst*
ratio so far, not its median: a single lucky run (a quiet moment on a shared machine) cannot make
a plan that is slower on average the choice for the next calls — every such call is lost against
the arm it displaced.

Balance breaks ties. Where arms score within the check's own noise of the best (the relative median
absolute deviation of the best arm's recent ratios, at most ``balance_tolerance``), the one whose plan
leaves the lowest load max/mean runs: the measurements cannot tell them apart, and a balanced step
also lowers the busiest rank's memory and tail latency. The guard stays: an arm that replicates is
never preferred over a measured-faster arm that does not (``replicates=False``). Plain Python: given the same
measurements in the same order (the layer max-reduces them over its ranks first) every rank makes
the same choices.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Candidate", "PlanCheck", "Selection"]


@dataclass(frozen=True)
class Candidate:
    """One arm the planner offers for this call and the cost model's seconds for it.

    ``max_over_mean`` is the load (rows computed per rank) its plan leaves, max over mean;
    ``replicates`` whether it moves expert parameters (no replication is the guard's reference).
    """

    arm: str
    predicted_s: float
    base: str | None = None
    max_over_mean: float = 1.0
    replicates: bool = False


@dataclass(frozen=True)
class Selection:
    """Which candidate runs (its index), its corrected prediction, and whether it is an exploration."""

    index: int
    corrected_s: float
    explored: bool


class PlanCheck:
    """Per-arm multiplicative corrections fitted from measured layer time, with bounded exploration."""

    def __init__(self, window: int = 5, explore_every: int = 16, max_regret: float = 0.25, seed: int = 0,
                 confident: int = 3, balance_tolerance: float = 0.05) -> None:
        if window < 1 or explore_every < 0 or max_regret < 0 or not 1 <= confident <= window:
            raise ValueError(f"window={window} must be >= 1, explore_every={explore_every} >= 0 (0: never), "
                             f"max_regret={max_regret} >= 0 and confident={confident} in [1, window]")
        if not 0.0 <= balance_tolerance < 1.0:
            raise ValueError(f"balance_tolerance={balance_tolerance} must lie in [0, 1) (0: speed alone)")
        self.balance_tolerance = balance_tolerance
        self.window = window
        self.confident = confident
        self.explore_every = explore_every
        self.max_regret = max_regret
        self._ratios: dict[str, deque[float]] = {}
        self._tried: set[str] = set()
        self._variant_factors: deque[float] = deque(maxlen=window)
        self._rng = random.Random(seed)
        self._until_explore = self._gap()

    def _gap(self) -> int:
        if self.explore_every == 0:
            return -1
        low = math.ceil(self.explore_every / 2)
        return self._rng.randint(low, max(low, self.explore_every + self.explore_every // 2))

    def samples(self, arm: str) -> int:
        return len(self._ratios.get(arm, ()))

    def _informed(self, arm: str, base: str | None) -> bool:
        return bool(self._ratios.get(arm)) or (base is not None and bool(self._ratios.get(base))
                                               and bool(self._variant_factors))

    def correction(self, arm: str, base: str | None = None) -> float:
        """Measured over predicted for ``arm``: its own recent median, else its base's times the variants'
        factor, else every arm's median, else 1."""
        own = self._ratios.get(arm)
        if own:
            return statistics.median(own)
        if self._informed(arm, base):
            return statistics.median(self._ratios[base]) * statistics.median(self._variant_factors)
        pooled = [ratio for ratios in self._ratios.values() for ratio in ratios]
        return statistics.median(pooled) if pooled else 1.0

    def corrected(self, candidate: Candidate) -> float:
        return candidate.predicted_s * self.correction(candidate.arm, candidate.base)

    def _score(self, candidate: Candidate) -> float:
        """The corrected prediction a choice is made on: an arm measured fewer than ``confident`` times
        counts its worst ratio so far."""
        own = self._ratios.get(candidate.arm)
        if own and len(own) < self.confident:
            return candidate.predicted_s * max(own)
        return self.corrected(candidate)

    def noise(self, arm: str) -> float:
        """How far ``arm``'s recent ratios scatter: their median absolute deviation over their median."""
        own = self._ratios.get(arm)
        if not own or len(own) < 2:
            return 0.0
        middle = statistics.median(own)
        return statistics.median(abs(ratio - middle) for ratio in own) / middle

    def _most_balanced(self, candidates: Sequence[Candidate], scores: list[float], fastest: int) -> int:
        """Among arms scoring within the noise of ``fastest`` (and never above a non-replicating arm's
        score), the one with the lowest load max/mean; ties to the faster, then the earlier."""
        tolerance = min(self.balance_tolerance, self.noise(candidates[fastest].arm))
        ceiling = scores[fastest] * (1.0 + tolerance)
        plain = [scores[i] for i, c in enumerate(candidates) if not c.replicates]
        if plain:
            ceiling = min(ceiling, min(plain))
        near = [i for i in range(len(candidates)) if scores[i] <= ceiling] or [fastest]
        return min(near, key=lambda i: (candidates[i].max_over_mean, scores[i], i))

    def select(self, candidates: Sequence[Candidate]) -> Selection:
        """The least corrected prediction (ties to the earlier candidate, near-ties to the more balanced one),
        or an exploration when one is due."""
        if not candidates:
            raise ValueError("select needs at least one candidate")
        corrected = [self._score(c) for c in candidates]
        fastest = min(range(len(candidates)), key=lambda i: (corrected[i], i))
        best = self._most_balanced(candidates, corrected, fastest)
        if self._until_explore > 0:
            self._until_explore -= 1
        others = [i for i in range(len(candidates)) if candidates[i].arm != candidates[best].arm]
        fresh = [i for i in others if candidates[i].arm not in self._tried
                 and not self._informed(candidates[i].arm, candidates[i].base)] if self._ratios else []
        bound = corrected[best] * (1.0 + self.max_regret)
        others = [i for i in others if corrected[i] <= bound]
        if fresh:
            pick = min(fresh, key=lambda i: (corrected[i], i))
        elif others and self._until_explore == 0:
            pick = min(others, key=lambda i: (corrected[i], self.samples(candidates[i].arm), i))
            self._until_explore = self._gap()
        else:
            self._tried.add(candidates[best].arm)
            return Selection(best, corrected[best], False)
        self._tried.add(candidates[pick].arm)
        return Selection(pick, corrected[pick], True)

    def observe(self, arm: str, predicted_s: float, measured_s: float, base: str | None = None) -> None:
        """Record what ``arm`` (a variant of ``base``, if given) cost against its prediction.

        Ignored where either time is not positive.
        """
        if not (predicted_s > 0 and measured_s > 0 and math.isfinite(predicted_s) and math.isfinite(measured_s)):
            return
        ratio = measured_s / predicted_s
        if base is not None and self._ratios.get(base):
            self._variant_factors.append(ratio / statistics.median(self._ratios[base]))
        self._ratios.setdefault(arm, deque(maxlen=self.window)).append(ratio)
