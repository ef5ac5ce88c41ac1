"""Split an expert's backward into an input-gradient pass and deferred weight gradients (Lancet §1.5).

The all-to-all that returns the input gradient to the other ranks needs only dX. While
recording, every ``nn.Linear`` inside the modules keeps its input and, through a tensor
hook, the gradient of its output once the dX pass has run; the dX pass itself asks
autograd for the input gradient alone, so no weight GEMM runs on the critical path.
:meth:`DeferredWeightGrads.compute` then forms each weight gradient as ``dYᵀ·X`` (and
each bias gradient as ``Σ dY``) while the all-to-all is in flight. Parameters that do not
belong to a plain ``nn.Linear`` get theirs from autograd on the retained graph.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

__all__ = ["DeferredWeightGrads"]


class _LinearCall:
    """One call of a Linear: its module, detached input, and the output gradient once known."""

    __slots__ = ("module", "inputs", "grad_output")

    def __init__(self, module: nn.Linear, inputs: torch.Tensor) -> None:
        self.module, self.inputs = module, inputs
        self.grad_output: torch.Tensor | None = None

    def keep_grad(self, grad: torch.Tensor) -> None:
        self.grad_output = grad if self.grad_output is None else self.grad_output + grad


class DeferredWeightGrads:
    """Records the Linear calls of ``modules`` in a forward; computes their weight gradients later."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.linears = [m for module in modules for m in module.modules() if type(m) is nn.Linear]
        linear_params = {id(p) for m in self.linears for p in m.parameters(recurse=False)}
        self.other_params = [p for module in modules for p in module.parameters()
                             if p.requires_grad and id(p) not in linear_params]
        self.calls: list[_LinearCall] = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Within this block, forward calls of the Linears are recorded."""
        handles = [m.register_forward_hook(self._record) for m in self.linears]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _record(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if not output.requires_grad:
            return
        call = _LinearCall(module, inputs[0].detach())
        output.register_hook(call.keep_grad)
        self.calls.append(call)

    def input_grad(self, outputs: torch.Tensor, inputs: torch.Tensor, grad_outputs: torch.Tensor) -> torch.Tensor:
        """dX only; the graph is kept when parameters outside plain Linears still need it."""
        (grad,) = torch.autograd.grad(outputs, [inputs], grad_outputs, retain_graph=bool(self.other_params))
        return grad

    def compute(
        self, outputs: torch.Tensor, grad_outputs: torch.Tensor, params: Sequence[nn.Parameter]
    ) -> list[torch.Tensor | None]:
        """The gradient of each of ``params`` (None where it received none); run after :meth:`input_grad`."""
        index = {id(p): i for i, p in enumerate(params)}
        grads: list[torch.Tensor | None] = [None] * len(params)

        def add(param: nn.Parameter | None, value: torch.Tensor) -> None:
            if param is None or not param.requires_grad or id(param) not in index:
                return
            slot = index[id(param)]
            grads[slot] = value if grads[slot] is None else grads[slot] + value

        for call in self.calls:
            if call.grad_output is None:
                continue
            dy = call.grad_output.reshape(-1, call.grad_output.size(-1))
            x = call.inputs.reshape(-1, call.inputs.size(-1))
            add(call.module.weight, dy.t().mm(x))
            add(call.module.bias, dy.sum(0))
        self.calls = []
        if self.other_params:
            others = torch.autograd.grad(outputs, self.other_params, grad_outputs, allow_unused=True)
            for param, grad in zip(self.other_params, others):
                if grad is not None:
                    add(param, grad)
        return grads
