"""Call curves for the micro-batch what-if (pure), the replay's use of them, and the in-process probe."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.planning.measure.probe import next_token_loss, probe_call_curves
from lightning_merak.planning.replay.call_curve import CallCurve, interpolate
from lightning_merak.planning.replay.refine import with_call_curves
from lightning_merak.planning.replay.synthesize import (
    LayoutSpec,
    ModelShape,
    StepCosts,
    predict_from_traced,
    predict_layout,
)

COSTS = StepCosts(block_forward_per_sample=0.001, rest_forward_per_sample=0.0, backward_ratio=2.0,
                  update_per_param=0.0, host_per_step=0.0, op_fixed_s=0.0, link_bytes_per_s=1e15)
SHAPE = ModelShape(blocks=2, block_params=1000, other_params=0, hidden=8, seq=4)
PP2_M2 = LayoutSpec(dp=1, pp=2, tp=1, micro_batches=2, samples=4)
"""Two samples per call: each stage's block call is 2 ms forward and 4 ms backward (1 ms per sample, backward 2x)."""
CURVE = CallCurve(samples=(1.0, 2.0, 4.0), forward_s=(0.003, 0.004, 0.006), backward_s=(0.004, 0.008, 0.016))
"""Forward with a fixed part (1 ms at 1 sample is 3/4 of 2 samples'); backward proportional to samples."""


def test_interpolation_is_piecewise_linear_and_extends_the_end_segments() -> None:
    xs, ys = (1.0, 2.0, 4.0), (3.0, 4.0, 8.0)
    assert [interpolate(xs, ys, x) for x in (1.0, 1.5, 2.0, 3.0, 4.0)] == pytest.approx([3.0, 3.5, 4.0, 6.0, 8.0])
    assert interpolate(xs, ys, 8.0) == pytest.approx(16.0)  # the last segment's slope, 2 per sample
    assert interpolate(xs, ys, 0.5) == pytest.approx(2.5)  # the first segment's slope, 1 per sample
    assert interpolate((1.0, 2.0), (1.0, 4.0), 0.0) == 0.0  # floored at zero
    with pytest.raises(ValueError, match="two points"):
        interpolate((1.0,), (1.0,), 1.0)


