"""Lightning callbacks of lightning-merak."""

from lightning_merak.callbacks.delta import DeltaMemory

__all__ = ["DeltaMemory"]
