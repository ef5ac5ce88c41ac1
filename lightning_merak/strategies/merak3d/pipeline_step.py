"""A pipelined module's step: torch.distributed.pipelining's schedule in place of ``compute_loss`` and ``forward``.

Once the model is cut into stages, :class:`PipelineStep` runs each batch through the schedule:
training batches compute their gradients inside the schedule (held aside until Lightning's
``backward``), evaluation batches run without gradients, and every rank of a replica gets the
last stage's loss or logits. With a router aux loss (the stages carry router logits), each micro-batch's loss
adds it (:class:`~lightning_merak.parallel.pipeline.router_aux.RouterAuxLoss`) and the module's
``_router_aux_loss`` gets its mean over the micro-batches, for logging as without stages.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.parallel.context.model import IGNORE_INDEX
from lightning_merak.parallel.context.stages import gather_stage_logits
from lightning_merak.parallel.data.token_mean import ReplicaTokens, TokenWeightedLoss, scored_tokens
from lightning_merak.parallel.layout import MULTI_STAGE_SCHEDULES, LayoutGroups
from lightning_merak.parallel.pipeline.busy import StageBusyClock
from lightning_merak.parallel.pipeline.embedding_stages import average_rows_gradients, split_vocabulary_parameters
from lightning_merak.parallel.pipeline.outside_parameters import parameters_outside, share_last_stage_gradients
from lightning_merak.parallel.pipeline.router_aux import RouterAuxLoss
from lightning_merak.parallel.pipeline.schedules import ScheduleShiftedCriticalPath, pipeline_stage_class
from lightning_merak.parallel.pipeline.stage import RankStages
from lightning_merak.parallel.tensor.vocab import vocab_parallel_loss

__all__ = ["PipelineStep", "begin_vocabulary", "end_vocabulary", "hold_gradients",
           "restore_gradients", "watch_shape_inference"]

HeldGradients = list[tuple[nn.Parameter, Optional[torch.Tensor]]]


def hold_gradients(parameters: list[nn.Parameter], passes: int, scaled_later: frozenset[int]) -> HeldGradients:
    """Take the gradients a step's ``passes`` backward passes left on ``parameters`` off them, each divided by
    ``passes`` (but those the data-parallel reduction divides, ``scaled_later``): Lightning zeroes gradients
    between its training step and its backward, where :func:`restore_gradients` puts them back."""
    with torch.no_grad():
        for param in parameters:
            if param.grad is not None and id(param) not in scaled_later:
                param.grad.div_(passes)
    held = [(param, param.grad) for param in parameters]
    for param in parameters:
        param.grad = None
    return held


def restore_gradients(held: HeldGradients) -> None:
    """Put back the gradients :func:`hold_gradients` took."""
    for param, grad in held:
        param.grad = grad


class PipelineStep:
    """The schedule over this rank's ``stages`` of ``module`` (a LightningModule), and what it left to do.

    ``loss_fn`` scores one micro-batch's logits against its targets on the last stage. With the whole module
    contract, :meth:`loss` replaces the module's ``compute_loss`` and :meth:`forward` its ``forward``; otherwise
    the network's call runs :meth:`run` and :meth:`forward` (:class:`~.network.PipelinedNetwork`).
    ``token_weighted``: ``loss_fn`` (or the split head's) is next-token cross-entropy, each micro-batch's weighted
    by its scored tokens (:class:`~lightning_merak.parallel.data.token_mean.TokenWeightedLoss`).
    """

    def __init__(self, module: Any, stages: RankStages, groups: LayoutGroups, device: torch.device,
                 loss_fn: Callable[[Any, Any], torch.Tensor], token_weighted: bool = False) -> None:
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
        )

        self._module = module
        self._stages = stages
        self._groups = groups
        self._device = device
        self._pending_gradients: list[tuple[nn.Parameter, Optional[torch.Tensor]]] = []
        self._first_shape: Optional[tuple[int, ...]] = None
        """The shape of the first batch's inputs, which the stages inferred their buffers from."""
        self._outside: Optional[list[nn.Parameter]] = None
        """The module's trainable parameters outside the stages
        (:mod:`~lightning_merak.parallel.pipeline.outside_parameters`), found on the first training step (the stages
        replace the network after this step is made)."""
        self.scaled_later: frozenset[int] = frozenset()
        """Parameters (by id) whose summed micro-batch gradients the data-parallel reduction divides by the
        micro-batches, with the replicas; the step divides the others' (collectives may still be running on the
        former's, so the schedule's own scaling, which would touch all of them, is off)."""
        layout = groups.layout
        self._vocabulary = stages.vocabulary
        """The LM head split over the pipeline ranks (``vocab_stages``): its exchange scores the micro-batches."""
        self._embedding = stages.embedding
        """The input embedding split with it: its exchange serves the first stage's lookups."""
        if self._vocabulary is not None:
            loss_fn = self._vocabulary.loss
        loss_fn = vocab_parallel_loss(loss_fn, stages)
        self._token_weights: Optional[TokenWeightedLoss] = None
        """The micro-batches' weights by scored tokens (the split head weighs its own); None: their plain mean."""
        self._token_weighted = token_weighted
        self._replicas = ReplicaTokens(groups.data_parallel_group if layout.batch_replicas > 1 else None)
        """The scored tokens of the global batch, over the replicas: the weights make the replicas' average the
        global token mean."""
        if token_weighted and self._vocabulary is None:
            loss_fn = self._token_weights = TokenWeightedLoss(loss_fn, layout.micro_batches, self._replicas)
        self._router_aux_loss: Optional[RouterAuxLoss] = None
        if stages.router_aux is not None:
            loss_fn = self._router_aux_loss = RouterAuxLoss(loss_fn, stages.router_aux)
        if layout.schedule == "interleaved_zero_bubble":
            loss_fn = _detachable_loss(loss_fn)
        pp_group = groups.pipeline_group
        stage_class = pipeline_stage_class(dist.get_backend(pp_group), layout.virtual_stages)
        pipeline_stages = [
            stage_class(part, part.stage_index, part.num_stages, device, group=pp_group)
            for part in stages
        ]
        self.clock = StageBusyClock(pipeline_stages, device)
        """This rank's chunk compute and schedule time in the last training step (the measured bubble)."""
        if layout.schedule in MULTI_STAGE_SCHEDULES:
            schedule_class = {"interleaved_1f1b": ScheduleInterleaved1F1B,
                              "interleaved_zero_bubble": ScheduleInterleavedZeroBubble}[layout.schedule]
            self._schedule = schedule_class(pipeline_stages, layout.micro_batches,
                                            loss_fn=loss_fn, scale_grads=False)
        else:
            schedule_class = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
                              "shifted_critical_path": ScheduleShiftedCriticalPath}[layout.schedule]
            self._schedule = schedule_class(pipeline_stages[0], layout.micro_batches,
                                            loss_fn=loss_fn, scale_grads=False)
        if self._vocabulary is not None:
            watch_shape_inference(self._vocabulary, self._schedule)

    def loss(self, batch: Any) -> torch.Tensor:
        """Run the schedule on ``batch``; every rank returns the mean micro-batch loss (and, with a router aux
        loss, sets the module's ``_router_aux_loss`` to its mean).

        The schedule computes gradients inside the training step, but Lightning zeroes
        gradients between ``training_step`` and ``backward``; they are held aside here and
        put back by :meth:`restore_gradients`.
        """
        inputs, targets = self._module.split_batch(batch)
        return self.run(inputs, targets)

    @property
    def micro_batches(self) -> int:
        return self._groups.layout.micro_batches

    def run(self, inputs: torch.Tensor, targets: Any) -> torch.Tensor:
        """:meth:`loss` of a batch already split into the network's ``inputs`` and the loss's ``targets``."""
        module = self._module
        fill = (not module.training and self._token_weighted and self._router_aux_loss is None
                and isinstance(targets, torch.Tensor))  # filler samples whose targets score no token: loss exact
        inputs = self._stage_shaped(inputs, fill)
        if fill:
            targets = _filled(targets, inputs.shape[0], IGNORE_INDEX)
        self._groups.layout.check_batch(inputs.shape[0])
        stage = self._stages
        args = (inputs,) if stage.is_first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if stage.is_last else {}
        if self._router_aux_loss is not None:
            self._router_aux_loss.values.clear()
        self._weigh_tokens(targets)
        if module.training:
            outside = self._outside_parameters()
            parameters = [p for p in stage.parameters() if p.requires_grad] + outside
            for param in parameters:
                param.grad = None
            begin_vocabulary(stage, inputs, targets, self.micro_batches, backward=True)
            with self.clock.step():
                self._schedule.step(*args, return_outputs=False, **kwargs)
                end_vocabulary(stage, backward=True)
            share_last_stage_gradients(outside, self._groups.pipeline_group)
            if outside and self._groups.layout.data_parallel_sharding == "full":  # FSDP2 shards the stages only
                average_rows_gradients(outside, self._groups.data_parallel_group)
            self._pending_gradients = hold_gradients(parameters, self._groups.layout.micro_batches,
                                                     self.scaled_later)
        else:
            begin_vocabulary(stage, inputs, targets, self.micro_batches, backward=False)
            with torch.no_grad():
                self._schedule.eval(*args, return_outputs=False, **kwargs)
            end_vocabulary(stage, backward=False)
        # float32 on every stage: the broadcast must agree in size whatever the precision (bf16-true)
        results = [torch.stack([l.detach() for l in losses]).float().mean()] if stage.is_last else [
            torch.zeros((), dtype=torch.float32, device=self._device)]
        if self._router_aux_loss is not None:
            values = self._router_aux_loss.values[-len(losses):]  # a first step's shape inference scores one more
            results.append(torch.stack(values).mean() if stage.is_last else torch.zeros_like(results[0]))
        means = torch.stack(results)
        pp_group, last_rank = self._last_stage_source()
        dist.broadcast(means, src=last_rank, group=pp_group)
        if self._router_aux_loss is not None:
            module._router_aux_loss = means[1]
        return means[0]

    def _outside_parameters(self) -> list[nn.Parameter]:
        """The module's trainable parameters the stages do not hold, which only the last stage's loss uses."""
        if self._outside is None:
            self._outside = [param for _, param in parameters_outside(self._module, self._stages)]
        return self._outside

    @property
    def outside_parameters(self) -> list[nn.Parameter]:
        """The parameters of :meth:`_outside_parameters` (none before the first training step): every pipeline rank
        holds the same copy, which clipping by norm counts once."""
        return self._outside or []

    def _weigh_tokens(self, targets: Any) -> None:
        """Weigh this step's micro-batches by their scored tokens (see ``token_weighted``)."""
        if self._token_weights is not None:
            self._token_weights.begin(targets)
        elif self._token_weighted and self._vocabulary is not None:
            per_replica = float(self._replicas.per_replica(scored_tokens(targets)))
            self._vocabulary.token_weight = self.micro_batches / per_replica if per_replica > 0 else 1.0

    def backward_passes(self, batch: Any) -> int:
        """Micro-batches a training step on ``batch`` runs (what the data-parallel reduction is armed with)."""
        return self._groups.layout.micro_batches

    def _stage_shaped(self, inputs: torch.Tensor, fill: bool) -> torch.Tensor:
        """``inputs``, filled up (where ``fill``: evaluation, whose outputs or loss leave the fillers out) with copies
        of its first sample to the first batch's size when it is smaller: torch's stages receive a smaller batch's
        micro-batches into buffers shaped by the first batch's, and fail."""
        if self._first_shape is None:
            self._first_shape = tuple(inputs.shape)
        first = self._first_shape
        if fill and tuple(inputs.shape[1:]) == first[1:] and inputs.shape[0] < first[0]:
            return _filled(inputs, first[0])
        return inputs

    def restore_gradients(self) -> None:
        """Put back the gradients the last training step's schedule computed."""
        restore_gradients(self._pending_gradients)
        self._pending_gradients = []

    def _last_stage_source(self) -> tuple[dist.ProcessGroup, int]:
        """This replica's pipeline group and the global rank of its last stage, which broadcasts results."""
        pp_group = self._groups.pipeline_group
        return pp_group, dist.get_global_rank(pp_group, self._groups.layout.pipeline_parallel - 1)

    def from_last_stage(self, value: Any) -> Any:
        """``value`` as this replica's last stage holds it, on every rank of the replica's pipeline."""
        pp_group, last_rank = self._last_stage_source()
        holder = [value]
        dist.broadcast_object_list(holder, src=last_rank, group=pp_group)
        return holder[0]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits of a whole batch through every stage (no gradients); the same on every rank.

        This is what ``module(inputs)`` runs once the model is pipelined, so ``predict_step``
        and inference code keep working; training goes through ``compute_loss``.
        """
        if torch.is_grad_enabled() and self._module.training:
            raise RuntimeError(
                "with pipeline_parallel>1 the module's forward runs only without gradients (predict, "
                "inference); training_step must call self.compute_loss(batch)"
            )
        stage, layout = self._stages, self._groups.layout
        samples = inputs.shape[0]
        inputs = self._stage_shaped(inputs, fill=True)  # a smaller last batch: filler samples, cut off below
        layout.check_batch(inputs.shape[0])
        args = (inputs,) if stage.is_first else ()
        # The schedule scores every micro-batch on the last stage; the inputs stand in for the
        # targets and those losses are discarded.
        scoring = {"target": inputs, "losses": []} if stage.is_last else {}
        if self._vocabulary is not None:  # the losses are discarded: nothing to exchange for them
            self._vocabulary.active = False
        if self._embedding is not None:
            self._embedding.begin(inputs, backward=False)
        with torch.no_grad():
            output = self._schedule.eval(*args, **scoring)
        if self._embedding is not None:
            self._embedding.end(backward=False)
        if isinstance(output, tuple):  # (logits, router logits) with a router aux loss
            output = output[0]
        shape, dtype = self.from_last_stage((tuple(output.shape), output.dtype) if stage.is_last else None)
        logits = output if stage.is_last else torch.empty(shape, dtype=dtype, device=self._device)
        pp_group, last_rank = self._last_stage_source()
        dist.broadcast(logits, src=last_rank, group=pp_group)
        if self._vocabulary is not None:  # the last stage's output is the head's input; each rank has its rows
            with torch.no_grad():
                logits = self._vocabulary.full_logits(logits)
        if layout.context_parallel > 1:  # each rank holds the logits of its shard of the sequence
            with torch.no_grad():
                logits = gather_stage_logits(logits, self._groups.context_group)
        return logits[:samples]


def _detachable_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``loss_fn`` giving a tensor of its own where it gives a view (a loss reshaped, or indexed out of another, as a
    replayed ``training_step``'s is): torch's zero-bubble schedule detaches each micro-batch's loss in place after
    its input-gradient pass, which torch refuses for a view ("Failed to run stage backward input")."""

    def loss(outputs: Any, targets: Any, **kwargs: Any) -> torch.Tensor:
        value = loss_fn(outputs, targets, **kwargs)
        return value.clone() if value._is_view() else value

    return loss