def test_a_curve_refuses_sizes_and_times_it_cannot_interpolate() -> None:
    with pytest.raises(ValueError, match="increasing"):
        CallCurve((2.0, 1.0), (1.0, 1.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="same number"):
        CallCurve((1.0, 2.0), (1.0,), (1.0, 1.0))
    with pytest.raises(ValueError, match="positive"):
        CallCurve((1.0, 2.0), (1.0, 0.0), (1.0, 1.0))
    assert CURVE.forward_scale(1.0, 2.0) == pytest.approx(0.75)
    assert CURVE.backward_scale(4.0, 2.0) == pytest.approx(2.0)


def test_curves_keep_the_traced_call_and_shape_the_others() -> None:
    shaped = with_call_curves(COSTS, PP2_M2, CURVE)
    assert shaped.curve_reference_samples == 2.0
    # the traced size costs what the trace said, forward and backward (2 ms, 2 x 2 ms)
    assert shaped.block_seconds(2.0, True) == pytest.approx(0.002)
    assert shaped.block_seconds(2.0, False) == pytest.approx(0.004)
    # one sample: 3/4 of the traced forward (the per-sample line said 1/2), backward halves with the curve
    assert shaped.block_seconds(1.0, True) == pytest.approx(0.0015)
    assert shaped.block_seconds(1.0, False) == pytest.approx(0.002)
    assert shaped.block_seconds(1.0, False, recompute=1.0) == pytest.approx(0.0035)
    assert predict_layout(shaped, SHAPE, PP2_M2).step_time == pytest.approx(
        predict_layout(COSTS, SHAPE, PP2_M2).step_time)
    # 4 micro-batches of 1 sample on 2 stages, 1F1B with free links: (M + S - 1) * (f + b)
    m4 = LayoutSpec(dp=1, pp=2, tp=1, micro_batches=4, samples=4)
    assert predict_layout(COSTS, SHAPE, m4).step_time == pytest.approx(5 * 0.003)
    assert predict_layout(shaped, SHAPE, m4).step_time == pytest.approx(5 * 0.0035)


def test_a_head_curve_shapes_the_head_and_loss() -> None:
    costs = dataclasses.replace(COSTS, rest_forward_per_sample=0.001, rest_backward_ratio=3.0)
    shaped = with_call_curves(costs, PP2_M2, CURVE, head=CURVE)
    assert shaped.rest_seconds(2.0, True) == pytest.approx(0.002)
    assert shaped.rest_seconds(2.0, False) == pytest.approx(0.006)
    assert shaped.rest_seconds(1.0, True) == pytest.approx(0.0015)
    assert shaped.rest_seconds(1.0, False) == pytest.approx(0.003)
    assert with_call_curves(costs, PP2_M2, CURVE).rest_seconds(1.0, True) == pytest.approx(0.001)  # no head curve


PREFIX = CallCurve(samples=(1.0, 2.0, 4.0), forward_s=(0.0005, 0.0006, 0.0008), backward_s=(0.0002, 0.0003, 0.0005))
"""The first stage's own work: mostly fixed, its backward (the embedding's gradient) cheaper than its forward."""


def test_a_prefix_curve_prices_the_chunks_own_work_by_stage_and_size() -> None:
    # a trace whose chunks each took 1 ms beyond their blocks; the head 1 ms a sample, its backward 3x
    traced = dataclasses.replace(COSTS, chunk_forward_s=0.001, rest_forward_per_sample=0.001, rest_backward_ratio=3.0)
    guessed = with_call_curves(traced, PP2_M2, CURVE, CURVE)
    shaped = with_call_curves(traced, PP2_M2, CURVE, CURVE, PREFIX)
    # without the prefix: 1 ms forward on every stage, backward at the blocks' 2x
    assert [guessed.chunk_seconds(s, 1.0, f) for s in (0, 1) for f in (True, False)] == pytest.approx(
        [0.001, 0.002, 0.001, 0.002])
    # first stage: the traced 1 ms at 2 samples, less the prefix's 0.1 ms drop at 1 sample; backward the prefix's
    assert shaped.chunk_seconds(0, 2.0, True) == pytest.approx(0.001)
    assert shaped.chunk_seconds(0, 1.0, True) == pytest.approx(0.0009)
    assert shaped.chunk_seconds(0, 1.0, False) == pytest.approx(0.0002)
    assert shaped.chunk_seconds(0, 4.0, False, recompute=1.0) == pytest.approx(0.0005)
    # later stages: the traced 1 ms less the prefix's 0.6 ms, whatever the size, and no backward
    assert [shaped.chunk_seconds(1, n, True) for n in (1.0, 4.0)] == pytest.approx([0.0004, 0.0004])
    assert shaped.chunk_seconds(1, 1.0, False) == 0.0
    # the last stage's head takes over what its chunks no longer charge: 2 + 0.6 ms forward, 6 + 2 ms backward
    assert shaped.rest_seconds(2.0, True) == pytest.approx(0.0026)
    assert shaped.rest_seconds(2.0, False) == pytest.approx(0.008)
    for forward in (True, False):
        assert (shaped.rest_seconds(2.0, forward) + shaped.chunk_seconds(1, 2.0, forward)) == pytest.approx(
            guessed.rest_seconds(2.0, forward) + guessed.chunk_seconds(1, 2.0, forward))
    # one stage, or a trace without fixed chunk work: the prefix changes nothing
    assert with_call_curves(traced, LayoutSpec(1, 1, 1, 2, 4), CURVE, CURVE, PREFIX).prefix_curve is None
    assert with_call_curves(COSTS, PP2_M2, CURVE, CURVE, PREFIX).prefix_curve is None


def test_a_cheaper_measured_chunk_backward_lowers_the_cost_of_more_micro_batches() -> None:
    traced = dataclasses.replace(COSTS, chunk_forward_s=0.001, rest_forward_per_sample=0.001, rest_backward_ratio=3.0)
    m4 = LayoutSpec(dp=1, pp=2, tp=1, micro_batches=4, samples=4)
    guessed = predict_from_traced(with_call_curves(traced, PP2_M2, CURVE, CURVE), SHAPE, PP2_M2, m4, 0.012)
    probed = predict_from_traced(with_call_curves(traced, PP2_M2, CURVE, CURVE, PREFIX), SHAPE, PP2_M2, m4, 0.012)
    assert probed < guessed


def test_traced_backward_chunks_set_the_blocks_and_heads_backward_level() -> None:
    # stages of 3 and 1 blocks at 2 ms forward a call; backward chunks traced at 9.3 ms (first stage: its blocks
    # and the prefix's 0.3 ms) and 10 ms (last stage: a block and the head)
    traced = dataclasses.replace(COSTS, chunk_forward_s=0.001, rest_forward_per_sample=0.001, rest_backward_ratio=3.0,
                                 stage_blocks=(3, 1), chunk_backward_s=(0.0093, 0.010))
    shaped = with_call_curves(traced, PP2_M2, CURVE, CURVE, PREFIX)
    # a block's backward is 3 ms at the traced size, not the FLOPs ratio's 4 ms; other sizes keep the curve's shape
    assert shaped.block_seconds(2.0, False) == pytest.approx(0.003)
    assert shaped.block_seconds(1.0, False) == pytest.approx(0.0015)
    assert shaped.block_seconds(2.0, False, recompute=1.0) == pytest.approx(0.005)
    # the head takes the rest of the last stage's chunk: 10 - 3 ms
    assert shaped.rest_seconds(2.0, False) == pytest.approx(0.007)
    # the traced chunks are rebuilt as traced
    assert shaped.chunk_seconds(0, 2.0, False) + 3 * shaped.block_seconds(2.0, False) == pytest.approx(0.0093)
    assert shaped.block_seconds(2.0, False) + shaped.rest_seconds(2.0, False) == pytest.approx(0.010)
    # without per-stage chunks (or a prefix to take out of them) the FLOPs ratio stays
    for costs, prefix in ((dataclasses.replace(traced, chunk_backward_s=()), PREFIX), (traced, None)):
        assert with_call_curves(costs, PP2_M2, CURVE, CURVE, prefix).block_seconds(2.0, False) == pytest.approx(0.004)


def test_a_loss_curve_shapes_the_last_stages_gap_after_a_forward_chunk() -> None:
    # 0.5 / 3 ms of the loop after a forward chunk, 0.1 / 0.2 ms after a backward one (stage 0 / stage 1)
    traced = dataclasses.replace(COSTS, chunk_host_s=(0.0005, 0.003), chunk_host_after_backward_s=(0.0001, 0.0002))
    shaped = with_call_curves(traced, PP2_M2, CURVE, loss=PREFIX)
    # the loss's probe: 0.6 ms at the traced 2 samples, 0.5 at one, 0.8 at four; the traced 3 ms keeps that shape
    assert [shaped.gap_seconds(1, 2, True, n) for n in (1.0, 2.0, 4.0)] == pytest.approx([0.0025, 0.003, 0.004])
    assert [shaped.gap_seconds(s, 2, False, 1.0) for s in (0, 1)] == pytest.approx([0.0001, 0.0002])
    assert shaped.gap_seconds(0, 2, True, 1.0) == pytest.approx(0.0005)  # no loss on the first stage
    assert with_call_curves(traced, PP2_M2, CURVE).gap_seconds(1, 2, True, 1.0) == pytest.approx(0.003)


def test_curves_must_hold_the_traced_size() -> None:
    with pytest.raises(ValueError, match="probe sizes around"):
        with_call_curves(COSTS, LayoutSpec(1, 2, 1, 1, 8), CURVE)
    with pytest.raises(ValueError, match="probe sizes around"):
        with_call_curves(COSTS, PP2_M2, CURVE, prefix=CallCurve((4.0, 8.0), (1.0, 1.0), (1.0, 1.0)))


def test_a_prediction_from_the_traced_run_keeps_only_the_re_derived_change() -> None:
    m4 = LayoutSpec(dp=1, pp=2, tp=1, micro_batches=4, samples=4)
    # re-derived: 3 x 6 ms at M=2, 5 x 3 ms at M=4; the traced run measured 12 ms at M=2
    assert predict_from_traced(COSTS, SHAPE, PP2_M2, PP2_M2, 0.012) == pytest.approx(0.012)
    assert predict_from_traced(COSTS, SHAPE, PP2_M2, m4, 0.012) == pytest.approx(0.010)
    slower = dataclasses.replace(COSTS, block_forward_per_sample=0.002)
    assert predict_from_traced(COSTS, SHAPE, PP2_M2, m4, 0.012, target_costs=slower) == pytest.approx(0.020)
    with pytest.raises(ValueError, match="positive"):
        predict_from_traced(COSTS, SHAPE, PP2_M2, m4, 0.0)


TINY_LLAMA = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False})


