"""The arithmetic of clipping by the total gradient norm, and the gradients whose norm is spread over ranks.

A strategy's clipping owner (merak3d's :mod:`~lightning_merak.parallel.data.gradients`)
decides which gradients count; the pieces here do the sums. :class:`ShardedGradients` records
parameters of which each rank of a group holds a different part (EmbRace's column shards of an
embedding table): their squares are summed over that group, where a replicated gradient's
squares count once. Under Lightning's DDP, which has no clipping owner, :func:`clip_over_groups` makes the
precision plugin's clipping by norm such a sum (every registration into one :class:`ShardedGradients`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import nn

__all__ = ["CLIP_EPSILON", "ShardedGradients", "clip_coefficient", "clip_over_groups", "installed_sharded_gradients",
           "scale_gradients", "squared_norm"]

CLIP_EPSILON = 1e-6
"""Added to the norm before dividing, as torch's ``clip_grad_norm_`` does."""


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squares of ``grads``, accumulated in float64 so every layout sums to the same norm.

    ``vector_norm`` with a float64 ``dtype`` converts inside the reduction; squaring a float64
    copy of each gradient (``grad.double().pow(2).sum()``) gives the same figure several times
    slower, since it writes two gradient-sized temporaries per tensor.
    """
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        squares += torch.linalg.vector_norm(grad, dtype=torch.float64).square()
    return squares


def scale_gradients(grads: list[torch.Tensor], coefficient: float) -> None:
    """Multiply ``grads`` in place by ``coefficient`` (clipping's second pass)."""
    for grad in grads:
        grad.mul_(coefficient)


def clip_coefficient(clip_val: float, norm: float) -> float:
    """The factor clipping multiplies every gradient by (at most 1)."""
    return min(1.0, float(clip_val) / (norm + CLIP_EPSILON))


class ShardedGradients:
    """Parameters whose gradient is split over the ranks of a group, each group's in registration order.

    Every rank of a group must register the group's parameters, in the same order across groups:
    :meth:`squares` runs one all-reduce per group on every rank, whatever gradients it holds.
    Parameters are kept by identity, so register the ones the optimizer steps.
    """

    def __init__(self) -> None:
        self._groups: list[tuple[Any, set[int]]] = []

    def register(self, params: Iterable[nn.Parameter], group: Any) -> None:
        """Count ``params``' gradients as parts of one whole spread over ``group`` (``None``: the world)."""
        ids = {id(param) for param in params}
        for index, (existing_group, registered) in enumerate(self._groups):
            if existing_group is group:
                self._groups[index] = (group, registered | ids)
                return
        self._groups.append((group, ids))

    def remove(self, params: Iterable[nn.Parameter]) -> None:
        """Stop counting ``params`` as parts of a split whole (they are no longer stepped)."""
        ids = {id(param) for param in params}
        self._groups = [(group, registered - ids) for group, registered in self._groups if registered - ids]

    def __bool__(self) -> bool:
        return bool(self._groups)

    def group_index(self, param: nn.Parameter) -> int | None:
        """The index of the group ``param``'s gradient is split over, or ``None`` for any other parameter."""
        for index, (_, ids) in enumerate(self._groups):
            if id(param) in ids:
                return index
        return None

    def squares(self, grads: dict[int, list[torch.Tensor]], device: torch.device) -> torch.Tensor:
        """The squares of ``grads`` (by :meth:`group_index`), each group's summed over its ranks (collective)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for index, (group, _) in enumerate(self._groups):
            part = squared_norm(grads.get(index, []), device)
            dist.all_reduce(part, group=group)
            total += part
        return total

    def clip(self, optimizer: torch.optim.Optimizer, clip_val: float) -> float:
        """Clip ``optimizer``'s gradients by the norm over every rank's shards and the replicated rest; the norm.

        For a strategy with no clipping owner of its own (Lightning's DDP), where every other
        gradient is the same on all ranks after the all-reduce.
        """
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        device = params[0].grad.device if params else torch.device("cpu")
        replicated: list[torch.Tensor] = []
        sharded: dict[int, list[torch.Tensor]] = {}
        for param in params:
            index = self.group_index(param)
            (replicated if index is None else sharded.setdefault(index, [])).append(param.grad.detach())
        norm = math.sqrt((squared_norm(replicated, device) + self.squares(sharded, device)).item())
        coefficient = clip_coefficient(clip_val, norm)
        if coefficient < 1.0:
            scale_gradients([p.grad for p in params], coefficient)
        return norm


def installed_sharded_gradients(precision: Precision) -> Optional[ShardedGradients]:
    """The :class:`ShardedGradients` whose ``clip`` is ``precision``'s clipping by norm, or ``None`` (Lightning's
    own): what a callback registers more split parameters with, and what a logged norm must count alike."""
    owner = getattr(precision.clip_grad_by_norm, "__self__", None)
    return owner if isinstance(owner, ShardedGradients) else None


def clip_over_groups(trainer: pl.Trainer, params: Iterable[nn.Parameter], group: Any) -> None:
    """Have ``trainer``'s clipping by norm (Lightning's DDP: the precision plugin's, over this rank's gradients) sum
    the squares of ``params``, of which each rank of ``group`` (``None``: the world) holds other ones (expert
    parallelism's experts, EmbRace's column shards), over ``group``, adding them to the parameters registered there
    already: replicated gradients count once, so every rank clips by one factor. Every rank of ``group`` must call
    it, in the same order of groups."""
    precision = trainer.strategy.precision_plugin
    sharded = installed_sharded_gradients(precision)
    if sharded is None:
        if getattr(precision.clip_grad_by_norm, "__func__", None) is not Precision.clip_grad_by_norm:
            raise ValueError(
                f"parameters split over ranks (experts, EmbRace's tables) under {type(trainer.strategy).__name__} "
                "clip by the norm over every rank's part, but the precision plugin "
                f"{type(precision).__name__} has a clip_grad_by_norm of its own; use Lightning's precision plugins, "
                "or strategy=merak3d")
        sharded = ShardedGradients()
        precision.clip_grad_by_norm = sharded.clip
    sharded.register(params, group)
