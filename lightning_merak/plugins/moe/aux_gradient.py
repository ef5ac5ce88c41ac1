"""The load-balancing gradient of swapped blocks, scaled as the training loss is.

A block swapped onto DeepSpeed-MoE (:mod:`.block_replacement`) leaves the model's loss the language-model loss, so
logged losses compare with the model's own, and gives its router the gradient of ``coef × l_aux`` in backward
(:class:`AuxLossGradient`). That gradient must be what ``coef × l_aux`` would get had it been added to the training
loss, so whatever scales that loss on its way to ``backward`` must scale it too: Lightning's division by
``accumulate_grad_batches``, a GradScaler's loss scale, DeepSpeed's engine (its gradient accumulation steps and
loss scale). The gradient arriving at the training loss in backward *is* that scale, whoever applied it, so
:func:`scale_aux_gradients_by_loss` hooks the loss as computed, before anything divides or scales it: the hook keeps
the gradient arriving there, and the end of that backward pass drops it. The swapped blocks lie upstream of the
loss, so their backward runs after the hook, within the same pass. A pass with no hooked loss scales by 1, what a
plain ``loss.backward()`` gives, and what merak3d's pipeline schedule runs each micro-batch's backward with (it
divides the gradients by the micro-batches afterwards, the aux gradient's too).

Hooked: a transformers model's ``output.loss`` (the swap hooks the model's forward), and the loss
``CausalLMModule.training_step`` returns (Lightning divides and scales it afterwards). A LightningModule or a loop of
one's own that computes the loss outside the model calls :func:`scale_aux_gradients_by_loss` on it. One pass, one
scale: a backward through several hooked losses scaled differently (not what a training step does) takes the last
one's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["AuxLossGradient", "scale_aux_gradients_by_loss"]


class _RunningPass:
    """The gradient arriving at the training loss in the backward pass now running (None: no loss hooked)."""

    loss_gradient: Optional[torch.Tensor] = None


_RUNNING = _RunningPass()


def scale_aux_gradients_by_loss(loss: Any) -> None:
    """Scale the load-balancing gradients of the swapped blocks that ``loss``'s backward reaches as ``loss`` is.

    ``loss``: the training loss as computed (a scalar), before anything divides or scales it. A loss without a graph
    (merak3d's pipelined step returns the mean of losses already back-propagated) is left alone.
    """
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or loss.dim() != 0:
        return

    def record(grad: torch.Tensor) -> None:
        _RUNNING.loss_gradient = grad.detach()
        torch.autograd.Variable._execution_engine.queue_callback(_end_of_pass)

    loss.register_hook(record)


def _end_of_pass() -> None:
    _RUNNING.loss_gradient = None


class AuxLossGradient(torch.autograd.Function):
    """Identity on the block's output that also back-propagates ``d(coef·l_aux)/d(coef·l_aux)``: the gradient the
    training loss gets in this backward pass (1 where no loss was hooked)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, weighted_aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = weighted_aux_loss.shape, weighted_aux_loss.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = _RUNNING.loss_gradient
        if scale is None:
            return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)
        return grad, scale.to(device=grad.device, dtype=ctx.aux_dtype).expand(ctx.aux_shape)
