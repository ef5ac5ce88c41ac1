"""Checkpoints that appear whole or not at all, and finding the newest whole one.

A checkpoint is written under a hidden temporary name next to its final one (``.<name>.partial``,
same directory, hence same file system), flushed to disk with ``fsync`` and only then renamed to
its final name; the rename is atomic, so a run killed while saving leaves the previous checkpoint
and a ``.partial`` leftover, never a truncated ``<name>``. This applies to single files (Lightning's
``.ckpt``) and to merak3d's checkpoint directories alike.

:func:`newest_complete` picks the checkpoint a restarted run resumes from: the newest (by the time it
was written) whose content is whole, skipping leftovers and checkpoints written without these
guarantees that were cut short (:func:`why_incomplete` says what one lacks). A merak3d directory is whole
only when every shard file its index lists is there (:func:`missing_shards`): ranks on other nodes write their
shards where they see the directory, which is the same one only on a file system every node sees.

Test hook (used by ``tests/test_faults_restart.py`` to kill a run inside a save deterministically): with
``LIGHTNING_MERAK_TEST_STALL_SAVE=<checkpoint name>`` set, the first save of that name writes its
temporary copy, records the saving process's id in ``<name>.stalled`` next to it and waits (up to
:data:`STALL_S`) before the rename, long enough to be killed. Later saves of that name (the marker
exists) do not wait.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

__all__ = ["PARTIAL_SUFFIX", "STALL_ENV", "NotSharedCheckpointError", "atomic_file", "fsync_tree",
           "is_checkpoint_directory", "is_complete", "missing_shards", "newest_complete",
           "newest_complete_and_skipped", "partial_path", "publish_directory", "refuse_unseen_shards",
           "why_incomplete"]

PARTIAL_SUFFIX = ".partial"
STALL_ENV = "LIGHTNING_MERAK_TEST_STALL_SAVE"
STALL_S = 300.0
# merak3d's checkpoint directories: torch distributed checkpoint's index, and Lightning's own state.
_DCP_METADATA = ".metadata"
_LIGHTNING_STATE = "lightning.ckpt"


def partial_path(path: Path) -> Path:
    """The temporary name ``path`` is written under before it is published."""
    return path.parent / f".{path.name}{PARTIAL_SUFFIX}"


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(path: Path) -> None:
    """Flush ``path`` (a file, or a directory with every file below it) to disk."""
    if path.is_dir():
        for child in path.rglob("*"):
            if child.is_file():
                _fsync(child)
    _fsync(path)


def _stall_if_requested(path: Path) -> None:
    """The test hook described in the module docstring."""
    if os.environ.get(STALL_ENV) != path.name:
        return
    marker = path.parent / f"{path.name}.stalled"
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    time.sleep(STALL_S)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield the temporary path to write ``path``'s content to; on success it becomes ``path`` atomically.

    On an exception the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    temporary = partial_path(path)
    try:
        yield temporary
        _fsync(temporary)
        _stall_if_requested(path)
        _replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync(path.parent)


def publish_directory(temporary: Path, path: Path) -> None:
    """Flush the fully written directory ``temporary`` and rename it to ``path`` (replacing an older one)."""
    fsync_tree(temporary)
    _stall_if_requested(path)
    _replace(temporary, path)
    _fsync(path.parent)


def _replace(temporary: Path, path: Path) -> None:
    """Rename ``temporary`` to ``path``, replacing what is there: a file by a file in one rename; a directory (a
    sharded checkpoint; a run resumed at its last step saves its final checkpoint as a file, its layout never built),
    or anything by a directory, which no rename replaces, moved aside first (a kill between the two renames leaves
    this name absent, the older checkpoints of the run untouched)."""
    if path.exists() and not path.is_symlink() and (path.is_dir() or temporary.is_dir()):
        retired = path.parent / f".{path.name}.old"
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(path, retired)
        os.replace(temporary, path)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(temporary, path)


def _whole_zip(path: Path) -> bool:
    """Whether ``path`` is a torch.save file whose end (zip central directory) was written."""
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (OSError, ValueError, NotImplementedError, zipfile.BadZipFile):  # cut short, or a damaged directory (a
        # name that is not UTF-8, an unknown zip version)
        return False


def missing_shards(directory: Path) -> list[str]:
    """The files a merak3d checkpoint directory's ``.metadata`` index lists that ``directory`` lacks, or holds
    shorter than the index records: shards another node wrote where this host does not see them.

    Raises what reading the index raises (``UnsafeCheckpointError`` for an index holding other objects).
    """
    from lightning_merak.checkpoint.safe_load import read_dcp_metadata, short_data_files  # lazy: torch

    with open(Path(directory) / _DCP_METADATA, "rb") as stream:
        metadata = read_dcp_metadata(stream)
    return list(short_data_files(Path(directory), metadata))


class NotSharedCheckpointError(RuntimeError):
    """Rank 0 does not see every shard of a checkpoint the ranks wrote: the checkpoint directory is not on a file
    system every node sees. The message names the files and the fix."""


def refuse_unseen_shards(temporary: Path, path: Path, global_rank: int) -> None:
    """Raise :class:`NotSharedCheckpointError` on every rank, before ``temporary`` is published as ``path``, where
    rank 0 does not see each shard its index lists (a collective: every rank calls it after the shards are written).

    Ranks on other nodes write their shards where they see the directory, which is rank 0's only on a file system
    every node sees; published without them, the directory would look complete and fail to load."""
    import torch.distributed as dist  # lazy: torch

    missing = [missing_shards(temporary) if global_rank == 0 else None]
    dist.broadcast_object_list(missing, src=0)
    if missing[0]:
        raise NotSharedCheckpointError(
            f"{path}: rank 0 does not see {', '.join(missing[0])} of the checkpoint, which other ranks wrote where "
            f"they see {temporary}; nothing was published. The checkpoint directory must be on a file system every "
            "node sees: give every node the same shared output directory (hydra.run.dir=/shared/path/run)")


def is_checkpoint_directory(path: Path) -> bool:
    """Whether ``path`` is one merak3d checkpoint directory (whole or not), rather than a directory of checkpoints:
    it holds Lightning's state file or a DCP index, or is named as checkpoints are (``*.ckpt``)."""
    path = Path(path)
    return path.is_dir() and (path.suffix == ".ckpt" or (path / _LIGHTNING_STATE).exists()
                              or (path / _DCP_METADATA).exists())


