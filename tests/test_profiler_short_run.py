"""A run too short for MerakTraceProfiler's window: warned at setup where ``max_steps`` tells, and at teardown
whenever the window was not written (before, such a run wrote nothing and said nothing)."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_merak.callbacks.profiler import MerakTraceProfiler


def _fit(tmp_path: Path, **limits: int) -> MerakTraceProfiler:
    profiler = MerakTraceProfiler(dirpath=tmp_path, skip_steps=2, steps=3, untraced_steps=0, block_spans=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, profiler=profiler,
                         num_sanity_val_steps=0, limit_val_batches=0, **limits)
    trainer.fit(BoringModel())
    return profiler


def test_max_steps_short_of_the_window_is_warned_at_setup_and_teardown(tmp_path: Path) -> None:
    with pytest.warns(UserWarning) as caught:
        profiler = _fit(tmp_path, max_steps=3)
    messages = [str(warning.message) for warning in caught if "MerakTraceProfiler" in str(warning.message)]
    assert len(messages) == 2, messages
    assert "max_steps=3 ends the run after 3 batches" in messages[0] and "raise max_steps" in messages[0]
    assert "wrote no trace: training ended after 3 training batches" in messages[1]
    assert profiler.paths == {}


def test_an_epoch_short_of_the_window_is_warned_at_teardown(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="wrote no trace: training ended after 4 training batches") as caught:
        _fit(tmp_path, max_epochs=1, limit_train_batches=4)
    assert sum("MerakTraceProfiler" in str(warning.message) for warning in caught) == 1


def test_a_run_that_holds_the_window_writes_it_without_warning(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profiler = _fit(tmp_path, max_steps=5)
    assert not [warning for warning in caught if "MerakTraceProfiler" in str(warning.message)]
    assert profiler.paths["trace"].exists()
