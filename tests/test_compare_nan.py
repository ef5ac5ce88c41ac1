"""The step-by-step comparison fails a NaN on one side: ``nan > tolerance`` is false, so it let a NaN loss or
gradient pass as a match."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_merak.testing import TrainingTrace, assert_traces_match


def _trace(loss: float, gradient: list[float]) -> TrainingTrace:
    trace = TrainingTrace()
    trace.append(loss, {"weight": torch.tensor(gradient)})
    return trace


def test_a_nan_loss_against_a_number_fails() -> None:
    with pytest.raises(AssertionError, match="step 0: loss nan vs reference 2"):
        assert_traces_match(_trace(2.0, [1.0]), _trace(math.nan, [1.0]))


def test_a_nan_gradient_against_numbers_fails() -> None:
    with pytest.raises(AssertionError, match="gradient of weight differs"):
        assert_traces_match(_trace(2.0, [1.0, 2.0]), _trace(2.0, [math.nan, 2.0]))


def test_nan_where_the_reference_has_nan_matches() -> None:
    assert_traces_match(_trace(math.nan, [math.nan, 2.0]), _trace(math.nan, [math.nan, 2.0]))
    with pytest.raises(AssertionError, match="gradient of weight differs"):
        assert_traces_match(_trace(1.0, [math.nan, 2.0]), _trace(1.0, [math.nan, 3.0]))
