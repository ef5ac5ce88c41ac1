"""Measure what each block costs: forward and backward time, saved bytes, staleness.

The pure half turns per-step event records into a :class:`StepProfile`
(:func:`profile_from_records`, :func:`agree_profile`); the torch half counts saved tensors
through pass-through ``saved_tensors_hooks`` (:class:`SavedTensorTracker`) and reads the
device's memory (:class:`DeviceMemory`).
"""

from __future__ import annotations

import ctypes
import os
import resource
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence

import torch
from torch import nn

from lightning_merak.callbacks.delta.ledger import ResidentLedger
from lightning_merak.callbacks.delta.memory_planner import BACKWARD, FORWARD, BlockProfile, StepProfile
from lightning_merak.distributed.dtensors import local_tensor

__all__ = [
    "BlockRecord",
    "DeviceMemory",
    "SavedTensorTracker",
    "agree_profile",
    "profile_from_records",
    "storage_key",
    "storage_nbytes",
    "unpack_kept",
]

OUTSIDE = "<outside blocks>"


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """Identity of the memory behind ``tensor``: views of one storage share it."""
    local = local_tensor(tensor)
    return (str(local.device), local.untyped_storage().data_ptr())


def storage_nbytes(tensor: torch.Tensor) -> int:
    return local_tensor(tensor).untyped_storage().nbytes()


@dataclass
class BlockRecord:
    """Event times (``perf_counter`` seconds) and saved bytes of one block in one step."""

    name: str
    forward_start: float | None = None
    forward_end: float | None = None
    backward_start: float | None = None
    backward_end: float | None = None
    saved_bytes: int = 0
    boundary_bytes: int = 0

    @property
    def complete(self) -> bool:
        return None not in (self.forward_start, self.forward_end, self.backward_start)


def profile_from_records(records: Iterable[BlockRecord], outside_bytes: int) -> StepProfile:
    """One step's profile, blocks ordered by when their first forward ran.

    A block that ran several times in the step (one record per micro-batch of a pipeline
    schedule) gets the mean of its records, and the profile keeps the order of every
    forward and backward start as its events. A block whose input needs no gradient has no
    backward-end event; its backward time is then taken as twice its forward time (the
    usual ratio for matmul-heavy blocks).
    """
    by_name: dict[str, list[BlockRecord]] = {}
    for r in sorted((r for r in records if r.complete), key=lambda r: r.forward_start):
        by_name.setdefault(r.name, []).append(r)
    index = {name: i for i, name in enumerate(by_name)}
    blocks = []
    for name, runs in by_name.items():
        forward = [max(0.0, r.forward_end - r.forward_start) for r in runs]
        backward = [
            max(0.0, r.backward_end - r.backward_start) if r.backward_end is not None else 2 * f
            for r, f in zip(runs, forward)
        ]
        blocks.append(
            BlockProfile(
                name=name,
                forward_s=statistics.fmean(forward),
                backward_s=statistics.fmean(backward),
                saved_bytes=round(statistics.fmean(r.saved_bytes for r in runs)),
                boundary_bytes=round(statistics.fmean(r.boundary_bytes for r in runs)),
                stale_s=statistics.fmean(max(0.0, r.backward_start - r.forward_end) for r in runs),
            )
        )
    timed = [(r.forward_start, FORWARD, index[r.name]) for runs in by_name.values() for r in runs]
    timed += [(r.backward_start, BACKWARD, index[r.name]) for runs in by_name.values() for r in runs]
    events = tuple((kind, i) for _, kind, i in sorted(timed))
    return StepProfile(tuple(blocks), outside_bytes, events)


def agree_profile(gathered: Sequence[tuple[tuple[str, ...], Any]], rank: int) -> Any:
    """The payload of the lowest rank that manages the same blocks as ``rank``.

    Data-parallel replicas then plan from identical numbers and make identical decisions,
    while pipeline stages (different blocks per rank) each keep their own.
    """
    names = gathered[rank][0]
    for other_names, payload in gathered:
        if other_names == names:
            return payload
    raise AssertionError("a rank's own entry is always among the gathered ones")


class _KeptTensor:
    """A saved tensor left on the device; it counts as resident until autograd drops it."""

    __slots__ = ("tensor", "key", "ledger")

    def __init__(self, tensor: torch.Tensor, key: Hashable, ledger: ResidentLedger) -> None:
        self.tensor = tensor
        self.key = key
        self.ledger = ledger
        ledger.acquire(key, storage_nbytes(tensor))

    def __del__(self) -> None:
        self.ledger.release(self.key)


