"""Where swapped activations live between forward and backward: the swap tiers.

* :class:`HostTier` - pinned host memory from a pre-allocated slab, copied on a CUDA side
  stream (the default on GPU). On CPU it is a plain copy, useful only for testing.
* :class:`DiskTier` - extents of one reused file in a private directory, written and read
  by a background thread (the default on CPU, where host memory *is* the device memory).

Each copy is a :class:`Transfer` the caller polls or finishes;
:mod:`~lightning_merak.callbacks.delta.activation_swap` decides what is copied and when.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import threading
import warnings
import weakref
from typing import Callable, Optional, Protocol

import torch

from lightning_merak.distributed.streams import SideStreamWork, side_stream
from lightning_merak.util.timing import device_now

__all__ = ["DiskTier", "FutureToDevice", "HostTier", "PinnedSlab", "SwapTier", "Transfer", "as_bytes", "make_tier"]

_ALIGN = 512
SWAP_STREAM = "delta-swap"
"""The side stream swaps are copied on (one per device, shared by the tiers)."""


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage behind ``tensor``."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


class _Pending(Protocol):
    """A result computed elsewhere: a ``concurrent.futures.Future`` or a batch member."""

    def done(self) -> bool: ...

    def result(self) -> object: ...


class Transfer:
    """An asynchronous copy; ``done`` polls, ``wait`` blocks, ``finish`` returns the result.

    ``finish`` is called on the thread that will use the result: on CUDA its current stream waits for
    the copy on the side stream, which hands the result over to it
    (:meth:`~lightning_merak.distributed.streams.SideStreamWork.hand_over`).
    """

    def __init__(
        self,
        result: object = None,
        future: Optional[_Pending] = None,
        side: Optional[SideStreamWork] = None,
        keep_alive: object = None,
    ) -> None:
        self._result = result
        self._future = future
        self._side = side
        self._keep_alive = keep_alive

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._side is None or self._side.done()

    def finish(self) -> object:
        if self._future is not None:
            self._result = self._future.result()
            self._future = None
        if self._side is not None:
            self._result = self._side.hand_over(self._result)
            self._side = None
        self._keep_alive = None
        return self._result


class SwapTier:
    """Where swapped storages live between forward and backward."""

    name = "abstract"

    def copy_out(self, data: torch.Tensor) -> Transfer:
        raise NotImplementedError

    def copy_in(self, stored: object, device: torch.device) -> Transfer:
        raise NotImplementedError

    def discard(self, stored: object) -> None:
        """Free what ``copy_out`` produced once nothing can unpack it again."""

    def submit(self) -> None:
        """Start the transfers a tier may hold back to send together (a block's worth)."""

    def end_step(self) -> None:
        """All transfers of the step are finished; reusable space may be recycled."""

    def capacity_bytes(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Release every resource of the tier; safe to call more than once."""

    def measure_bandwidth(
        self, device: torch.device, nbytes: int = 32 * 2**20, repeats: int = 3
    ) -> tuple[float, float]:
        """(copy-out, copy-in) bytes per second through this tier's own code path.

        Timed by the wall clock with the device synchronised at each end: the copies run on a side stream.
        """
        probe = torch.ones(nbytes, dtype=torch.uint8, device=device)
        best_out, best_in = float("inf"), float("inf")
        for _ in range(repeats):
            start = device_now(device)
            stored = self.copy_out(probe).finish()
            copied_out = device_now(device)
            best_out = min(best_out, copied_out - start)
            self.copy_in(stored, device).finish()
            best_in = min(best_in, device_now(device) - copied_out)
            self.discard(stored)
        self.end_step()
        return nbytes / max(best_out, 1e-9), nbytes / max(best_in, 1e-9)


class PinnedSlab:
    """Pre-allocated pinned host memory handed out by a bump pointer, reset every step.

    Allocating pinned memory on the fly synchronises the device; a slab does it once.
    """

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.offset = 0

    def allocate(self, nbytes: int) -> Optional[torch.Tensor]:
        start = (self.offset + _ALIGN - 1) // _ALIGN * _ALIGN
        if start + nbytes > self.buffer.numel():
            return None
        self.offset = start + nbytes
        return self.buffer[start : start + nbytes]

    def reset(self) -> None:
        self.offset = 0


class HostTier(SwapTier):
    """Host memory; on CUDA pinned (slab) and copied on a side stream."""

    name = "host"

    def __init__(self, device: torch.device, pool_bytes: int) -> None:
        self.device = device
        self.pool_bytes = pool_bytes
        self.is_cuda = device.type == "cuda"
        self.copy_stream = side_stream(device, SWAP_STREAM)
        self.slab: Optional[PinnedSlab] = None
        self._warned_slab = False

    def reserve(self, nbytes: int) -> None:
        """Pre-allocate the pinned slab for the planned swapped bytes of one step."""
        if not self.is_cuda or nbytes <= 0:
            return
        nbytes = min(nbytes + 64 * _ALIGN, self.pool_bytes)
        if self.slab is None or self.slab.buffer.numel() < nbytes:
            self.slab = None
            self.slab = PinnedSlab(nbytes)

    def measure_bandwidth(
        self, device: torch.device, nbytes: int = 32 * 2**20, repeats: int = 3
    ) -> tuple[float, float]:
        """As the base's, with the probe copied into the slab as swaps are (no on-the-fly pinning in the timing)."""
        self.reserve(nbytes * repeats)  # the slab's space is reused only after the step ends
        return super().measure_bandwidth(device, nbytes, repeats)

    def copy_out(self, data: torch.Tensor) -> Transfer:
        if not self.is_cuda:
            return Transfer(result=data.to("cpu", copy=True))
        host = self.slab.allocate(data.numel()) if self.slab is not None else None
        if host is None:
            if not self._warned_slab:
                warnings.warn(
                    "DeltaMemory: pinned slab exhausted; allocating pinned memory on the fly, "
                    "which synchronises the device (re-plan or raise host_pool_bytes)",
                    stacklevel=2,
                )
                self._warned_slab = True
            host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
        with SideStreamWork(self.device, SWAP_STREAM) as copy:
            copy.uses(data)  # the compute stream may free it before the copy ran
            host.copy_(data, non_blocking=True)
        return Transfer(result=host, side=copy, keep_alive=data)

    def copy_in(self, stored: object, device: torch.device) -> Transfer:
        if not self.is_cuda:
            return Transfer(result=stored)
        with SideStreamWork(self.device, SWAP_STREAM) as copy:
            data = torch.empty(stored.numel(), dtype=torch.uint8, device=device)
            data.copy_(stored, non_blocking=True)
        return Transfer(result=data, side=copy)

    def end_step(self) -> None:
        if self.is_cuda:
            self.copy_stream.synchronize()
        if self.slab is not None:
            self.slab.reset()

    def capacity_bytes(self) -> int:
        return self.pool_bytes

    def close(self) -> None:
        if self.is_cuda:
            self.copy_stream.synchronize()
        self.slab = None


_IOV_MAX = 1024


def _transfer_run(syscall: Callable[[int, list, int], int], fd: int, offset: int, views: list[memoryview]) -> None:
    """``os.pwritev``/``os.preadv`` of buffers that lie back to back in the file from ``offset``."""
    views = [v for v in views if len(v)]
    while views:
        moved = syscall(fd, views[:_IOV_MAX], offset)
        if moved == 0:
            raise RuntimeError(f"DeltaMemory: swap file ends early at offset {offset}")
        offset += moved
        while views and moved >= len(views[0]):
            moved -= len(views[0])
            views.pop(0)
        if moved:
            views[0] = views[0][moved:]


def _run_batch(syscall: Callable[[int, list, int], int], fd: int, items: list[tuple[int, torch.Tensor]]) -> None:
    """Every ``(offset, buffer)`` of a batch, one system call per stretch of adjacent extents.

    The batch's list is emptied afterwards, so written activations are freed as soon as
    they are on disk, not when the last member's handle goes.
    """
    run_start, run_end, run = -1, -1, []
    for offset, buffer in sorted(items, key=lambda item: item[0]):
        if offset != run_end and run:
            _transfer_run(syscall, fd, run_start, run)
            run = []
        if not run:
            run_start = offset
        run.append(buffer.numpy().data)
        run_end = offset + buffer.numel()
    if run:
        _transfer_run(syscall, fd, run_start, run)
    items.clear()


class _Batch:
    """Transfers queued for the worker thread and sent to it as one task.

    Each task wakes the worker, which then competes with the training thread for the GIL
    and, on a busy machine, for a core; a few tasks per block instead of one per storage
    keep that cost small. Waiting for any member sends the batch first; once sent, a batch
    takes no more members (``add`` returns False).
    """

    def __init__(self, executor: concurrent.futures.ThreadPoolExecutor, syscall: Callable, fd: int) -> None:
        self.executor = executor
        self.syscall = syscall
        self.fd = fd
        self.items: list[tuple[int, torch.Tensor]] = []
        self.nbytes = 0
        self.future: Optional[concurrent.futures.Future] = None
        self._lock = threading.Lock()

    def add(self, offset: int, buffer: torch.Tensor) -> bool:
        with self._lock:
            if self.future is not None:
                return False
            self.items.append((offset, buffer))
            self.nbytes += buffer.numel()
            return True

    def submit(self) -> None:
        with self._lock:
            if self.future is None:
                self.future = self.executor.submit(_run_batch, self.syscall, self.fd, self.items)

    def done(self) -> bool:
        return self.future is not None and self.future.done()

    def wait(self) -> None:
        self.submit()
        self.future.result()


class _BatchMember:
    """The future-like handle of one transfer inside a :class:`_Batch`."""

    __slots__ = ("batch", "value")

    def __init__(self, batch: _Batch, value: object) -> None:
        self.batch = batch
        self.value = value

    def done(self) -> bool:
        return self.batch.done()

    def result(self) -> object:
        self.batch.wait()
        return self.value


def _close_and_remove(fd: int, directory: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    shutil.rmtree(directory, ignore_errors=True)


class DiskTier(SwapTier):
    """One swap file in a private directory, used as an arena and written and read by one thread.

    Storages get adjacent extents handed out by a bump pointer; when no stored extent is
    left alive (after each step's backward) the pointer returns to the start, so every step
    overwrites pages the page cache already holds. That costs a memory copy, where a file
    per storage also pays for page-cache allocation, block allocation and unlinking (about
    3.5x the CPU time on ext4). Copy-outs are batched until ``batch_bytes`` or until
    :meth:`submit`; copy-ins are batched per :meth:`submit` (one block's prefetch). One
    thread keeps the order of the writes and reads of an extent. The directory is removed
    by :meth:`close`, and at interpreter exit if close never ran.
    """

    name = "disk"

    def __init__(self, device: torch.device, directory: Optional[str] = None, batch_bytes: int = 4 * 2**20) -> None:
        try:
            if directory is not None:
                os.makedirs(directory, exist_ok=True)
            self.directory = tempfile.mkdtemp(prefix="delta-swap-", dir=directory)
        except OSError as error:  # a file in the way, no permission: the user's swap_dir, named with the fix
            raise ValueError(
                f"swap_dir {directory!r}: the disk tier cannot create its directory there ({error}); name a "
                "writable directory or None (tmp)"
            ) from error
        self.device = device
        self.batch_bytes = batch_bytes
        self.path = os.path.join(self.directory, "arena.bin")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="delta-swap")
        self._lock = threading.Lock()
        self._end = 0
        self._live = 0
        self._writes = _Batch(self._executor, os.pwritev, self._fd)
        self._reads = _Batch(self._executor, os.preadv, self._fd)
        self._cleanup = weakref.finalize(self, _close_and_remove, self._fd, self.directory)

    def _allocate(self, nbytes: int) -> int:
        with self._lock:
            offset = self._end
            self._end += nbytes
            self._live += 1
            return offset

    def copy_out(self, data: torch.Tensor) -> Transfer:
        host = data.to("cpu") if data.device.type != "cpu" else data
        offset = self._allocate(host.numel())
        while not self._writes.add(offset, host):
            self._writes = _Batch(self._executor, os.pwritev, self._fd)
        batch = self._writes
        if batch.nbytes >= self.batch_bytes:
            batch.submit()
        return Transfer(future=_BatchMember(batch, (offset, host.numel())), keep_alive=data)

    def copy_in(self, stored: object, device: torch.device) -> Transfer:
        # allocated here, on the training thread: a buffer malloc'ed by the worker thread
        # would come from that thread's arena and not be reused by the training thread
        buffer = torch.empty(stored[1], dtype=torch.uint8)
        while not self._reads.add(stored[0], buffer):
            self._reads = _Batch(self._executor, os.preadv, self._fd)
        member = _BatchMember(self._reads, buffer)
        if device.type == "cpu":
            return Transfer(future=member)
        return Transfer(result=FutureToDevice(member, device))

    def submit(self) -> None:
        for batch in (self._writes, self._reads):
            if batch.items:
                batch.submit()

    def discard(self, stored: object) -> None:
        """Called from whichever thread drops the last reference, hence the lock."""
        with self._lock:
            self._live -= 1
            if self._live == 0:
                self._end = 0

    def capacity_bytes(self) -> int:
        return shutil.disk_usage(self.directory).free // 2

    def files(self) -> list[str]:
        return sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else []

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._cleanup()


class FutureToDevice:
    """Disk tier on an accelerator: the read finishes on the worker, the H2D on use."""

    def __init__(self, future: _Pending, device: torch.device) -> None:
        self.future = future
        self.device = device


def make_tier(name: str, device: torch.device, directory: Optional[str], pool_bytes: int) -> SwapTier:
    if name == "host":
        return HostTier(device, pool_bytes)
    if name == "disk":
        return DiskTier(device, directory)
    raise ValueError(f"unknown swap tier {name!r}; choose 'host' (pinned host memory) or 'disk'")
