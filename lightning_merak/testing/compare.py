"""Compare a distributed run with a single-process reference, step by step.

A :class:`TrainingTrace` holds what a run produced at each optimizer step: the loss and
the full (unsharded) gradient of every parameter. :func:`record_reference_trace` makes
one on a single process; a distributed test assembles its own (gathering shards as its
layout requires) and checks it with :func:`assert_traces_match`, whose failure message
names the step, the parameter and the size of the disagreement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_merak.parallel.pipeline.stage import RankStages

__all__ = ["LayoutTraceRecorder", "NormBeforeClipping", "StepLosses", "TraceRecorder", "TrainingTrace",
           "assert_traces_match", "layout_gradients", "merge_rank_traces", "module_losses", "record_reference_trace",
           "snapshot_gradients"]


@dataclass
class TrainingTrace:
    """Per-step losses and full gradients of one run (gradients before the optimizer step)."""

    losses: list[float] = field(default_factory=list)
    gradients: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def append(self, loss: float, gradients: dict[str, torch.Tensor]) -> None:
        self.losses.append(float(loss))
        self.gradients.append(gradients)


def layout_gradients(strategy: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of this rank's gradients under the unsplit model's names, tensor-parallel shards gathered whole and
    put back in the unsplit layout (``strategy.to_original_layout``): comparable with a single-process run's."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        original = model.original_name(name) if isinstance(model, RankStages) else name
        grad = param.grad
        if isinstance(grad, DTensor):
            grad = strategy.to_original_layout(original, grad.full_tensor())
        grads[original] = grad.detach().clone()
    return grads


def merge_rank_traces(results: list[tuple[list[float], list[dict[str, torch.Tensor]]]]) -> TrainingTrace:
    """One trace from every rank's ``(losses, gradients)``: the losses every rank agrees on (to 1e-6, or this
    raises), each step's gradients merged over the ranks (each holds the parameters of its stage or shard)."""
    losses = results[0][0]
    for other, _ in results[1:]:
        if len(other) != len(losses) or any(abs(a - b) > 1e-6 * max(abs(b), 1e-12) for a, b in zip(other, losses)):
            raise AssertionError(f"ranks logged different losses: {other} vs {losses}")
    gradients: list[dict[str, torch.Tensor]] = [{} for _ in losses]
    for _, rank_gradients in results:
        for step, grads in enumerate(rank_gradients):
            gradients[step].update(grads)
    return TrainingTrace(losses=losses, gradients=gradients)


def snapshot_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of every parameter's gradient, keyed by parameter name."""
    return {
        name: param.grad.detach().to("cpu", copy=True)
        for name, param in model.named_parameters()
        if param.grad is not None
    }


class TraceRecorder(pl.Callback):
    """The loss and this rank's gradients at every optimizer step of a Lightning fit, as a :class:`TrainingTrace`.

    ``loss_metric`` records a logged metric instead of the loss the training step returned:
    under merak3d's pipeline only the last stage computes the loss, while a value logged
    with ``sync_dist`` is the same on every rank.
    """

    def __init__(self, loss_metric: Optional[str] = None) -> None:
        self.trace = TrainingTrace()
        self.loss_metric = loss_metric
        self._gradients: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._gradients = snapshot_gradients(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = trainer.callback_metrics[self.loss_metric] if self.loss_metric else outputs["loss"]
        self.trace.append(float(loss), self._gradients)


class StepLosses(pl.Callback):
    """The loss ``training_step`` returned for each training batch, in order (``losses``)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


class NormBeforeClipping(pl.Callback):
    """The reference for a logged gradient norm: torch's total norm of the gradients each step, taken before
    Lightning clips them (one process, every parameter whole)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(grads, max_norm=math.inf)))


