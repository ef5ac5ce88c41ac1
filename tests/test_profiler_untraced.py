"""A traced run's untraced steps: the profiler times them after its window, and calibrations anchor on their median."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.profiler import MerakTraceProfiler, Trace
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.planning.replay.calibration import (
    MIN_UNTRACED_STEPS,
    Probe,
    ReplayPredictor,
    calibrate_from_traces,
    untraced_step_time,
)
from lightning_merak.planning.replay.engine import measured_step_time
from lightning_merak.planning.replay.synthesize import predict_layout
from tests.test_profiler_calibration import DP2, SHAPE, TP2, _dp2_trace, _tp2_probe

VOCAB, SEQ, BATCH = 64, 8, 2
MODEL = ModelConfig(name="gpt2", model_type="gpt2", config={
    "n_embd": 16, "n_layer": 2, "n_head": 2, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})


def _with_untraced(trace: Trace, steps: list[float]) -> Trace:
    return dataclasses.replace(trace, meta={**trace.meta, "untraced_step_s": steps})


def test_the_untraced_median_needs_enough_steps() -> None:
    steps = [0.30, 0.20, 0.22, 0.21, 0.90]
    assert untraced_step_time(_with_untraced(_dp2_trace(), steps)) == pytest.approx(0.22)
    assert untraced_step_time(_with_untraced(_dp2_trace(), steps[:MIN_UNTRACED_STEPS - 1])) is None
    assert untraced_step_time(_dp2_trace()) is None
    with pytest.raises(ValueError, match="positive seconds"):
        untraced_step_time(_with_untraced(_dp2_trace(), [0.2, 0.2, -1.0, 0.2]))


def test_a_calibration_anchors_on_its_runs_untraced_steps() -> None:
    steps = [0.080, 0.082, 0.079, 0.081, 0.200]  # the traced step reads 0.100 s
    trace = _with_untraced(_dp2_trace(), steps)
    predictor = ReplayPredictor(calibrate_from_traces(trace, SHAPE, DP2))
    assert measured_step_time(trace) == pytest.approx(0.100)
    assert predictor.step_time(DP2) == pytest.approx(statistics.median(steps))
    # other layouts keep their re-derived ratio to the traced one
    base = predictor.calibration.base
    ratio = predict_layout(base, SHAPE, TP2).step_time / predict_layout(base, SHAPE, DP2).step_time
    assert predictor.step_time(TP2) == pytest.approx(statistics.median(steps) * ratio)
    # a probe anchors on its own run's steps
    probe = _with_untraced(_tp2_probe(), [0.120] * MIN_UNTRACED_STEPS)
    probed = ReplayPredictor(calibrate_from_traces(trace, SHAPE, DP2, [Probe(probe, SHAPE, TP2)]))
    assert probed.step_time(TP2) == pytest.approx(0.120)


def test_a_correction_on_a_trace_with_its_own_untraced_steps_is_refused() -> None:
    trace = _with_untraced(_dp2_trace(), [0.09] * MIN_UNTRACED_STEPS)
    with pytest.raises(ValueError, match="the main trace already anchor"):
        calibrate_from_traces(trace, SHAPE, DP2, correction=0.9)
    probe = Probe(_with_untraced(_tp2_probe(), [0.1] * MIN_UNTRACED_STEPS), SHAPE, TP2, correction=0.95)
    with pytest.raises(ValueError, match="probe"):
        calibrate_from_traces(_dp2_trace(), SHAPE, DP2, [probe])


def test_untraced_steps_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="untraced_steps"):
        MerakTraceProfiler(untraced_steps=-1)


@pytest.mark.parametrize(("untraced", "timed"), [(1, 1), (4, 2)])
def test_the_profiler_times_untraced_steps_after_its_window(tmp_path: Path, untraced: int, timed: int) -> None:
    """Six steps: one skipped, three traced, two left. One untraced step writes the trace after it (the sixth is
    not timed); four are more than training has, so the trace is written when training ends, with two."""
    torch.manual_seed(0)
    model = build_causal_lm(MODEL, vocab_size=VOCAB)
    model.config.use_cache = False
    profiler = MerakTraceProfiler(dirpath=tmp_path, skip_steps=1, steps=3, untraced_steps=untraced)
    data = torch.randint(VOCAB, (6 * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, profiler=profiler,
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(CausalLMModule(model), DataLoader(TensorDataset(data), batch_size=BATCH))
    trace = Trace.load(profiler.paths["trace"])
    assert trace.steps() == [0, 1, 2]
    steps = trace.meta["untraced_step_s"]
    assert len(steps) == timed and all(0 < s < 60 for s in steps)
