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
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
from pathlib import Path
from typing import IO, Any, Optional, Union

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["RECORD_GLOBALS", "SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpointError", "load_torch_file",
           "read_dcp_metadata"]

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


def _record_global(name: str) -> Any:
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def load_torch_file(path: Union[str, Path, IO[bytes]], map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``, refusing other objects with the fix named.

    Only :data:`RECORD_GLOBALS` are allowed besides torch's defaults, each imported when a file asks for it
    (importing PEFT costs seconds, and most checkpoints have no adapters).
    """
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
