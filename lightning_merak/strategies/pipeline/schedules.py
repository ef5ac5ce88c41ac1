"""Merak's shifted-critical-path schedule on torch.distributed.pipelining stages.

Under 1F1B, stage ``s`` of ``S`` finishes with ``S - s - 1`` backward passes whose
gradients arrive one after another from the next stage; the stage idles while it waits.
This schedule moves work into those waits:

* the forwards of exactly those micro-batches (whose backward falls in the cool-down)
  keep none of the tensors autograd would save, only their inputs and the RNG state, so
  their activations are not held through the steady phase (grad mode stays on, so the
  kernels — and the dropout masks they draw — are the ones the recomputation uses);
* before blocking on such a micro-batch's gradient, the stage recomputes its forward
  (recompute-ahead), overlapping the recomputation with the wait instead of adding it
  to the critical path;
* the last stage recomputes nothing: its backward follows its forward immediately.

Recomputation restores the RNG state of the original forward, so dropout draws the
same masks and gradients equal plain 1F1B. The stage methods used here are torch's
pipelining internals (pinned torch range); :func:`shifted_schedule_available` checks
they exist before the schedule is offered.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.pipelining import schedules as _schedules

from lightning_merak.strategies import random_state

__all__ = ["ScheduleShiftedCriticalPath", "shifted_schedule_available"]

_REQUIRED = ("_check_inputs", "_initialize_stage", "_maybe_compute_loss", "_maybe_get_loss", "_update_losses")


def shifted_schedule_available() -> bool:
    """Whether this torch exposes the stage and schedule internals the schedule drives."""
    return all(hasattr(Schedule1F1B, name) for name in _REQUIRED) and all(
        hasattr(_schedules, name) for name in ("_batch_p2p", "_wait_batch_p2p")
    )


def _drop_saved(tensor: torch.Tensor) -> None:
    return None


def _saved_was_dropped(packed: None) -> torch.Tensor:
    raise RuntimeError("a graph-free forward was differentiated; its micro-batch should have been recomputed")


class ScheduleShiftedCriticalPath(Schedule1F1B):
    """1F1B order with graph-free cool-down forwards recomputed while their gradients are in flight."""

    def _step_microbatches(
        self,
        arg_mbs: Optional[list] = None,
        kwarg_mbs: Optional[list] = None,
        target_mbs: Optional[list] = None,
        losses: Optional[list] = None,
        return_outputs: bool = True,
        loss_kwargs: Optional[dict[str, Any]] = None,
    ) -> None:
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
        stage = self._stage
        count = self._n_microbatches
        warmup = min(count, self._num_stages - stage.stage_index)
        deferred = set() if stage.is_last or not self._has_backward else set(range(count - warmup + 1, count))
        rng_before: dict[int, random_state.GeneratorStates] = {}
        forward_sends: dict[int, list] = {}
        pending: list[list] = []

        def run_forward(index: int) -> None:
            _schedules._wait_batch_p2p(_schedules._batch_p2p(stage.get_fwd_recv_ops(index), desc="fwd_recv"))
            if index in deferred:
                rng_before[index] = random_state.capture()
                with torch.autograd.graph.saved_tensors_hooks(_drop_saved, _saved_was_dropped):
                    output = stage.forward_one_chunk(index, arg_mbs[index], kwarg_mbs[index], return_outputs)
            else:
                output = stage.forward_one_chunk(index, arg_mbs[index], kwarg_mbs[index], return_outputs)
            self._maybe_compute_loss(stage, output, target_mbs, index, loss_kwargs)
            forward_sends[index] = _schedules._batch_p2p(stage.get_fwd_send_ops(index), desc="fwd_send")

        def recompute(index: int) -> None:
            _schedules._wait_batch_p2p(forward_sends.pop(index))
            resume = random_state.capture()
            random_state.restore(rng_before.pop(index))
            stage.forward_one_chunk(index, arg_mbs[index], kwarg_mbs[index], False)
            random_state.restore(resume)

        def run_backward(index: int) -> None:
            gradients_in_flight = _schedules._batch_p2p(stage.get_bwd_recv_ops(index), desc="bwd_recv")
            if index in deferred:
                recompute(index)
            _schedules._wait_batch_p2p(gradients_in_flight)
            stage.backward_one_chunk(index, loss=self._maybe_get_loss(stage, index),
                                     last_backward=index == count - 1)
            pending.append(_schedules._batch_p2p(stage.get_bwd_send_ops(index), desc="bwd_send"))

        next_forward = 0
        for _ in range(warmup):
            run_forward(next_forward)
            next_forward += 1
        for next_backward in range(count):
            if self._has_backward:
                run_backward(next_backward)
            if next_forward < count:
                run_forward(next_forward)
                next_forward += 1
        for works in [*forward_sends.values(), *pending]:
            _schedules._wait_batch_p2p(works)
        self._update_losses(stage, losses)
        if self._has_backward:
            stage.perform_reduce_grad(count if self.scale_grads else 1)
