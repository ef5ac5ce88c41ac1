"""A call's time as a function of its samples, measured at a few sizes (pure).

A traced run times a block call at one size only. Smaller micro-batches do not shrink a call in proportion: its
fixed part (Python, kernel launches, autograd bookkeeping) stays, and on a CPU the per-sample part is not linear
either (a one-sample call of the replay benchmark's block took about 0.55 of a four-sample one, not 0.25).
:class:`CallCurve` holds forward and backward seconds per call measured at several sizes
(:mod:`lightning_merak.planning.measure.probe` times them in one process) and interpolates piecewise-linearly between
them; the replay uses its *shape* (:meth:`CallCurve.forward_scale`): a call at ``n`` samples costs the traced
call times ``curve(n) / curve(traced size)``, so the trace keeps setting the level and the probe only says how
the call grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["CallCurve", "interpolate"]


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """The piecewise-linear function through (``xs``, ``ys``) (``xs`` increasing) at ``x``; beyond the ends, the
    line through the two nearest points, floored at zero."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"interpolation needs at least two points and as many values, got {len(xs)} / {len(ys)}")
    index = 1
    while index < len(xs) - 1 and x > xs[index]:
        index += 1
    x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


@dataclass(frozen=True)
class CallCurve:
    """Seconds of one call's forward and backward at each of ``samples`` (increasing, at least two sizes)."""

    samples: tuple[float, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.samples) < 2 or not len(self.samples) == len(self.forward_s) == len(self.backward_s):
            raise ValueError("a call curve needs the same number (at least two) of sizes, forward and backward times; "
                             f"got {len(self.samples)} / {len(self.forward_s)} / {len(self.backward_s)}")
        if any(b <= a for a, b in zip(self.samples, self.samples[1:])) or self.samples[0] <= 0:
            raise ValueError(f"a call curve's sizes must be positive and increasing, got {self.samples}")
        if min(self.forward_s + self.backward_s) <= 0:
            raise ValueError("a call curve's times must be positive; time the calls again (a clock that did not move "
                             "means too few repetitions)")

    def covers(self, samples: float) -> bool:
        """Whether ``samples`` lies within the measured sizes (outside, the curve would be extrapolated)."""
        return self.samples[0] <= samples <= self.samples[-1]

    def forward(self, samples: float) -> float:
        """Seconds of a forward call on ``samples`` samples."""
        return interpolate(self.samples, self.forward_s, samples)

    def backward(self, samples: float) -> float:
        """Seconds of a backward call on ``samples`` samples."""
        return interpolate(self.samples, self.backward_s, samples)

    def forward_scale(self, samples: float, reference: float) -> float:
        """A forward call at ``samples`` over one at ``reference`` samples."""
        return self.forward(samples) / self.forward(reference)

    def backward_scale(self, samples: float, reference: float) -> float:
        """A backward call at ``samples`` over one at ``reference`` samples."""
        return self.backward(samples) / self.backward(reference)

    def describe(self) -> dict[str, list[float]]:
        """Milliseconds per size, for reports."""
        return {"samples": list(self.samples), "forward_ms": [round(1e3 * t, 4) for t in self.forward_s],
                "backward_ms": [round(1e3 * t, 4) for t in self.backward_s]}