def _missing_parts(directory: Path) -> Optional[str]:
    """What a merak3d directory lacks, or None where its index reads back and lists only files it holds in full."""
    from lightning_merak.checkpoint.safe_load import (  # lazy: torch
        UnsafeCheckpointError,
        read_dcp_metadata,
        short_data_files,
    )

    try:
        with open(directory / _DCP_METADATA, "rb") as stream:
            metadata = read_dcp_metadata(stream)
    except UnsafeCheckpointError:
        raise  # whole, but unsafe to read: a refusal naming the fix, not a checkpoint to skip
    except FileNotFoundError:
        return f"it has no {_DCP_METADATA} index (a save that did not finish)"
    except (OSError, EOFError, pickle.UnpicklingError):
        return f"its {_DCP_METADATA} index is cut short or damaged"
    short = short_data_files(directory, metadata)
    if not short:
        return None
    return "it lacks shard files its index lists: " + ", ".join(
        f"{name} (missing)" if size is None else f"{name} ({size} of its {end} bytes)"
        for name, (size, end) in short.items())


def why_incomplete(path: Path) -> Optional[str]:
    """Why ``path`` is not a whole checkpoint (a clause naming what is missing or cut short), or None where it is one:
    a ``torch.save`` file, or a merak3d directory with its state file, its index and every shard the index lists."""
    path = Path(path)
    if is_checkpoint_directory(path):
        if not _whole_zip(path / _LIGHTNING_STATE):
            return f"its {_LIGHTNING_STATE} is missing or cut short"
        return _missing_parts(path)
    if not path.is_file():
        return "it is neither a file nor a merak3d checkpoint directory"
    return None if _whole_zip(path) else "it is not a whole torch.save file (cut short while it was written?)"


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a whole checkpoint (:func:`why_incomplete` finds nothing missing)."""
    return why_incomplete(path) is None


def _written_at(path: Path) -> float:
    return (path / _LIGHTNING_STATE if path.is_dir() else path).stat().st_mtime


def newest_complete_and_skipped(directory: Path) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """The newest whole ``*.ckpt`` in ``directory`` (by the time its content was written), or None, and the newer
    ones skipped on the way, each with why (:func:`why_incomplete`).

    Hidden temporary copies and links (``last.ckpt`` points at another checkpoint) are not candidates.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None, []
    candidates = [path for path in directory.glob("*.ckpt") if not path.name.startswith(".") and not path.is_symlink()]
    written: list[tuple[float, Path]] = []
    for path in candidates:
        with contextlib.suppress(OSError):  # removed meanwhile, or a directory without its state file
            written.append((_written_at(path), path))
    skipped: list[tuple[Path, str]] = []
    for _, path in sorted(written, reverse=True):
        why = why_incomplete(path)
        if why is None:
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def newest_complete(directory: Path) -> Optional[Path]:
    """The newest whole ``*.ckpt`` in ``directory``, or None (:func:`newest_complete_and_skipped`)."""
    return newest_complete_and_skipped(directory)[0]
