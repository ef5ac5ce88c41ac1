"""The precision the layout planner measures in: the training step's, so that what it times and what the blocks save
for backward are what the run computes (bf16-mixed's autocast computes and saves activations in 16 bits)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["training_precision"]


@contextlib.contextmanager
def training_precision(precision: Any, device: torch.device) -> Iterator[None]:
    """``precision``'s ``forward_context`` (a Lightning precision plugin; None: none), in which merak3d runs a step's
    forwards and, pipelined, its backwards too. Not a ``*-true`` precision's: it sets the default dtype for weights
    it converts only after planning, so the unconverted model would mix dtypes. Without autocast's cache of 16-bit
    weight copies: a training step empties it, while one over the whole profile would keep a copy of every block
    the profile makes or materialises."""
    converts = str(getattr(precision, "precision", "")).endswith("-true")
    with precision.forward_context() if precision is not None and not converts else contextlib.nullcontext():
        if not torch.is_autocast_enabled(device.type):
            yield
            return
        with torch.autocast(device.type, dtype=torch.get_autocast_dtype(device.type), cache_enabled=False):
            yield
