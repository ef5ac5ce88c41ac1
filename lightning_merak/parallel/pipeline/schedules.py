"""Merak's shifted-critical-path schedule, and a stage that receives early, on torch.distributed.pipelining.

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
same masks and gradients equal plain 1F1B, and leaves the stage's buffers as it found them, so a
running statistic counts each micro-batch once. The stage methods used here are torch's
pipelining internals (pinned torch range); :func:`shifted_schedule_available` checks
they exist before the schedule is offered.

:class:`EarlyReceiveStage` posts all of a step's receives when the step starts, instead of
just before each micro-batch needs its input: on gloo a message whose receive is not posted
yet waits for the sender's transport thread, which a sender busy computing its next chunk
runs late (measured on 2 CPU cores: 2 ms median, 5–6 ms p90, against 0.02 ms when the
receive was already posted).

:class:`BufferKeepingStage`, the base of every stage merak3d builds, leaves the stage module's buffers as they were
after torch's metadata inference, which runs the module in training mode (on ``torch.empty`` inputs past the first
stage) on the first step and again after each switch between evaluation and training, and sends every input gradient
contiguous.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.pipelining import schedules as _schedules

from lightning_merak.util import random_state
from lightning_merak.util.buffers import buffers_kept

__all__ = ["BufferKeepingStage", "EarlyReceiveStage", "ScheduleShiftedCriticalPath", "early_receive_available",
           "pipeline_stage_class", "shifted_schedule_available"]

_REQUIRED = ("_check_inputs", "_initialize_stage", "_maybe_compute_loss", "_maybe_get_loss", "_update_losses")
_STAGE_REQUIRED = ("get_fwd_recv_ops", "get_bwd_recv_ops", "forward_one_chunk", "backward_one_chunk",
                   "clear_runtime_states", "is_last")


def shifted_schedule_available() -> bool:
    """Whether this torch exposes the stage and schedule internals the schedule drives."""
    return all(hasattr(Schedule1F1B, name) for name in _REQUIRED) and all(
        hasattr(_schedules, name) for name in ("_batch_p2p", "_wait_batch_p2p")
    )


def early_receive_available() -> bool:
    """Whether this torch's pipeline stage has the receive hooks :class:`EarlyReceiveStage` overrides."""
    return all(hasattr(PipelineStage, name) for name in _STAGE_REQUIRED) and all(
        hasattr(_schedules, name) for name in ("_batch_p2p", "_wait_batch_p2p"))


def pipeline_stage_class(backend: str, stages_per_rank: int = 1) -> type[PipelineStage]:
    """:class:`EarlyReceiveStage` on gloo with one stage per rank, where every receive of a step can
    be posted at its start; :class:`BufferKeepingStage` elsewhere (NCCL runs a pair's sends and
    receives on one stream, where a receive posted early blocks the sends)."""
    if backend == "gloo" and stages_per_rank == 1 and early_receive_available():
        return EarlyReceiveStage
    return BufferKeepingStage


class BufferKeepingStage(PipelineStage):
    """torch's pipeline stage, with its metadata inference leaving the stage module's buffers as they were, and its
    input gradients sent contiguous.

    The inference runs the module's forward (and, on the last stage, the loss) to learn the shapes it sends, in
    training mode for a training step: a running statistic would count an extra batch (past the first stage, one of
    uninitialised values). torch keeps the random generators as they were around it itself. A torch that names these
    methods otherwise never calls the overrides: the stage is then torch's own.
    """

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with buffers_kept(self.submod):
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with buffers_kept(self.submod):
            return super()._prepare_backward_infra(*args, **kwargs)

    def _compute_input_grads(self, *args: Any, **kwargs: Any) -> tuple[Optional[torch.Tensor], ...]:
        """torch's backward metadata inference, each input gradient contiguous: the previous stage allocates its
        gradient receive with these strides, and a receive takes contiguous buffers only."""
        return _contiguous(super()._compute_input_grads(*args, **kwargs))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        """torch's, each input gradient sent contiguous: one computed by ``torch.autograd.grad`` (the zero-bubble
        schedules' input backward) keeps the strides of the op that made it (a transpose's), which no send takes."""
        if bwd_chunk_id in self.bwd_cache:
            self.bwd_cache[bwd_chunk_id] = _contiguous(self.bwd_cache[bwd_chunk_id])
        return super().get_bwd_send_ops(bwd_chunk_id)


def _contiguous(grads: tuple[Optional[torch.Tensor], ...]) -> tuple[Optional[torch.Tensor], ...]:
    return tuple(grad.contiguous() if isinstance(grad, torch.Tensor) else grad for grad in grads)


class EarlyReceiveStage(BufferKeepingStage):
    """A pipeline stage that posts every receive of a step (forward inputs, then output gradients) at its start.

    Schedules that hold one stage per rank (1F1B, GPipe, shifted critical path) ask for a
    micro-batch's receive just before running it; here the request returns nothing to post,
    and the micro-batch waits for the receive posted at the step's start instead. Every
    micro-batch has its own receive buffer, and messages between two ranks go one way per
    kind (activations forward, gradients back), each in micro-batch order, so posting them
    all at once matches every message to the buffer it would have reached. Schedules with
    several stages per rank interleave both kinds between the same ranks and must not use it;
    nor must NCCL, which runs a pair's sends and receives in order on one stream, so a
    receive posted early would hold up the sends the other stage is waiting for.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Takes :class:`~torch.distributed.pipelining.PipelineStage`'s arguments."""
        self._posted: dict[tuple[str, int], list[dist.Work]] = {}
        self._received: set[tuple[str, int]] = set()
        self._receives_posted = False
        super().__init__(*args, **kwargs)

    def clear_runtime_states(self) -> None:
        """Start of a step (training or evaluation): nothing is posted yet."""
        if self._posted:
            raise RuntimeError(f"pipeline stage {self.stage_index} left receives {sorted(self._posted)} unconsumed")
        self._received.clear()
        self._receives_posted = False
        super().clear_runtime_states()

    def _receive_ops(self, kind: str, chunk: int) -> list[dist.P2POp]:
        if kind == "forward":
            return super().get_fwd_recv_ops(chunk)
        return super().get_bwd_recv_ops(chunk)

    def _post_receives(self) -> None:
        if self._receives_posted:
            return
        self._receives_posted = True
        kinds = [("forward", sorted(self.args_recv_info))]
        if self.has_backward and not self.is_last:
            kinds.append(("backward", sorted(self.grad_recv_info)))
        for kind, chunks in kinds:
            for chunk in chunks:
                works = _schedules._batch_p2p(self._receive_ops(kind, chunk), desc=f"{kind} receive")
                if works:
                    self._posted[(kind, chunk)] = works

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        self._post_receives()
        return []

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        self._post_receives()
        return []

    def wait_posted_receive(self, kind: str, chunk: int) -> None:
        """Wait for the micro-batch's receive; a recomputed forward finds its input already received. The chunk
        methods call it first: the measured bubble (:data:`~.busy.RECEIVE_WAIT_METHODS`) counts this wait idle."""
        self._post_receives()
        key = (kind, chunk)
        works = self._posted.pop(key, None)
        if works is not None:
            _schedules._wait_batch_p2p(works)
            self._received.add(key)
        elif key not in self._received and self._receive_ops(kind, chunk):
            raise RuntimeError(
                f"pipeline stage {self.stage_index} has no posted {kind} receive for micro-batch {chunk}"
            )

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.wait_posted_receive("forward", fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.wait_posted_receive("backward", bwd_chunk_id)
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


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
            with buffers_kept(stage.submod):
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
