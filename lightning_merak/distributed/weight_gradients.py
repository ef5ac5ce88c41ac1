"""Weight gradients computed after the input gradient, while the input gradient's collective is in flight.

A linear layer's weight gradient ``dYᵀ·X`` (and bias gradient ``Σ dY``) is not needed to send
its input gradient on: a tensor-parallel column group needs one collective on the sum of its
layers' input gradients (Megatron-LM's overlap of that collective with the weight-gradient
GEMMs), an expert needs the all-to-all that returns its tokens' input gradient (Lancet §1.5).
:class:`DeferredWeightGradients` keeps each layer's ``(dY, X)`` in backward and forms the
gradients when the caller has launched its collective.

Two ways fill it, for two kinds of caller:

- :func:`linear_deferring_weight_gradient` is ``F.linear`` whose backward computes the input and
  bias gradients and leaves the weight's; for layers a strategy has replaced with its own (the
  tensor-parallel column layers). The node issuing the collective takes the weights as inputs,
  so their gradients flow through autograd as usual.
- :class:`SplitBackward` records the plain ``nn.Linear`` calls of unmodified modules (experts)
  through hooks, runs an input-gradient-only pass, and then returns every parameter's gradient:
  the Linears' from what was kept, the rest from autograd on the retained graph.

On CUDA the overlap needs no stream of its own: the caller's collective (NCCL) runs on NCCL's internal
stream, which waited for the compute stream when it was launched, while the weight GEMMs queued after the
launch run on the compute stream; the caller's ``wait()`` then makes the compute stream wait for NCCL's.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DeferredWeightGradients", "SplitBackward", "linear_deferring_weight_gradient"]


class DeferredWeightGradients:
    """The ``(dY, X)`` pairs that linear layers leave in backward, and the gradients formed from them.

    ``input_needs_grad`` is False when nothing upstream wants the layers' input gradient
    (read by :func:`linear_deferring_weight_gradient`, which then skips it).
    """

    def __init__(self, weights: Sequence[torch.Tensor], input_needs_grad: bool = True,
                 biases: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
        """``weights`` are the layers' weights, in the order of their ``index``; ``biases`` (None for a
        layer without one) are given where the bias gradients are deferred as well."""
        self.input_needs_grad = input_needs_grad
        self._dtypes = tuple(weight.dtype for weight in weights)
        self._bias_dtypes = tuple(None if bias is None else bias.dtype
                                  for bias in (biases if biases is not None else [None] * len(weights)))
        self._work: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in weights]

    def add(self, index: int, output_grad: torch.Tensor, layer_input: torch.Tensor) -> None:
        """Layer ``index``'s output gradient and input for one of its calls."""
        self._work[index].append((output_grad, layer_input))

    def gradients(self) -> list[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """Each layer's ``(dYᵀ·X, Σ dY)`` summed over its calls, in its parameters' dtypes.

        None for a layer that left nothing, and for the bias of a layer whose bias is not deferred.
        The input is taken in the output gradient's dtype (under autocast the layer computed in it).
        """
        gradients: list[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = []
        for work, dtype, bias_dtype in zip(self._work, self._dtypes, self._bias_dtypes, strict=True):
            weight_total = bias_total = None
            for output_grad, layer_input in work:
                flat_grad = output_grad.reshape(-1, output_grad.shape[-1])
                flat_input = layer_input.reshape(-1, layer_input.shape[-1]).to(flat_grad.dtype)
                grad = flat_grad.t().mm(flat_input).to(dtype)
                weight_total = grad if weight_total is None else weight_total + grad
                if bias_dtype is not None:
                    bias = flat_grad.sum(0).to(bias_dtype)
                    bias_total = bias if bias_total is None else bias_total + bias
            gradients.append((weight_total, bias_total))
        self._work = [[] for _ in self._work]
        return gradients

    def weight_gradients(self) -> list[Optional[torch.Tensor]]:
        """Each layer's ``dYᵀ·X`` summed over its calls (None for a layer that left none)."""
        return [weight for weight, _ in self.gradients()]


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


class _LinearCall:
    """One call of a recorded Linear: its position, detached input, and the output gradient once known."""

    __slots__ = ("index", "inputs", "grad_output")

    def __init__(self, index: int, inputs: torch.Tensor) -> None:
        self.index, self.inputs = index, inputs
        self.grad_output: Optional[torch.Tensor] = None

    def keep_grad(self, grad: torch.Tensor) -> None:
        self.grad_output = grad if self.grad_output is None else self.grad_output + grad


class SplitBackward:
    """The backward of unmodified ``modules`` as an input-gradient pass, then every parameter's gradient.

    While :meth:`recording`, every plain ``nn.Linear`` call keeps its input and, through a tensor
    hook, the gradient of its output once :meth:`input_grad` has run; that pass asks autograd for
    the input gradient alone, so no weight GEMM runs on the critical path. :meth:`compute` then
    forms the Linears' weight and bias gradients (:class:`DeferredWeightGradients`); parameters
    that do not belong to a plain ``nn.Linear`` get theirs from autograd on the retained graph.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.linears = [m for module in modules for m in module.modules() if type(m) is nn.Linear]
        linear_params = {id(p) for m in self.linears for p in m.parameters(recurse=False)}
        self.other_params = [p for module in modules for p in module.parameters()
                             if p.requires_grad and id(p) not in linear_params]
        self.calls: list[_LinearCall] = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Within this block, forward calls of the Linears are recorded."""
        handles = [m.register_forward_hook(self._recorder(index)) for index, m in enumerate(self.linears)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _recorder(self, index: int) -> Any:
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if not output.requires_grad:
                return
            call = _LinearCall(index, inputs[0].detach())
            output.register_hook(call.keep_grad)
            self.calls.append(call)

        return record

    def input_grad(self, outputs: torch.Tensor, inputs: torch.Tensor, grad_outputs: torch.Tensor) -> torch.Tensor:
        """dX only; the graph is kept when parameters outside plain Linears still need it."""
        (grad,) = torch.autograd.grad(outputs, [inputs], grad_outputs, retain_graph=bool(self.other_params))
        return grad

    def compute(
        self, outputs: torch.Tensor, grad_outputs: torch.Tensor, params: Sequence[nn.Parameter]
    ) -> list[Optional[torch.Tensor]]:
        """The gradient of each of ``params`` (None where it received none); run after :meth:`input_grad`."""
        slots = {id(p): i for i, p in enumerate(params)}
        grads: list[Optional[torch.Tensor]] = [None] * len(params)

        def add(param: Optional[nn.Parameter], value: Optional[torch.Tensor]) -> None:
            if param is None or value is None or not param.requires_grad or id(param) not in slots:
                return
            slot = slots[id(param)]
            grads[slot] = value if grads[slot] is None else grads[slot] + value

        deferred = DeferredWeightGradients([m.weight for m in self.linears],
                                           biases=[m.bias for m in self.linears])
        for call in self.calls:
            if call.grad_output is not None:
                deferred.add(call.index, call.grad_output, call.inputs)
        self.calls = []
        for linear, (weight, bias) in zip(self.linears, deferred.gradients(), strict=True):
            add(linear.weight, weight)
            add(linear.bias, bias)
        if self.other_params:
            others = torch.autograd.grad(outputs, self.other_params, grad_outputs, allow_unused=True)
            for param, grad in zip(self.other_params, others):
                add(param, grad)
        return grads
