"""What a run prints: dependency noise filtered once, informational lines from rank 0 only.

Called first thing in every rank of ``merak-train`` (the launcher re-runs the same command for
ranks 1..N-1), before any heavy library is imported, so filters are in place when a
dependency warns at import time.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["is_rank_zero", "quiet_dependency_noise", "quiet_other_ranks"]

# Messages that say nothing a user can act on, matched at the start of the message.
_IGNORED_WARNINGS = (
    # torch's pytree API change, triggered inside Lightning's own utilities.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)
_IGNORED_LOG_MESSAGES = {
    # bitsandbytes tries an optional Hub kernel for 4-bit CPU matmuls and falls back to its own.
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    # DeepSpeed (imported by transformers' loading code, or by the MoE plugins) on a machine without a GPU.
    "DeepSpeed": ("Setting accelerator to CPU",),
    # torchao (the fp8 extra, imported by PEFT whenever installed) trying its optional kernels built for other GPUs.
    "torchao": ("Failed to load",),
    # torch's pytree registry, on torchao's enums at import.
    "torch.utils._pytree": ("%s is an Enum subclass",),
    # an advertisement for a hosted logger (Lightning's rank_zero_info logger).
    "lightning.pytorch.utilities.rank_zero": ("💡 Tip:",
                                              # merak-train passes its own ModelSummary, on purpose
                                              "Trainer already configured with model summary callbacks"),
}


def is_rank_zero() -> bool:
    """Whether this process is rank 0 of a run started by Lightning's launcher, torchrun or SLURM."""
    return all(os.environ.get(name, "0") in ("", "0") for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_dependency_noise() -> None:
    """Drop known non-actionable warnings and log lines; call before the dependencies are imported.

    Also gives the plugin's own loggers (``lightning_merak.*``) a plain handler at INFO, as
    Lightning does for its own.
    """
    plugin_logger = logging.getLogger("lightning_merak")
    if not plugin_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        plugin_logger.addHandler(handler)
        plugin_logger.setLevel(logging.INFO)
        plugin_logger.propagate = False
    for pattern in _IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for logger_name, prefixes in _IGNORED_LOG_MESSAGES.items():
        logger = logging.getLogger(logger_name)
        if not any(isinstance(existing, _DropMessages) for existing in logger.filters):  # once per process
            logger.addFilter(_DropMessages(prefixes))
    if not is_rank_zero():
        warnings.filterwarnings("ignore", module=r"^(?!lightning_merak)")


def quiet_other_ranks() -> None:
    """On ranks other than 0 keep only warnings and errors; call after importing Lightning.

    Lightning prints informational lines (``Seed set``, ``Initializing distributed``) from every
    rank, and sets its loggers to INFO when imported; rank 0 says them once.
    """
    if not is_rank_zero():
        for logger_name in ("lightning.pytorch", "lightning.fabric", "lightning_merak"):
            logging.getLogger(logger_name).setLevel(logging.WARNING)
