"""Lightning's checkpoint files written atomically and read weights-only.

Strategies that write single ``.ckpt`` files (DDP, and merak3d before its layout is built) go through
a ``CheckpointIO``; this one publishes each file with :func:`~lightning_merak.checkpoint.files.atomic_file`
(a run killed while saving keeps its previous checkpoint) and loads with
:func:`~lightning_merak.checkpoint.safe_load.load_torch_file` (no arbitrary unpickling).
``merak-train`` installs it; in Python pass ``pl.Trainer(plugins=[SafeCheckpointIO()])``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_merak.checkpoint.files import atomic_file
from lightning_merak.checkpoint.safe_load import load_torch_file

__all__ = ["SafeCheckpointIO"]


def _is_local(path: _PATH) -> bool:
    return "://" not in str(path)


class SafeCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with atomic saves of local files and weights-only loads.

    An explicit ``weights_only=False`` (``Trainer.fit(..., weights_only=False)``) is the caller's own
    decision for a file they trust and is honoured; left unset, loading is weights-only.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as temporary:
            torch.save(checkpoint, temporary)

    def load_checkpoint(self, path: _PATH, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if weights_only is False or not _is_local(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if not Path(path).exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return load_torch_file(path, map_location=map_location)
