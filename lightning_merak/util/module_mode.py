"""Run a module in a given mode, or with hooks, for a while, and leave it as it was."""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["hooks_removed_after", "modules_in_mode"]


@contextlib.contextmanager
def modules_in_mode(module: nn.Module, training: bool) -> Iterator[None]:
    """Every submodule of ``module`` in training (or eval) mode meanwhile, then each back in its own mode.

    Recording or checking a forward must not depend on the mode a loop left the module in.
    """
    modes = {part: part.training for part in module.modules()}
    module.train(training)
    try:
        yield
    finally:
        for part, mode in modes.items():
            part.training = mode


@contextlib.contextmanager
def hooks_removed_after(handles: Iterable[RemovableHandle]) -> Iterator[None]:
    """The hooks of ``handles`` stay installed for the block's duration, and are removed whatever happens."""
    handles = list(handles)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
