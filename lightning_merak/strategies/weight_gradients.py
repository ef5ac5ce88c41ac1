"""Column layers whose weight gradients wait for their group's input-gradient collective.

In backward a tensor-parallel column group (q/k/v, gate/up) sums its layers' input gradients
and then needs one collective on that sum: an all-reduce, or with sequence parallelism a
reduce-scatter. The layers' weight gradients do not depend on it. Each layer's backward here
computes only its input (and bias) gradient and leaves its output gradient and input in a
:class:`DeferredWeightGradients`; the node that issues the group's collective launches it,
computes the weight gradients from what was left, then waits (Megatron-LM's overlap of the
input-gradient collective with the weight-gradient GEMMs). That node takes the group's
weights as inputs, so their gradients flow through autograd as usual.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["DeferredWeightGradients", "linear_deferring_weight_gradient"]


class DeferredWeightGradients:
    """Weight-gradient work a column group's layers leave to the node issuing the group's collective.

    One per entered (or gathered) group input; ``input_needs_grad`` is False when nothing
    upstream wants the input gradient, so the layers skip it.
    """

    def __init__(self, weights: Sequence[torch.Tensor], input_needs_grad: bool) -> None:
        """``weights`` are the group's layers' weights, in the order of their ``index``."""
        self.input_needs_grad = input_needs_grad
        self._dtypes = tuple(weight.dtype for weight in weights)
        self._work: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in weights]

    def add(self, index: int, output_grad: torch.Tensor, layer_input: torch.Tensor) -> None:
        self._work[index].append((output_grad, layer_input))

    def weight_gradients(self) -> list[Optional[torch.Tensor]]:
        """Each layer's ``output_grad^T @ input`` summed over its calls (None for a layer that left none)."""
        gradients: list[Optional[torch.Tensor]] = []
        for work, dtype in zip(self._work, self._dtypes, strict=True):
            total = None
            for output_grad, layer_input in work:
                grad = output_grad.t().mm(layer_input.reshape(-1, layer_input.shape[-1])).to(dtype)
                total = grad if total is None else total + grad
            gradients.append(total)
        self._work = [[] for _ in self._work]
        return gradients


class _LinearDeferringWeightGradient(torch.autograd.Function):
    """``F.linear`` whose backward computes the input and bias gradients and defers the weight's."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                deferred: DeferredWeightGradients, index: int) -> torch.Tensor:
        device = tensor.device.type
        ctx.input_dtype = tensor.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            tensor, weight = tensor.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device, enabled=False):
            output = F.linear(tensor, weight, bias)
        ctx.save_for_backward(tensor, weight)
        ctx.deferred, ctx.index = deferred, index
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        tensor, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        input_grad = (grad.matmul(weight).to(ctx.input_dtype)
                      if ctx.deferred.input_needs_grad and ctx.needs_input_grad[0] else None)
        bias_grad = flat_grad.sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            ctx.deferred.add(ctx.index, flat_grad, tensor)
        return input_grad, None, bias_grad, None, None


def linear_deferring_weight_gradient(tensor: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                     deferred: DeferredWeightGradients, index: int) -> torch.Tensor:
    """``F.linear(tensor, weight, bias)`` leaving its weight gradient to ``deferred`` (as layer ``index``)."""
    return _LinearDeferringWeightGradient.apply(tensor, weight, bias, deferred, index)
