"""Lightning callbacks of lightning-merak.

Names are imported on first use: each callback pulls in its feature (``MoEPlacementCallback``
pulls in DeepSpeed), and the Hydra options only need the pure parts.
"""

from lightning_merak.util.lazy import lazy_attributes

_EXPORTS = {
    "AgreedSigtermStop": "lightning_merak.callbacks.agreed_stop",
    "DeltaMemory": "lightning_merak.callbacks.delta",
    "FaultWatch": "lightning_merak.callbacks.faults",
    "ModelSummary": "lightning_merak.callbacks.summary",
    "MoEPlacementCallback": "lightning_merak.callbacks.moe.placement",
    "NonFiniteGuard": "lightning_merak.callbacks.nonfinite",
    "PeriodicCheckpoint": "lightning_merak.callbacks.checkpoint",
    "RegionalCompile": "lightning_merak.callbacks.compile",
    "SparseCommunication": "lightning_merak.callbacks.sparse_comm",
    "StepProgressBar": "lightning_merak.callbacks.progress",
    "TrainingMetrics": "lightning_merak.callbacks.metrics",
    "log_figure": "lightning_merak.callbacks.metrics",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_attributes(__name__, _EXPORTS)
