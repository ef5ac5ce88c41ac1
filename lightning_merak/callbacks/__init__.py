"""Lightning callbacks of lightning-merak.

``MoEPlacementCallback`` pulls in DeepSpeed, so it is imported on first use.
"""

from importlib import import_module
from typing import Any

from lightning_merak.callbacks.delta import DeltaMemory
from lightning_merak.callbacks.sparse_comm import SparseCommunication

__all__ = ["DeltaMemory", "MoEPlacementCallback", "SparseCommunication"]


def __getattr__(name: str) -> Any:
    if name == "MoEPlacementCallback":
        return import_module("lightning_merak.plugins.moe.callback").MoEPlacementCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
