"""What data-parallel sharding cannot work with, refused before the first batch with the fix.

Kept apart from the reduction itself (:mod:`.buckets`, which re-exports these): plain checks of an
optimizer, a precision plugin and the callbacks against a layout's ``data_parallel_sharding``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_merak.protocols.callbacks import full_sharding_refusal

__all__ = ["ELEMENTWISE_OPTIMIZERS", "SHARDED_MODES", "check_fully_sharded_callbacks", "check_loss_scaling",
           "check_precision", "check_shardable_optimizer", "check_sharding", "refuse_loss_scaling"]

SHARDED_MODES = ("optimizer", "gradients")
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                          torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
                          torch.optim.Adadelta)
"""Optimizers whose update of an element reads only that element's gradient and state, so stepping a slice of a
flattened parameter is stepping the parameter."""


def check_shardable_optimizer(optimizer: torch.optim.Optimizer, mode: str) -> None:
    """Refuse an optimizer whose update of a slice of a parameter differs from its update of the parameter."""
    inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer
    if callable(getattr(inner, "assemble_pieces", None)):
        return  # it puts whole matrices together from the slices (MuonWithAdamW)
    if not isinstance(inner, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(
            f"data_parallel_sharding={mode!r} steps a slice of each parameter, which {type(inner).__name__} "
            f"does not update element by element; use one of {names}, or data_parallel_sharding='none' or 'full'"
        )


def check_sharding(layout: Any, optimizers: Sequence[torch.optim.Optimizer], precision: Any,
                   callbacks: Sequence[Any] = ()) -> None:
    """Refuse, before the first batch, an optimizer, precision or callback ``layout``'s sharding mode cannot work
    with."""
    check_loss_scaling(layout, precision)
    mode = layout.data_parallel_sharding
    if mode == "full" and layout.data_parallel > 1:
        check_fully_sharded_callbacks(callbacks)
    if mode in SHARDED_MODES and layout.data_parallel > 1:
        check_precision(precision, mode)
        for optimizer in optimizers:
            check_shardable_optimizer(optimizer, mode)


def check_fully_sharded_callbacks(callbacks: Sequence[Any]) -> None:
    """Refuse a callback that cannot run with ``data_parallel_sharding='full'`` over several replicas."""
    for callback in callbacks:
        reason = full_sharding_refusal(callback)
        if reason is not None:
            raise ValueError(f"{type(callback).__name__} cannot run with data_parallel_sharding='full': {reason}; "
                             "use data_parallel_sharding='optimizer' or 'gradients' with it")


def check_precision(precision: Any, mode: str) -> None:
    """Refuse a loss-scaling precision with sharded optimizer state: each rank would find overflows only in its
    own slice of the gradients and skip steps the others take."""
    if getattr(precision, "scaler", None) is not None:
        raise ValueError(_sharded_scaling_refusal(mode))


def _sharded_scaling_refusal(mode: str) -> str:
    return (f"data_parallel_sharding={mode!r} with a loss-scaling precision (16-mixed) would let ranks skip different "
            "steps; use precision='bf16-mixed' or '32-true', or data_parallel_sharding='none'")


def check_loss_scaling(layout: Any, precision: Any) -> None:
    """Refuse a loss-scaling precision (one with a ``scaler``) ``layout`` cannot take (:func:`refuse_loss_scaling`)."""
    if getattr(precision, "scaler", None) is not None:
        refuse_loss_scaling(layout)


def refuse_loss_scaling(layout: Any) -> None:
    """Refuse loss scaling with pipeline or tensor parallelism: the pipeline schedule's backward runs on the
    unscaled loss (unscaling then divides the gradients by the scale), and unscaling mixes the tensor-parallel
    DTensor gradients with plain ones; and with FSDP2 over several replicas, whose ranks hold slices."""
    split = [f"{name}={degree}" for name, degree in (("pipeline_parallel", layout.pipeline_parallel),
                                                     ("tensor_parallel", layout.tensor_parallel)) if degree > 1]
    if split:
        raise ValueError(
            f"merak3d with {' and '.join(split)} cannot train with a loss-scaling precision (16-mixed, a GradScaler): "
            "its gradients would be wrongly scaled; use precision='bf16-mixed' or '32-true'"
        )
    if layout.data_parallel_sharding == "full" and layout.data_parallel > 1:
        raise ValueError(_sharded_scaling_refusal("full"))
