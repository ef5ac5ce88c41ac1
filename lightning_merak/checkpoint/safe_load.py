"""Loading checkpoints without running code from them: weights-only ``torch.load`` and a safe DCP reader.

A pickle can call any function while it loads, so a checkpoint a user downloaded could run code
on their machine. Every checkpoint lightning-merak reads goes through here:

* ``torch.save`` files (Lightning's ``.ckpt`` and merak3d's ``lightning.ckpt``) load with
  ``weights_only=True``: tensors, containers and plain values only. Lightning's checkpoint dict needs
  no extra allowed globals (checked for DDP and merak3d runs) beyond the PEFT enums of a recorded adapter
  config (:data:`RECORD_GLOBALS`); a file that needs another is refused with :class:`UnsafeCheckpointError`,
  never retried with ``weights_only=False``.
* torch distributed checkpoint reads its ``.metadata`` index with plain ``pickle.load`` and
  non-tensor entries with ``torch.load(weights_only=False)``, and offers no restricted reader;
  :class:`SafeFileSystemReader` reads the index with an unpickler that only builds DCP's own
  metadata classes, and :class:`SafeLoadPlanner` loads entries weights-only.

A ``torch.save`` file damaged since it was written (flipped bytes, a record cut short) fails deep inside torch's
reader or unpickler with whatever error the broken bytes lead to; :func:`load_torch_file` refuses it as a
:class:`DamagedCheckpointError` naming the file, the record that fails its checksum where one does, and the fix.
torch does not check the checksums itself, so flipped bytes inside a tensor's data load without an error.

A torch distributed checkpoint's data files can be missing or cut short (a copy that stopped, a shard another node
wrote where this host does not see it) while its index is whole; :func:`short_data_files` finds them from the index
alone, before any tensor is read.
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
import struct
import zipfile
from pathlib import Path
from typing import IO, Any, Optional, Union

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["RECORD_GLOBALS", "DamagedCheckpointError", "SafeFileSystemReader", "SafeLoadPlanner",
           "UnsafeCheckpointError", "load_torch_file", "read_dcp_metadata", "short_data_files"]

_FIX = ("lightning-merak loads checkpoints weights-only and never unpickles other objects. If you wrote this "
        "file yourself and trust it, allow exactly the objects it needs with "
        "torch.serialization.add_safe_globals([...]) before loading, or save it again holding only tensors, "
        "containers and plain values")

# What DCP's .metadata pickle may build: its own metadata records, sizes, dtypes, layouts, paths.
_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


# The only objects beyond torch's weights-only defaults a lightning-merak checkpoint holds: the enums of the PEFT
# adapter configs that :func:`~lightning_merak.checkpoint.names.model_record` saves (built from their value,
# running nothing).
RECORD_GLOBALS = frozenset({"peft.utils.peft_types.PeftType", "peft.utils.peft_types.TaskType"})


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds objects that loading would have to run code to build; the message names the fix."""


class DamagedCheckpointError(ValueError):
    """A checkpoint file torch cannot read back, damaged or cut short since it was written: a refusal (``merak-train``
    prints it without a traceback) naming the file and the fix."""


_DAMAGE_SYMPTOMS = (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError, TypeError, AttributeError,
                    AssertionError, struct.error, pickle.UnpicklingError)
"""What ``torch.load`` raises on a damaged file: found by flipping, one at a time, each byte of a checkpoint's
records and zip headers."""


def _record_global(name: str) -> Any:
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def _failed_record(path: Path) -> Optional[str]:
    """What of the ``torch.save`` archive ``path`` fails zip's own checks (a record's CRC-32, a header), or None where
    every record reads back as written. Reads the whole file: only once a load has failed."""
    try:
        with zipfile.ZipFile(path) as archive:
            failed = archive.testzip()
    except (*_DAMAGE_SYMPTOMS, zipfile.BadZipFile) as error:  # its directory itself damaged
        return f"not a readable zip archive ({type(error).__name__}: {error})"
    return None if failed is None else f"its record {failed} fails its CRC-32 check"


def load_torch_file(path: Union[str, Path, IO[bytes]], map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``, refusing other objects with the fix named, and a file damaged since
    it was written as a :class:`DamagedCheckpointError`.

    Only :data:`RECORD_GLOBALS` are allowed besides torch's defaults, each imported when a file asks for it
    (importing PEFT costs seconds, and most checkpoints have no adapters).
    """
    try:
        return _load_weights_only(path, map_location, mmap)
    except _DAMAGE_SYMPTOMS as error:
        if not isinstance(path, (str, Path)) or isinstance(error, (torch.OutOfMemoryError, FileNotFoundError,
                                                                    IsADirectoryError, PermissionError)):
            raise  # not damage: a missing or unreadable path keeps its own error
        damage = _failed_record(Path(path))
        if damage is None and isinstance(error, UnsafeCheckpointError):
            raise  # whole, but asking for objects weights-only loading does not build
        detail = str(error).strip().split(". ")[0]
        what = (f"is damaged: {damage}" if damage else f"cannot be read back (torch.load: {type(error).__name__}"
                f"{': ' + detail if detail else ''}), damaged since it was written or not a checkpoint torch reads")
        raise DamagedCheckpointError(f"{path} {what}; point at another checkpoint (an earlier one of the same run), "
                                     "or start afresh without resume") from error


def _load_weights_only(path: Union[str, Path, IO[bytes]], map_location: Any, mmap: bool) -> Any:
    """``torch.load`` weights-only, allowing each of :data:`RECORD_GLOBALS` once the file asks for it."""
    allowed: list[Any] = []
    while True:
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
        except pickle.UnpicklingError as error:
            match = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
            if match and match.group(1) in RECORD_GLOBALS and _record_global(match.group(1)) not in allowed:
                allowed.append(_record_global(match.group(1)))
                if not isinstance(path, (str, Path)):
                    path.seek(0)
                continue
            what = f"it asks for {match.group(1)}" if match else str(error).strip().splitlines()[-1]
            raise UnsafeCheckpointError(f"refusing to load {path}: {what}, which weights-only loading does not "
                                        f"build. {_FIX}") from error


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"the checkpoint index asks for {module}.{name}, which is not part of torch "
                                    f"distributed checkpoint's metadata. {_FIX}")


def read_dcp_metadata(stream: IO[bytes]) -> Metadata:
    """A DCP ``.metadata`` index, built only from DCP's metadata classes."""
    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"the checkpoint index holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def short_data_files(directory: Path, metadata: Metadata) -> dict[str, tuple[Optional[int], int]]:
    """Each data file the DCP index ``metadata`` places records in that ``directory`` lacks or holds shorter than the
    index records, as ``(its size, None where absent; the size the index needs)``; empty when every file is whole."""
    needed: dict[str, int] = {}  # each file: the end of the last record the index places in it
    for stored in (metadata.storage_data or {}).values():
        needed[stored.relative_path] = max(needed.get(stored.relative_path, 0), stored.offset + stored.length)
    short: dict[str, tuple[Optional[int], int]] = {}
    for name, end in sorted(needed.items()):
        try:
            size: Optional[int] = (Path(directory) / name).stat().st_size
        except FileNotFoundError:
            size = None
        if size is None or size < end:
            short[name] = (size, end)
    return short


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` index is read by :func:`read_dcp_metadata`, not plain pickle."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank: Optional[int] = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as stream:
            metadata = read_dcp_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` loading non-tensor entries weights-only (DCP's own loads them with pickle)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = load_torch_file(value)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
