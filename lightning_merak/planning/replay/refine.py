"""A trace's costs refined by other measurements (pure): what one traced run cannot tell apart.

A trace times every call at one size, and times a data-parallel block's backward together with the gradient
reduction it overlaps. :func:`with_block_call_cost` splits a block call into a fixed and a per-sample part from two
traces at different sizes (:func:`~lightning_merak.planning.replay.calibration.block_call_cost`);
:func:`with_call_curves`
shapes calls of other sizes by curves an in-process probe measured
(:func:`~lightning_merak.planning.measure.probe.probe_call_curves`); :func:`with_probed_backward` prices a block's
backward at
that probe's ratio where the trace's own could not be used.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from lightning_merak.planning.replay.call_curve import CallCurve
from lightning_merak.planning.replay.synthesize import LayoutSpec, StepCosts

__all__ = ["with_block_call_cost", "with_call_curves", "with_probed_backward"]


def with_block_call_cost(costs: StepCosts, layout: LayoutSpec, fixed_s: float) -> StepCosts:
    """``costs`` (calibrated on a run of ``layout``) with ``fixed_s`` of every block forward call fixed: the
    per-sample cost keeps the traced call's time, so only other micro-batch sizes replay differently."""
    if fixed_s < 0:
        raise ValueError(f"a fixed cost per call cannot be negative, got {fixed_s}")
    samples = layout.samples / layout.micro_batches / layout.tp
    call = costs.traced_block_call(samples)
    return dataclasses.replace(costs, block_call_s=min(fixed_s, call),
                               block_forward_per_sample=max(call - fixed_s, 0.0) / samples)


def with_probed_backward(costs: StepCosts, block: CallCurve, samples: float) -> StepCosts:
    """``costs`` with a block's backward priced at the ``block`` curve's backward over forward at ``samples`` per
    call, where the trace gave no timing of its own (``backward_ratio_source`` "flops"); else ``costs`` unchanged.

    A data-parallel trace's block backwards share the cores with the gradient reduction they overlap (2.0x their
    forward and more on CPU), and the profiler cannot tell that work apart: a layout whose blocks' backward runs
    without it (a pipeline, tensor parallelism) is priced better by a probe that timed the calls alone
    (:func:`~lightning_merak.planning.measure.probe.probe_call_curves`, 1.4-1.5x on the replay benchmark's blocks).
    Raises where ``samples`` lies outside the curve's sizes.
    """
    if not block.covers(samples):
        raise ValueError(f"{samples:g} samples per call lie outside the curve's {block.samples}; probe sizes around it")
    if costs.backward_ratio_source != "flops":
        return costs
    return dataclasses.replace(costs, backward_ratio=block.backward(samples) / block.forward(samples),
                               backward_ratio_source="probe")


def with_call_curves(costs: StepCosts, layout: LayoutSpec, block: CallCurve, head: Optional[CallCurve] = None,
                     prefix: Optional[CallCurve] = None, loss: Optional[CallCurve] = None) -> StepCosts:
    """``costs`` (calibrated on a run of ``layout``) with measured call curves (:mod:`.call_curve`): block and head
    calls of other sizes cost their traced time scaled by the curves' shape, so the traced layout replays as before.

    With a ``prefix`` curve a chunk's fixed work follows :meth:`StepCosts.chunk_seconds`; the last stage's head and
    loss take over what its chunks no longer charge (the trace times them together), so its traced chunks keep
    their time, and where the trace timed each stage's backward chunks (``chunk_backward_s``) they, not the FLOPs
    ratio, set the blocks' and the head's backward. A ``loss`` curve shapes the last stage's loss between chunks
    (:meth:`StepCosts.gap_seconds`).
    Raises where the traced call size lies outside a curve's sizes (the scale would be extrapolated).
    """
    reference = layout.samples / layout.micro_batches / layout.tp
    for curve in (block, head, prefix, loss):
        if curve is not None and not curve.covers(reference):
            raise ValueError(f"the traced calls hold {reference:g} samples, outside the curve's {curve.samples}; "
                             "probe sizes around the traced one")
    shaped = dataclasses.replace(costs, block_curve=block, head_curve=head, curve_reference_samples=reference,
                                 loss_curve=loss)
    if prefix is None or layout.pp < 2 or not costs.chunk_forward_s:
        return shaped
    last = layout.pp - 1
    guessed = dataclasses.replace(shaped, prefix_curve=None)
    measured = dataclasses.replace(shaped, prefix_curve=prefix)
    rest_forward = costs.rest_forward_per_sample * reference
    rest_backward = rest_forward * (costs.backward_ratio if costs.rest_backward_ratio is None
                                    else costs.rest_backward_ratio)
    rest_forward += guessed.chunk_seconds(last, reference, True) - measured.chunk_seconds(last, reference, True)
    rest_backward += guessed.chunk_seconds(last, reference, False) - measured.chunk_seconds(last, reference, False)
    block_backward = _traced_block_backward(costs, layout, prefix, reference)
    if block_backward is not None:
        # the traced backward chunks, not a FLOPs ratio, set the level: the first stage's are its blocks' and the
        # prefix's backward, the last stage's its blocks' and the head's
        measured = dataclasses.replace(measured, backward_ratio=block_backward / costs.traced_block_call(reference))
        rest_backward = costs.chunk_backward_s[last] - costs.stage_blocks[last] * block_backward
    if rest_forward <= 0:
        return measured
    return dataclasses.replace(measured, rest_forward_per_sample=rest_forward / reference,
                               rest_backward_ratio=max(rest_backward, 0.0) / rest_forward)


def _traced_block_backward(costs: StepCosts, layout: LayoutSpec, prefix: CallCurve, reference: float
                           ) -> Optional[float]:
    """A block's backward call at the traced size: the first stage's traced backward chunk less the prefix's
    measured backward, per block; None where the trace lacks per-stage chunks or blocks, or leaves nothing."""
    if len(costs.chunk_backward_s) != layout.pp or len(costs.stage_blocks) != layout.pp or not costs.stage_blocks[0]:
        return None
    block = (costs.chunk_backward_s[0] - prefix.backward(reference)) / costs.stage_blocks[0]
    return block if block > 0 and costs.traced_block_call(reference) > 0 else None
