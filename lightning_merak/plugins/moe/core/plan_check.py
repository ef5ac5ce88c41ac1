"""Online check of the step planner: each arm's predictions corrected by what it actually cost.

The cost model prices every candidate from profiled constants, but a machine can hide less than
its probes read (an oversubscribed CPU overlaps a transfer with compute in the probe, not in a full
step), so the cheapest prediction is not always the fastest plan. An *arm* is what the planner can
run: a plan kind and its timing, chunked or not (``"shadowing/current"``,
``"pro_prophet/current/chunked"``). Each call's measured layer time over its prediction is a *ratio*.

Ratios are read against the machine's load of their moment. On a shared machine every arm's ratio
moves with the load (±30 % from step to step), and the arms run at different moments, so raw ratios
compare an arm measured in a quiet moment with one measured in a busy one. The check keeps a *load
level*: the log ratio of each call by an arm measured ``confident`` times less that arm's own factor,
smoothed over the last calls. An arm's *residual* is its log ratio less the load level around it (the mean of
the level before the call and the next such reading), so a load spike that
spans neighbouring calls penalises no arm in particular, and an arm's factor is what it costs
relative to what ran beside it, as a paired benchmark compares plans. The median of an arm's last
``window`` residuals is its factor; ``exp(factor)`` multiplies its next predictions. An arm never run
borrows the median over every arm's residuals, so a machine uniformly slower than modelled changes
no ranking. A *variant* arm (the same plan, chunked; its candidate names the ``base`` arm) never run
borrows its base's factor plus what variants measured over their bases so far, so one chunked run
teaches every kind's.

Exploration keeps a factor from staying wrong, and is paid only where it can pay back. Once some arm
has been measured, each arm that never ran and has nothing to borrow from but the pooled median runs
once, whatever its prediction: the model's ranking is what is being checked, and it can be off by
more than any fixed margin (on a 2-core CPU it priced dropless dispatch at 2.3× Pro-Prophet's sets,
which measured about as fast). The *best* is the arm the check would choose (below). An arm measured
fewer than ``confident`` times is chosen on its *worst* residual so far, not its median: a single lucky
run cannot make a plan that is slower on average the choice for the next calls. That pessimism does not
decide whether it may run again: until it has ``confident`` samples it is explored while the lower of
its optimistic bound (below) and its prediction corrected as if it had never run (by what it would
borrow: its base's factor plus what the other variants measured over their bases, else the median over
the other arms' residuals) is within ``max_regret`` of the best's score. Its first runs may have been
cold (the first call of a warm-up) or unlucky, and one such run must not lock a plan out for good; the
cost stays bounded, at most ``confident`` runs of each arm priced within ``max_regret`` of the best. An
arm measured ``confident`` times or more runs again only if it could still be the fastest: its factor
less twice the standard error of a median of its samples (the residuals' pooled robust scatter over the
square root of its sample count), its *optimistic bound*, puts it below the best's score (an arm with
nothing measured or borrowed could be anything, so it qualifies even before the first measurement), and
its corrected prediction is within ``max_regret`` of the best's (one exploration's cost is bounded).
Explorations are spaced by a seeded gap (``explore_every`` calls on average, never fewer than half of
it); the one that runs is the eligible arm with the lowest bound it was judged on. As an arm collects
samples its bound narrows, so exploration stops once the factors are settled, and resumes only where
the scatter says they may overlap.

Balance breaks ties. Where arms score within the check's own noise of the fastest (the relative median
absolute deviation of the fastest arm's recent ratios, at most ``balance_tolerance``), the one whose plan
leaves the lowest load max/mean runs: the measurements cannot tell them apart, and a balanced step
also lowers the busiest rank's memory and tail latency. An arm that replicates is never preferred over
an arm that does not (``replicates=False``) and scores lower by more than that noise; within it, balance
decides for replicating arms as for any other. Plain Python: given the same measurements in the same
order (the layer max-reduces them over its ranks first) every rank makes the same choices.
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
    """Per-arm multiplicative corrections fitted from measured layer time against the load of the moment,
    with exploration only where an arm could still win or has run too few times to tell."""

    def __init__(self, window: int = 8, explore_every: int = 16, max_regret: float = 0.25, seed: int = 0,
                 confident: int = 3, balance_tolerance: float = 0.05, level_smoothing: float = 0.5) -> None:
        if window < 1 or explore_every < 0 or max_regret < 0 or not 1 <= confident <= window:
            raise ValueError(f"window={window} must be >= 1, explore_every={explore_every} >= 0 (0: never), "
                             f"max_regret={max_regret} >= 0 and confident={confident} in [1, window]")
        if not 0.0 <= balance_tolerance < 1.0:
            raise ValueError(f"balance_tolerance={balance_tolerance} must lie in [0, 1) (0: speed alone)")
        if not 0.0 < level_smoothing <= 1.0:
            raise ValueError(f"level_smoothing={level_smoothing} must lie in (0, 1] (1: the last call's load alone)")
        self.balance_tolerance = balance_tolerance
        self.window = window
        self.confident = confident
        self.explore_every = explore_every
        self.max_regret = max_regret
        self.level_smoothing = level_smoothing
        self._residuals: dict[str, deque[float]] = {}
        self._tried: set[str] = set()
        self._variant_offsets: deque[tuple[str, float]] = deque(maxlen=window)  # (variant arm, offset)
        self._level = 0.0
        self._pending: tuple[str, float, float] | None = None
        self._rng = random.Random(seed)
        self._until_explore = self._gap()

    def _gap(self) -> int:
        if self.explore_every == 0:
            return -1
        low = math.ceil(self.explore_every / 2)
        return self._rng.randint(low, max(low, self.explore_every + self.explore_every // 2))

    def samples(self, arm: str) -> int:
        return len(self._residuals.get(arm, ()))

    def _informed(self, arm: str, base: str | None) -> bool:
        return bool(self._residuals.get(arm)) or (base is not None and bool(self._residuals.get(base))
                                                  and bool(self._variant_offsets))

    def _offsets(self, excluding: str | None = None) -> list[float]:
        """What variants measured over their bases (the last ``window`` such runs), less ``excluding``'s own."""
        return [offset for variant, offset in self._variant_offsets if variant != excluding]

    def _factor(self, arm: str, base: str | None = None) -> float:
        """``arm``'s log correction: its residuals' median, else its base's plus the variants' offset, else the
        median over every arm's residuals, else 0."""
        own = self._residuals.get(arm)
        if own:
            return statistics.median(own)
        return self._borrowed_factor(arm, base)

    def _borrowed_factor(self, arm: str, base: str | None) -> float:
        """``arm``'s log correction as if it had never run: its base's factor plus the other variants' offset
        where it has a measured base and they ran, else the median over every other arm's residuals, else 0."""
        offsets = self._offsets(excluding=arm)
        if base is not None and base != arm and self._residuals.get(base) and offsets:
            return statistics.median(self._residuals[base]) + statistics.median(offsets)
        pooled = [residual for other, residuals in self._residuals.items() if other != arm for residual in residuals]
        return statistics.median(pooled) if pooled else 0.0

    def correction(self, arm: str, base: str | None = None) -> float:
        """Measured over predicted for ``arm`` at the load its first measurements were taken under."""
        return math.exp(self._factor(arm, base))

    def corrected(self, candidate: Candidate) -> float:
        return candidate.predicted_s * self.correction(candidate.arm, candidate.base)

    def _score(self, candidate: Candidate) -> float:
        """The corrected prediction a choice is made on: an arm measured fewer than ``confident`` times
        counts its worst residual so far."""
        own = self._residuals.get(candidate.arm)
        if own and len(own) < self.confident:
            return candidate.predicted_s * math.exp(max(own))
        return self.corrected(candidate)

    def _unsettled(self, arm: str) -> bool:
        """Whether ``arm`` has run but fewer than ``confident`` times (chosen on its worst residual, explored
        on its prediction)."""
        return 0 < self.samples(arm) < self.confident

    def _borrowed(self, candidate: Candidate) -> float:
        """``candidate``'s prediction corrected as if it had never run (:meth:`_borrowed_factor`)."""
        return candidate.predicted_s * math.exp(self._borrowed_factor(candidate.arm, candidate.base))

    def _explorable(self, candidate: Candidate, scatter: float) -> float:
        """What an exploration of ``candidate`` is judged and ordered on: its optimistic bound, or for an arm
        measured fewer than ``confident`` times the lower of that and its prediction uncorrected by its own
        samples (its first runs may have been cold)."""
        optimistic = self._optimistic(candidate, scatter)
        if self._unsettled(candidate.arm):
            return min(optimistic, self._borrowed(candidate))
        return optimistic

    def scatter(self) -> float:
        """The residuals' robust standard deviation (1.4826 × the median absolute deviation from each arm's own
        median, pooled over arms measured at least twice); 0 before any such arm."""
        deviations = [abs(residual - statistics.median(residuals)) for residuals in self._residuals.values()
                      if len(residuals) >= 2 for residual in residuals]
        return 1.4826 * statistics.median(deviations) if deviations else 0.0

    def _optimistic(self, candidate: Candidate, scatter: float) -> float:
        """The lowest corrected prediction ``candidate``'s samples make plausible (its median less two
        standard errors); an arm never measured borrows, so its bound is its correction."""
        count = self.samples(candidate.arm)
        margin = 2.0 * 1.253 * scatter / math.sqrt(count) if count else 0.0
        return candidate.predicted_s * math.exp(self._factor(candidate.arm, candidate.base) - margin)

    def noise(self, arm: str) -> float:
        """How far ``arm``'s recent residuals scatter: their median absolute deviation (relative, as logs)."""
        own = self._residuals.get(arm)
        if not own or len(own) < 2:
            return 0.0
        middle = statistics.median(own)
        return statistics.median(abs(residual - middle) for residual in own)

    def _most_balanced(self, candidates: Sequence[Candidate], scores: list[float], fastest: int) -> int:
        """Among arms scoring within the noise of ``fastest`` (and, for an arm that replicates, within that
        noise of every arm that does not), the one with the lowest load max/mean; ties to the faster, then the
        earlier."""
        tolerance = min(self.balance_tolerance, self.noise(candidates[fastest].arm))
        ceiling = scores[fastest] * (1.0 + tolerance)
        plain = [scores[i] for i, c in enumerate(candidates) if not c.replicates]
        guard = min(plain) * (1.0 + tolerance) if plain else math.inf
        near = [i for i in range(len(candidates))
                if scores[i] <= ceiling and (not candidates[i].replicates or scores[i] <= guard)] or [fastest]
        return min(near, key=lambda i: (candidates[i].max_over_mean, scores[i], i))

    def select(self, candidates: Sequence[Candidate]) -> Selection:
        """The least corrected prediction (ties to the earlier candidate, near-ties to the more balanced one),
        or an exploration when one is due and another arm is eligible: one that could still beat it, or one
        measured fewer than ``confident`` times and priced within ``max_regret`` of it."""
        if not candidates:
            raise ValueError("select needs at least one candidate")
        corrected = [self._score(c) for c in candidates]
        fastest = min(range(len(candidates)), key=lambda i: (corrected[i], i))
        best = self._most_balanced(candidates, corrected, fastest)
        if self._until_explore > 0:
            self._until_explore -= 1
        others = [i for i in range(len(candidates)) if candidates[i].arm != candidates[best].arm]
        unknown = [i for i in others if candidates[i].arm not in self._tried
                   and not self._informed(candidates[i].arm, candidates[i].base)]
        fresh = unknown if self._residuals else []
        scatter = self.scatter()
        bound = corrected[best] * (1.0 + self.max_regret)
        explorable = {i: self._explorable(candidates[i], scatter) for i in others}

        def eligible(i: int) -> bool:
            if self._unsettled(candidates[i].arm):  # its pessimistic score decides nothing here
                return explorable[i] <= bound
            return corrected[i] <= bound and (i in unknown or explorable[i] < corrected[best])

        contenders = [i for i in others if eligible(i)]
        if fresh:
            pick = min(fresh, key=lambda i: (corrected[i], i))
        elif contenders and self._until_explore == 0:
            pick = min(contenders, key=lambda i: (explorable[i], i))
            self._until_explore = self._gap()
        else:
            self._tried.add(candidates[best].arm)
            return Selection(best, corrected[best], False)
        self._tried.add(candidates[pick].arm)
        return Selection(pick, corrected[pick], True)

    def observe(self, arm: str, predicted_s: float, measured_s: float, base: str | None = None) -> None:
        """Record what ``arm`` (a variant of ``base``, if given) cost against its prediction.

        Ignored where either time is not positive. A call by an arm measured ``confident`` times reads the load:
        its log ratio less its factor (an arm's first runs cannot tell its own cost from the load's). That
        reading completes the previous call's reference (the mean of the level before it and this reading)
        and moves the level.
        """
        if not (predicted_s > 0 and measured_s > 0 and math.isfinite(predicted_s) and math.isfinite(measured_s)):
            return
        log_ratio = math.log(measured_s / predicted_s)
        own = self._residuals.get(arm)
        reading = log_ratio - statistics.median(own) if own and len(own) >= self.confident else None
        if reading is not None and self._pending is not None:
            pending_arm, pending_log_ratio, level_before = self._pending
            self._residuals[pending_arm][-1] = pending_log_ratio - (level_before + reading) / 2
        residual = log_ratio - self._level
        if base is not None and self._residuals.get(base):
            self._variant_offsets.append((arm, residual - statistics.median(self._residuals[base])))
        self._residuals.setdefault(arm, deque(maxlen=self.window)).append(residual)
        self._pending = (arm, log_ratio, self._level)
        if reading is not None:
            self._level += self.level_smoothing * (reading - self._level)
