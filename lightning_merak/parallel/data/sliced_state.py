"""Optimizer state cut to the slice of a parameter a data-parallel rank steps under ZeRO-1/2, and told apart from
state that is not per element (step counters)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_merak.distributed.dtensors import local_tensor

__all__ = ["elementwise", "sliced_state"]


def elementwise(value: Any, shard: nn.Parameter) -> bool:
    """Whether ``value`` holds one entry per element of ``shard``."""
    return isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape == shard.shape


def sliced_state(state: dict[str, Any], shard: nn.Parameter) -> dict[str, Any]:
    """A parameter's whole optimizer state, cut to the elements ``shard`` covers."""
    start = shard.shard_start  # type: ignore[attr-defined]
    param = shard.sharded_from  # type: ignore[attr-defined]
    sliced = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == param.shape and value.ndim > 0:
            sliced[key] = local_tensor(value).reshape(-1)[start:start + shard.numel()].clone()
        else:
            sliced[key] = value
    return sliced
