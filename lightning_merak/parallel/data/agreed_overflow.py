"""One verdict on a loss-scaling step's overflow over every rank.

A ``torch.amp.GradScaler`` finds infs and NaNs in the gradients this rank holds, when it unscales them, and skips
the step where it found one. Ranks that hold different gradients (merak_ep's expert shards, EmbRace's table
columns, merak3d's replicas before a late reduction) would then skip different steps and their replicas diverge.
:func:`agree_on_overflow` makes every unscale end with the maximum over the ranks of each optimizer's overflow flag,
so that all ranks skip the step, and back off the scale, together.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["agree_on_overflow", "agree_on_found_inf"]

_AGREED = "_merak_agreed_overflow"
"""Set on a scaler whose ``unscale_`` already agrees (installing twice would reduce twice)."""


def agree_on_overflow(scaler: torch.amp.GradScaler, group: Optional[dist.ProcessGroup] = None) -> None:
    """Make ``scaler.unscale_`` (Lightning's call before ``on_before_optimizer_step``, or ``scaler.step``'s own)
    all-reduce (MAX) the optimizer's overflow flags over ``group`` (every rank of it must step alike)."""
    if getattr(scaler, _AGREED, False):
        return
    if not isinstance(getattr(scaler, "_per_optimizer_states", None), dict):
        raise RuntimeError(
            f"agreeing on overflows reads torch.amp.GradScaler's per-optimizer state, which this torch "
            f"({torch.__version__}) does not keep as '_per_optimizer_states'; use precision='bf16-mixed' or '32-true'"
        )
    unscale = scaler.unscale_

    def unscale_agreed(optimizer: torch.optim.Optimizer) -> None:
        unscale(optimizer)
        agree_on_found_inf(scaler, optimizer, group)

    scaler.unscale_ = unscale_agreed  # type: ignore[method-assign]
    setattr(scaler, _AGREED, True)


def agree_on_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                       group: Optional[dist.ProcessGroup] = None) -> None:
    """After ``scaler.unscale_(optimizer)``: every rank's flags for ``optimizer`` become the maximum over ``group``
    (one collective; a rank that found no gradient to check gets the agreed flag)."""
    if not scaler.is_enabled() or not dist.is_initialized():
        return
    state: dict[str, Any] = scaler._per_optimizer_states[id(optimizer)]
    found = state.get("found_inf_per_device")
    scale = getattr(scaler, "_scale", None)
    if not isinstance(found, dict) or not isinstance(scale, torch.Tensor):
        raise RuntimeError(
            f"agreeing on overflows reads torch.amp.GradScaler's 'found_inf_per_device' and '_scale', which this "
            f"torch ({torch.__version__}) does not keep; use precision='bf16-mixed' or '32-true'"
        )
    agreed = torch.zeros(1, dtype=torch.float32, device=scale.device)
    for flag in found.values():
        agreed = torch.maximum(agreed, flag.to(agreed.device, torch.float32).view(1))
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    if not found:
        found[scale.device] = agreed
    for flag in found.values():
        flag.copy_(agreed.view_as(flag))