@dataclass
class SavedTensorTracker:
    """Counts saved tensors per owner (a block, or everything outside blocks), by storage.

    Parameters and buffers are saved tensors too (a linear layer saves its weight); they
    are recognised by storage and never counted, swapped or accounted as activations.
    """

    ledger: ResidentLedger
    before_keep: Optional[Callable[[int], None]] = None
    """Called with the size of a kept storage about to be counted (the swap stash makes room)."""
    _excluded: set[tuple[str, int]] = field(default_factory=set)
    _seen: dict[str, dict[Hashable, int]] = field(default_factory=dict)
    _boundary: dict[str, set[tuple[str, int]]] = field(default_factory=dict)

    def exclude_module_state(self, module: nn.Module) -> None:
        """Remember the storages of ``module``'s parameters and buffers (call each step)."""
        self._excluded = {
            storage_key(t) for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta"
        }

    def is_state(self, tensor: torch.Tensor) -> bool:
        return isinstance(tensor, nn.Parameter) or storage_key(tensor) in self._excluded

    def start_step(self) -> None:
        self._seen = {}
        self._boundary = {}

    def set_boundary(self, owner: str, inputs: Iterable[torch.Tensor]) -> None:
        """The block's own inputs: the part of its saved bytes that recompute still keeps."""
        self._boundary[owner] = {storage_key(t) for t in inputs}

    def note(self, owner: str, key: Hashable, nbytes: int) -> None:
        """Count a saved storage once per owner; ``key`` must stay unique while counted."""
        self._seen.setdefault(owner, {})[key] = nbytes

    def saved_bytes(self, owner: str) -> int:
        return sum(self._seen.get(owner, {}).values())

    def boundary_bytes(self, owner: str) -> int:
        boundary = self._boundary.get(owner, set())
        return sum(n for k, n in self._seen.get(owner, {}).items() if k in boundary)

    def keep(self, owner: str, tensor: torch.Tensor) -> object:
        """Pack hook for tensors that stay on the device: count them, return a token."""
        if self.is_state(tensor) or tensor.layout is not torch.strided:
            return tensor
        key = storage_key(tensor)
        nbytes = storage_nbytes(tensor)
        self.note(owner, key, nbytes)
        if self.before_keep is not None and not self.ledger.is_resident(key):
            self.before_keep(nbytes)
        return _KeptTensor(tensor, key, self.ledger)

    def hooks(self, owner: str) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.keep(owner, t), unpack_kept)


def unpack_kept(packed: object) -> torch.Tensor:
    """Unpack hook matching :meth:`SavedTensorTracker.keep`."""
    return packed.tensor if isinstance(packed, _KeptTensor) else packed


def _read_status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _host_total_bytes() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _find_malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class DeviceMemory:
    """Total, current and peak memory of the training device (CUDA) or of this process (CPU).

    On CPU the peak is the process's high-water mark (VmHWM), reset through
    ``/proc/self/clear_refs`` where the kernel allows it; otherwise it only grows.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"

    def total(self) -> int:
        if self.is_cuda:
            return torch.cuda.get_device_properties(self.device).total_memory
        return _host_total_bytes()

    def in_use(self) -> int:
        if self.is_cuda:
            return torch.cuda.memory_allocated(self.device)
        rss = _read_status_kib("VmRSS")
        return rss * 1024 if rss is not None else 0

    def peak(self) -> int:
        if self.is_cuda:
            return torch.cuda.max_memory_allocated(self.device)
        hwm = _read_status_kib("VmHWM")
        if hwm is not None:
            return hwm * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def release_free(self) -> None:
        """On CPU, give the pages of freed heap memory back to the OS (glibc ``malloc_trim``).

        The heap keeps the layout of whatever ran before (warm-up at another input size, a
        previous plan); its free pages stay resident and count in the process's memory
        until the new plan's allocations happen to reuse them. Worth it once per plan
        change, not per step (pages given back are faulted in again when reused).
        """
        if self.is_cuda:
            return
        trim = _find_malloc_trim()
        if trim is not None:
            trim(0)

    def reset_peak(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
        except OSError:
            pass