def _filled(batch: torch.Tensor, samples: int, fill: Optional[int] = None) -> torch.Tensor:
    """``batch`` with rows added up to ``samples``: copies of its first row, or rows of ``fill``."""
    extra = samples - batch.shape[0]
    if extra <= 0:
        return batch
    rows = batch[:1].expand(extra, *batch.shape[1:]) if fill is None else batch.new_full((extra, *batch.shape[1:]),
                                                                                          fill)
    return torch.cat([batch, rows])


def watch_shape_inference(vocabulary: Any, schedule: Any) -> None:
    """Tell the split head's exchange when ``schedule`` infers its stages' shapes: a first training step does so with
    one extra loss, which the other ranks do not serve."""
    flag = next((name for name in ("_stage_backward_initialized", "_stages_backward_initialized")
                 if hasattr(schedule, name)), None)
    if flag is None:
        raise RuntimeError("vocab_stages needs to know when torch's pipeline schedule infers its shapes "
                           "(_stage(s)_backward_initialized), which this torch lacks; use the tested torch "
                           "2.13 or vocab_stages='off'")
    vocabulary.inferring = lambda: schedule._has_backward and not getattr(schedule, flag)


def begin_vocabulary(stages: RankStages, inputs: Optional[torch.Tensor], targets: Any, micro_batches: int,
                     backward: bool) -> None:
    """Start the split vocabulary layers' step: the embedding's rows come to the first stage (``inputs``: the step's
    token ids there), then the head's serving threads start on ``targets`` (their collectives share one group, so the
    embedding's go first and last)."""
    if stages.embedding is not None:
        stages.embedding.begin(inputs, backward)
    if stages.vocabulary is not None:
        stages.vocabulary.active = True
        stages.vocabulary.begin(targets, micro_batches, backward)


def end_vocabulary(stages: RankStages, backward: bool) -> None:
    """Close the split vocabulary layers' step: their rows' gradients set (averaged over the data-parallel ranks
    where FSDP2 leaves them alone)."""
    if stages.vocabulary is not None:
        stages.vocabulary.end()
    if stages.embedding is not None:
        stages.embedding.end(backward)
    group = stages.rows_data_parallel_group
    if backward and group is not None:
        average_rows_gradients(split_vocabulary_parameters(stages), group)