class LayoutTraceRecorder(pl.Callback):
    """Per training step under merak3d: the logged ``train/loss`` (the same on every rank) and this rank's gradients
    under the unsplit model's names (:func:`layout_gradients`), as the optimizer used them; ``losses`` and
    ``gradients`` are one rank's part of :func:`merge_rank_traces`."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.gradients: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.gradients.append(layout_gradients(trainer.strategy, pl_module.model))


def record_reference_trace(
    model: nn.Module,
    batches: Iterable[object],
    loss_fn: Callable[[nn.Module, object], torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> TrainingTrace:
    """Train ``model`` on ``batches`` in one process and record loss and gradients per step."""
    trace = TrainingTrace()
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        trace.append(loss.item(), snapshot_gradients(model))
        optimizer.step()
    return trace


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference over the largest reference entry; infinite where the two hold NaN in other places
    (a NaN compares false with any tolerance, so it must not reach the comparison)."""
    nan = expected.isnan()
    if not torch.equal(actual.isnan(), nan):
        return math.inf
    actual, expected = actual[~nan], expected[~nan]
    if expected.numel() == 0:
        return 0.0
    scale = expected.abs().max().item()
    diff = (actual.double() - expected.double()).abs().max().item()
    return diff / scale if scale > 0 else diff


def assert_traces_match(
    reference: TrainingTrace,
    candidate: TrainingTrace,
    loss_rtol: float = 1e-5,
    grad_rtol: float = 1e-5,
    check_gradients: bool = True,
) -> None:
    """Raise ``AssertionError`` unless ``candidate`` reproduces ``reference``.

    Losses must agree to ``loss_rtol`` relative error at every step; each gradient to
    ``grad_rtol`` relative to the largest entry of the reference gradient (so entries
    that are zero in the reference do not turn rounding noise into infinite error).
    """
    if len(reference.losses) != len(candidate.losses):
        raise AssertionError(
            f"step counts differ: reference {len(reference.losses)}, candidate {len(candidate.losses)}"
        )
    for step, (ref_loss, cand_loss) in enumerate(zip(reference.losses, candidate.losses)):
        if math.isnan(ref_loss) and math.isnan(cand_loss):
            continue
        rel = abs(cand_loss - ref_loss) / max(abs(ref_loss), 1e-12)
        if not rel <= loss_rtol:  # a NaN on one side fails too
            raise AssertionError(
                f"step {step}: loss {cand_loss:.8g} vs reference {ref_loss:.8g} "
                f"(relative error {rel:.2e} > {loss_rtol:.0e})"
            )
    if not check_gradients:
        return
    for step, (ref_grads, cand_grads) in enumerate(zip(reference.gradients, candidate.gradients)):
        missing = sorted(set(ref_grads) ^ set(cand_grads))
        if missing:
            raise AssertionError(f"step {step}: gradients present in only one run: {missing[:8]}")
        for name, expected in ref_grads.items():
            actual = cand_grads[name]
            if actual.shape != expected.shape:
                raise AssertionError(
                    f"step {step}: gradient of {name} has shape {tuple(actual.shape)}, "
                    f"reference {tuple(expected.shape)}"
                )
            rel = _relative_error(actual, expected)
            if not rel <= grad_rtol:
                raise AssertionError(
                    f"step {step}: gradient of {name} differs (relative error {rel:.2e} > {grad_rtol:.0e})"
                )


def module_losses(module: Any, batches: Iterable[Any]) -> list[float]:
    """Losses of ``module`` (a ``CausalLMModule``-like LightningModule: ``compute_loss``, and ``configure_optimizers``
    returning an optimizer or ``{"optimizer": ..., "lr_scheduler": {"scheduler": ...}}``) trained on ``batches`` in
    this process, as Lightning's automatic optimisation steps it: the reference for the mean loss of a data-parallel
    run whose ranks' batches, concatenated, are ``batches``."""
    setup = module.configure_optimizers()
    if isinstance(setup, torch.optim.Optimizer):
        optimizer, scheduler = setup, None
    else:
        optimizer, scheduler = setup["optimizer"], setup.get("lr_scheduler", {}).get("scheduler")
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = module.compute_loss(batch)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses
