"""Lightning callbacks of lightning-merak."""

from lightning_merak.callbacks.delta import DeltaMemory
from lightning_merak.callbacks.sparse_comm import SparseCommunication
from lightning_merak.plugins.moe.callback import MoEPlacementCallback

__all__ = ["DeltaMemory", "MoEPlacementCallback", "SparseCommunication"]
