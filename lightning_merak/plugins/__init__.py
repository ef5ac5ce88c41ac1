"""Layers and plugins used by lightning-merak's strategies and callbacks.

The MoE layer pulls in DeepSpeed, so it is imported on first use rather than with the package.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "MoE": "lightning_merak.plugins.moe",
    "MoEOptions": "lightning_merak.plugins.moe",
    "PlacementMOELayer": "lightning_merak.plugins.moe",
    "TransferScheduler": "lightning_merak.plugins.moe",
    "swap_sparse_moe_blocks": "lightning_merak.plugins.moe.swap",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
