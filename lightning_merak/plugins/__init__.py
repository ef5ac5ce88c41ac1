"""Layers and plugins used by lightning-merak's strategies and callbacks."""

from lightning_merak.plugins.moe import MoE, MoEOptions, PlacementMOELayer, TransferScheduler
from lightning_merak.plugins.moe.swap import swap_sparse_moe_blocks

__all__ = ["MoE", "MoEOptions", "PlacementMOELayer", "TransferScheduler", "swap_sparse_moe_blocks"]
