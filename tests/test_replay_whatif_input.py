"""WhatIf and anchored refuse nonsense before any replay: non-finite or negative factors, unknown names."""

from __future__ import annotations

import math

import pytest

from lightning_merak.callbacks.profiler import Trace, WhatIf
from lightning_merak.planning.replay.calibration import untraced_step_time
from lightning_merak.planning.replay.engine import anchored
from lightning_merak.planning.replay.trace import CommRecord, RankTrace, Span


def _two_ranks() -> Trace:
    """Two ranks computing 20 and 15 ms around one 1 MB all-reduce (as in test_replay_core)."""
    group = (0, 1)
    return Trace([
        RankTrace(0, [Span("step 0", "step", 0.0, 0.032, 0), Span("training_step", "FW", 0.0, 0.020, 0, 1)],
                  [CommRecord("all_reduce", "collective", group, 0, 1_000_000, 0.010, 0, complete=0.030,
                              wait_start=0.020, wait_end=0.030)]),
        RankTrace(1, [Span("step 0", "step", 0.0, 0.031, 0), Span("training_step", "FW", 0.0, 0.015, 0, 1)],
                  [CommRecord("all_reduce", "collective", group, 0, 1_000_000, 0.015, 0, complete=0.030,
                              wait_start=0.015, wait_end=0.030)])], [0.0, 0.0])


@pytest.mark.parametrize(("arguments", "message"), [
    ({"bandwidth_ratio": math.nan}, "bandwidth_ratio must be positive and finite"),
    ({"bandwidth_ratio": math.inf}, "bandwidth_ratio must be positive and finite"),
    ({"bandwidth_ratio": 0.0}, "bandwidth_ratio must be positive and finite"),
    ({"link_bytes_per_s": math.nan}, "link_bytes_per_s must be positive and finite"),
    ({"compute_ratio": (("FW", -1.0),)}, "compute_ratio gives 'FW' the factor -1.0"),
    ({"compute_ratio": (("BW", math.nan),)}, "compute_ratio gives 'BW'"),
    ({"compute_ratio": (("fw", 2.0),)}, "compute_ratio names 'fw', which is not one of FW, BW, UPDATE, host"),
    ({"compute_ratio": ("FW", 2.0)}, "compute_ratio must be a tuple of"),
    ({"comm_bytes_ratio": (("isend", -1.0),)}, "comm_bytes_ratio gives 'isend' the factor -1.0"),
    ({"comm_bytes_ratio": (("allreduce", 0.5),)}, "comm_bytes_ratio names 'allreduce', which is not one of all_reduce"),
    ({"recompute_fraction": math.nan}, r"recompute_fraction must lie in \[-1, 1\]"),
    ({"recompute_fraction": -5.0}, r"recompute_fraction must lie in \[-1, 1\]"),
    ({"recompute_fraction": 1.5}, r"recompute_fraction must lie in \[-1, 1\]"),
    ({"overlap": "no"}, "overlap must be True or False"),
])
def test_what_if_refuses_nonsense(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WhatIf(**arguments)


def test_what_if_accepts_the_edges_of_its_ranges() -> None:
    WhatIf(compute_ratio=(("FW", 0.0), ("host", 2.0)), comm_bytes_ratio=(("ddp_all_reduce", 0.0), ("irecv", 0.5)),
           recompute_fraction=-1.0, bandwidth_ratio=1e-3)
    WhatIf(recompute_fraction=1.0)


@pytest.mark.parametrize("step_s", [math.nan, math.inf, -0.01, 0.0])
def test_anchored_refuses_a_step_time_that_is_not_finite_and_positive(step_s: float) -> None:
    with pytest.raises(ValueError, match="step_s must be positive and finite"):
        anchored(_two_ranks(), step_s)


def test_anchored_on_a_trace_without_enough_untraced_steps_says_what_to_do() -> None:
    trace = _two_ranks()
    trace.meta["untraced_step_s"] = [0.03, 0.031]
    assert untraced_step_time(trace) is None
    with pytest.raises(ValueError, match="too few untraced steps.*measured_step_time"):
        anchored(trace, untraced_step_time(trace))
