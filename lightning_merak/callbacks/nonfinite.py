"""``NonFiniteGuard``: a step whose loss or gradients are not finite is skipped (and counted) or stops
the run, on every rank alike.

Why every rank alike: under pipeline parallelism only the last stage computes the loss (merak3d
broadcasts it to its replica's ranks), and a non-finite gradient may appear on one rank only (one
stage, one tensor-parallel shard, one data-parallel replica before the average). A rank that skipped
alone would drift from its replicas; one that stopped alone would leave the others waiting in the next
collective. So each rank folds its own verdict (loss of every backward pass since the last step,
gradients of the parameters its optimizer steps) into one flag, and a MAX all-reduce over the world
group makes the decision everyone's (and whether a gradient held a NaN): one 12-byte all-reduce per
optimizer step.

Skipping drops every gradient of the optimizer before its step (``param.grad = None``): torch's
optimizers leave such parameters, their moments and their step counts untouched. The learning-rate
scheduler and ``trainer.global_step`` still advance. Gradient clipping, which runs after this hook, then
sees no gradients: the guard keeps the skipped step and the norm its gradients had (``last_skipped``: NaN
where any gradient held a NaN, else infinity) for the step's metrics (``TrainingMetrics``' ``train/grad_norm``).
Under mixed precision with a gradient scaler, the scaler already skips steps with overflowing gradients
(and lowers its scale); the guard then looks at the loss only.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_merak.distributed.dtensors import local_tensor

__all__ = ["NonFiniteError", "NonFiniteGuard", "SkippedStep"]

log = logging.getLogger(__name__)

Action = Literal["skip", "stop"]


class NonFiniteError(RuntimeError):
    """Raised on every rank when ``NonFiniteGuard(action="stop")`` meets a non-finite step."""


@dataclass(frozen=True)
class SkippedStep:
    """An optimizer step :class:`NonFiniteGuard` skipped."""

    global_step: int
    """``trainer.global_step`` once the step is taken (Lightning counts a skipped step too)."""
    gradient_norm: Optional[float]
    """The total norm its gradients had, over every rank: NaN where any gradient held a NaN, else infinity;
    ``None`` where only the loss was not finite (or a gradient scaler checks the gradients)."""


class NonFiniteGuard(pl.Callback):
    """Skip or stop at optimizer steps whose loss or gradients hold NaN or infinity.

    Args:
        action: ``"skip"``: drop the step's gradients on every rank and count it (``skipped``, logged
            as ``nonfinite/skipped``); ``"stop"``: raise :class:`NonFiniteError` on every rank, naming
            the step and what was not finite.
        max_skipped: with ``"skip"``, stop (as ``"stop"`` does) once this many steps were skipped in a
            row; ``None`` never stops. A run whose every step diverges is not worth continuing.
    """

    def __init__(self, action: Action = "skip", max_skipped: int | None = 10) -> None:
        if action not in ("skip", "stop"):
            raise ValueError(f"action must be 'skip' or 'stop', got {action!r}")
        if max_skipped is not None and (not isinstance(max_skipped, int) or isinstance(max_skipped, bool)
                                        or max_skipped < 1):
            raise ValueError(f"max_skipped={max_skipped!r} must be an integer >= 1, or None to never stop")
        self.action = action
        self.max_skipped = max_skipped
        self.skipped = 0
        self.skipped_in_a_row = 0
        self._loss_finite = True
        self.last_skipped: Optional[SkippedStep] = None
        """The last step skipped, and the non-finite norm of its gradients."""

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._loss_finite = self._loss_finite and bool(torch.isfinite(loss.detach()).all())

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        bad_gradients = [] if scaler is not None else _non_finite(parameters, pl_module)
        verdict = torch.tensor([not self._loss_finite, bool(bad_gradients), _any_nan(bad_gradients)],
                               dtype=torch.int32, device=_device(parameters, pl_module))
        self._loss_finite = True
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        loss_bad, gradients_bad, gradients_nan = verdict.tolist()
        if not (loss_bad or gradients_bad):
            self.skipped_in_a_row = 0
            return
        what = " and ".join(name for bad, name in ((loss_bad, "loss"), (gradients_bad, "gradients")) if bad)
        step = trainer.global_step
        names = ", ".join(name for name, _ in bad_gradients[:3])
        mine = f"; this rank's non-finite gradients: {names}" if bad_gradients else ""
        self.skipped += 1
        self.skipped_in_a_row += 1
        if self.action == "stop" or (self.max_skipped is not None and self.skipped_in_a_row >= self.max_skipped):
            reason = "" if self.action == "stop" else f" ({self.skipped_in_a_row} steps in a row were skipped)"
            raise NonFiniteError(
                f"step {step}: non-finite {what} on some rank{reason}{mine}. Lower the learning rate, clip "
                "gradients (trainer.gradient_clip_val) or check the data; faults.nonfinite=skip skips such steps"
            )
        norm = (math.nan if gradients_nan else math.inf) if gradients_bad else None
        self.last_skipped = SkippedStep(trainer.global_step + 1, norm)
        for parameter in parameters:
            parameter.grad = None
        log.warning("NonFiniteGuard: step %d skipped on every rank: non-finite %s%s", step, what, mine)
        pl_module.log("nonfinite/skipped", float(self.skipped), on_step=True, rank_zero_only=True)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))


def _non_finite(parameters: list[torch.nn.Parameter], pl_module: pl.LightningModule) -> list[tuple[str, bool]]:
    """Names (or shapes, for parameters the module does not name: optimizer shards) of non-finite gradients, each
    with whether it holds a NaN."""
    if not parameters:
        return []
    finite = torch.stack([torch.isfinite(local_tensor(p.grad)).all() for p in parameters])
    bad = [parameters[i] for i in (~finite).nonzero().flatten().tolist()]
    if not bad:
        return []
    names = {id(p): name for name, p in pl_module.named_parameters()}
    return [(names.get(id(p), f"a parameter of shape {tuple(p.shape)}"),
             bool(torch.isnan(local_tensor(p.grad)).any())) for p in bad]


def _any_nan(bad_gradients: list[tuple[str, bool]]) -> bool:
    return any(has_nan for _, has_nan in bad_gradients)


def _device(parameters: list[torch.nn.Parameter], pl_module: pl.LightningModule) -> torch.device:
    return parameters[0].device if parameters else pl_module.device
