"""Tensors a layout may have split over ranks (tensor parallelism's DTensors), seen from one rank."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
