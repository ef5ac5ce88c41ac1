"""The tensors of a lightning-merak checkpoint, read one at a time, for :mod:`lightning_merak.hf.export`.

A merak3d sharded checkpoint (a torch distributed checkpoint directory keyed by the unsplit model's names) is read
by ``dcp.load`` of a one-key state dict, once every data file its index lists is there in full; a Lightning
``.ckpt`` file (DDP) by a memory-mapped weights-only ``torch.load`` (nothing is unpickled,
:mod:`lightning_merak.checkpoint.safe_load`). Anything else is refused up front, naming what to pass instead; a data
file that fails to read later (damaged inside) is refused naming it.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["CheckpointSource"]

_VALID_CHECKPOINT = ("merak-train writes valid ones: a .ckpt file (DDP) or a merak3d checkpoint directory under "
                     "the run's checkpoints/ folder, as does Lightning's Trainer.save_checkpoint")

_DCP_INDEX = ".metadata"
"""The index torch distributed checkpoint writes last in a directory, naming where each tensor is stored."""


class CheckpointSource:
    """Tensors of a checkpoint under Lightning's names (``model.<name>``), read one at a time."""

    def __init__(self, path: Path) -> None:
        import torch

        from lightning_merak.checkpoint.safe_load import SafeFileSystemReader, load_torch_file  # lazy: torch
        from lightning_merak.checkpoint.sharded import LIGHTNING_CHECKPOINT, is_sharded_checkpoint  # lazy: torch

        self.path = path
        self.sharded = is_sharded_checkpoint(path)
        if self.sharded:
            from torch.distributed.checkpoint.metadata import TensorStorageMetadata

            if not (path / _DCP_INDEX).is_file():
                raise ValueError(f"{path} holds {LIGHTNING_CHECKPOINT} but no {_DCP_INDEX} index, so its tensors "
                                 f"cannot be read (a save that did not finish?); {_VALID_CHECKPOINT}")
            self.metadata = _checkpoint_dict(path / LIGHTNING_CHECKPOINT, load_torch_file)
            index = SafeFileSystemReader(path).read_metadata()
            _refuse_short_data_files(path, index)
            self.entries = {key[len("model."):]: (tuple(entry.size), entry.properties.dtype)
                            for key, entry in index.state_dict_metadata.items()
                            if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)}
            self.files: dict[str, set[str]] = {}  # each key: the data files holding its records
            for where, stored in (index.storage_data or {}).items():
                self.files.setdefault(where.fqn, set()).add(stored.relative_path)
        elif path.is_file():
            self.metadata = _checkpoint_dict(path, lambda file: load_torch_file(file, mmap=True))
            self.state = self.metadata.get("state_dict", {})
            self.entries = {key: (tuple(value.shape), value.dtype) for key, value in self.state.items()
                            if isinstance(value, torch.Tensor)}
        else:
            raise ValueError(_not_a_checkpoint(path))

    def read(self, key: str) -> torch.Tensor:
        import torch

        if not self.sharded:
            return self.state[key]
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from lightning_merak.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner  # lazy: torch

        shape, dtype = self.entries[key]
        state = {"model." + key: torch.empty(shape, dtype=dtype)}
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, storage_reader=SafeFileSystemReader(self.path), planner=SafeLoadPlanner(),
                         no_dist=True)
        except CheckpointException as error:  # dcp wraps whatever its one process raised, an interrupt too
            cause = next(iter(error.failures.values()))[0]
            raise self._read_failure(key, cause) from cause
        return state["model." + key]

    def _read_failure(self, key: str, cause: BaseException) -> BaseException:
        """What to raise where reading ``key`` failed with ``cause``: an interrupt or running out of memory as it is
        (not the checkpoint's doing), anything else as damage of the data files that hold ``key``."""
        import torch

        from lightning_merak.checkpoint.safe_load import DamagedCheckpointError  # lazy: torch

        if not isinstance(cause, Exception) or isinstance(cause, (MemoryError, torch.OutOfMemoryError)):
            return cause
        files = ", ".join(str(self.path / name) for name in sorted(self.files.get("model." + key, ())))
        detail = str(cause).strip().split(". ")[0].splitlines()[0] if str(cause).strip() else ""
        return DamagedCheckpointError(
            f"{files or self.path} cannot be read back (reading {key}: {type(cause).__name__}"
            f"{': ' + detail if detail else ''}): truncated or damaged since it was written, or unreadable; point at "
            "another checkpoint (an earlier one of the same run)")


def _not_a_checkpoint(path: Path) -> str:
    """Why ``path`` (neither a file nor a merak3d checkpoint directory) is refused, naming what to pass instead."""
    from lightning_merak.checkpoint.sharded import LIGHTNING_CHECKPOINT, is_sharded_checkpoint  # lazy: torch

    if not path.is_dir():
        what = "is not a regular file" if path.exists() else "does not exist"
        return f"{path} {what}; pass a checkpoint: {_VALID_CHECKPOINT}"
    inside = sorted(entry.name for entry in path.iterdir()
                    if entry.suffix == ".ckpt" or is_sharded_checkpoint(entry))
    held = f"it holds the checkpoints {inside[:5]}: pass one of them" if inside else _VALID_CHECKPOINT
    return (f"{path} is a directory without {LIGHTNING_CHECKPOINT}, so neither a merak3d checkpoint directory nor a "
            f"Lightning .ckpt file; {held}")


def _refuse_short_data_files(path: Path, index: Metadata) -> None:
    """Refuse a merak3d directory whose data files its ``.metadata`` index lists are missing or cut short, naming
    them, before any tensor is read: the read would fail part way through an export."""
    from lightning_merak.checkpoint.safe_load import DamagedCheckpointError, short_data_files  # lazy: torch

    short = short_data_files(path, index)
    if short:
        what = "; ".join(f"{path / name} is missing" if size is None else
                         f"{path / name} is truncated or damaged ({size} bytes, its index places data up to byte "
                         f"{end})" for name, (size, end) in short.items())
        raise DamagedCheckpointError(f"{what}: the checkpoint is incomplete (a copy cut short, or a save that did not "
                                     f"finish); point at another checkpoint (an earlier one of the same run) or copy "
                                     "the whole directory again")


def _checkpoint_dict(path: Path, load: Callable[[Path], Any]) -> dict[str, Any]:
    """The checkpoint dict ``load`` reads from the ``torch.save`` file ``path``, refused up front when the file is no
    ``torch.save`` archive (empty, truncated, another format): torch's own error would blame its mmap option."""
    size = path.stat().st_size
    if not _is_torch_archive(path):
        raise ValueError(f"{path} ({size} bytes) is not a readable checkpoint: not a torch.save archive (empty, "
                         f"truncated, or another format); {_VALID_CHECKPOINT}")
    checkpoint = load(path)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path} holds a {type(checkpoint).__name__}, not a Lightning checkpoint dict; "
                         f"{_VALID_CHECKPOINT}")
    return checkpoint


def _is_torch_archive(path: Path) -> bool:
    """Whether ``path`` is a zip archive holding a ``data.pkl`` record, as ``torch.save`` writes by default."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.rpartition("/")[2] == "data.pkl" for name in archive.namelist())