def test_the_probe_times_every_size_with_the_given_loss_and_leaves_no_gradients() -> None:
    torch.manual_seed(0)
    model = build_causal_lm(TINY_LLAMA, 64)
    model.config.use_cache = False
    tokens = torch.randint(64, (4, 8))
    batch_sizes: list[int] = []

    def counted_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        batch_sizes.append(logits.size(0))
        assert logits.shape == (batch.size(0), 8, 64)
        return next_token_loss(logits, batch)

    block, head, prefix, alone = probe_call_curves(model, tokens, (1, 2, 4), rounds=3, warmup=1, loss=counted_loss)
    assert block.samples == head.samples == prefix.samples == alone.samples == (1.0, 2.0, 4.0)
    assert min(block.forward_s + block.backward_s + head.forward_s + head.backward_s) > 0
    assert min(prefix.forward_s + prefix.backward_s + alone.forward_s + alone.backward_s) > 0
    assert sorted(batch_sizes) == [1] * 8 + [2] * 8 + [4] * 8  # (warm-up + rounds) calls per size, head and loss
    assert all(p.grad is None for p in model.parameters())


def test_the_probe_refuses_sizes_before_timing() -> None:
    model = build_causal_lm(TINY_LLAMA, 64)
    tokens = torch.randint(64, (4, 8))
    with pytest.raises(ValueError, match="increasing"):
        probe_call_curves(model, tokens, (2, 1))
    with pytest.raises(ValueError, match="rows of tokens"):
        probe_call_curves(model, tokens, (1, 8))
