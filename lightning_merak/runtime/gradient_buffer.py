"""Gradients kept as views of one flat tensor per dtype, for collectives that run on it in place.

Averaging gradients over data-parallel replicas with one collective needs them contiguous.
Concatenating them after the backward costs a second copy of every gradient at the step's peak
(and a copy back); holding them in a flat buffer from the start costs nothing extra: each
gradient autograd creates is moved into its slice the moment it is accumulated (a
post-accumulate hook), later accumulations add into the slice in place, and the collective runs
on the buffer itself. Parameters are laid out in reverse order, the order a backward usually
finishes them in, so that a contiguous tail of the buffer is complete first.

Pure runtime: no process groups; the caller runs the collective on :attr:`GradientBuffer.flats`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["GradientBuffer"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class GradientBuffer:
    """The gradients of ``params`` (trainable, each once) as views of one flat tensor per dtype.

    A gradient assigned directly (``param.grad = ...``, as zero-bubble schedules do for weight
    gradients) is moved into its slice by :meth:`gather`, which a collective's caller runs first.
    A parameter whose gradient is ``None`` keeps ``None``; its slice is zeroed so that a
    collective over the buffer adds nothing for it.
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        seen: set[int] = set()
        trainable = []
        for param in params:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                trainable.append(param)
        sizes: dict[torch.dtype, int] = {}
        for param in reversed(trainable):
            local = _local(param)
            sizes[local.dtype] = sizes.get(local.dtype, 0) + local.numel()
        self.flats: list[torch.Tensor] = []
        flat_of = {}
        for dtype, size in sizes.items():
            device = _local(trainable[0]).device
            flat_of[dtype] = torch.zeros(size, dtype=dtype, device=device)
            self.flats.append(flat_of[dtype])
        offsets = dict.fromkeys(sizes, 0)
        self._views: list[tuple[nn.Parameter, torch.Tensor]] = []
        for param in reversed(trainable):
            local = _local(param)
            start = offsets[local.dtype]
            offsets[local.dtype] = start + local.numel()
            self._views.append((param, flat_of[local.dtype][start:start + local.numel()].view(local.shape)))
        self._hooks = [param.register_post_accumulate_grad_hook(self._adopt_hook(view)) for param, view in self._views]

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters whose gradients the buffer holds, in buffer order."""
        return [param for param, _ in self._views]

    def _adopt_hook(self, view: torch.Tensor) -> Any:
        def adopt(param: nn.Parameter) -> None:
            _adopt(param, view)
        return adopt

    def gather(self) -> None:
        """Move every gradient not yet in the buffer into its slice; zero the slices of absent gradients."""
        for param, view in self._views:
            if param.grad is None:
                view.zero_()
            else:
                _adopt(param, view)

    def remove(self) -> None:
        """Stop adopting new gradients (the buffer's memory goes with the last gradient that views it)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _adopt(param: nn.Parameter, view: torch.Tensor) -> None:
    """Point ``param.grad`` at ``view``, copying the gradient there unless it already lives there."""
    grad = param.grad
    local = _local(grad)
    if local.data_ptr() == view.data_ptr() and local.shape == view.shape:
        return
    view.copy_(local)
    if isinstance(grad, DTensor):
        param.grad = DTensor.from_local(view, grad.device_mesh, grad.placements, run_check=False,
                                        shape=grad.shape, stride=grad.stride())
    else:
        param.grad = view
