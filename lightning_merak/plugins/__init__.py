"""Layers and plugins used by lightning-merak's strategies and callbacks.

The MoE layer pulls in DeepSpeed, so :mod:`lightning_merak.plugins.moe` imports its names
on first use; these re-exports stay lazy too.
"""

from typing import Any

from lightning_merak.plugins import moe

__all__ = ["MoE", "MoEOptions", "PlacementMOELayer", "TransferScheduler", "swap_sparse_moe_blocks"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(moe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
