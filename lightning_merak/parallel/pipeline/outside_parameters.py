"""Trainable parameters a pipelined module's loss uses outside the pipelined network.

A learned temperature on the LightningModule, or an LM head it holds while its network returns hidden states, is used
by the loss only, which the last pipeline stage alone computes: only its copy gets their gradients from the schedule.
Every pipeline rank holds a copy and its optimizer steps it, so after the schedule the gradients are summed over the
pipeline group (:func:`share_last_stage_gradients`; the other stages add nothing) and every copy takes the same step.
The data-parallel reduction then averages them like any other replicated parameter's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["parameters_outside", "share_last_stage_gradients"]


def parameters_outside(module: nn.Module, network: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module``'s trainable parameters that ``network`` (the pipeline stages it holds) does not, with their names."""
    inside = {id(param) for param in network.parameters()}
    return [(name, param) for name, param in module.named_parameters()
            if param.requires_grad and id(param) not in inside]


def share_last_stage_gradients(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Give every rank of the pipeline ``group`` the gradients the loss left on ``params`` (summed over the ranks,
    in one collective, exact: only the last stage holds any); a parameter no rank has a gradient for keeps none."""
    if not params:
        return
    device = params[0].device
    present = torch.tensor([float(param.grad is not None) for param in params], dtype=torch.float64, device=device)
    values = [param.grad.detach().reshape(-1).to(torch.float64) if param.grad is not None
              else torch.zeros(param.numel(), dtype=torch.float64, device=device) for param in params]
    flat = torch.cat([present, *values])
    dist.all_reduce(flat, group=group)
    sums = flat[len(params):].split([param.numel() for param in params])
    for param, has_gradient, total in zip(params, flat[:len(params)].tolist(), sums):
        if not has_gradient:
            continue
        total = total.view_as(param).to(param.dtype)
        if param.grad is None:
            param.grad = total
        else:
            param.grad.copy_(total)
