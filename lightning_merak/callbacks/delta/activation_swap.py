"""Swap saved activations out of device memory during forward and back before backward.

A block in swap mode runs its forward inside :meth:`SwapManager.hooks`. Each saved
storage (views of one storage are copied once) starts an asynchronous copy-out to a tier
(:mod:`~lightning_merak.callbacks.delta.swap_tiers`: pinned host memory or a disk file).

The device copy is held (the "stash") until its copy-out completes; then it is dropped and
stops counting in the ledger. :meth:`SwapManager.prefetch` starts copy-ins before a
block's backward; unpacking waits for them, or copies synchronously if none was issued.
"""

from __future__ import annotations

import collections
import itertools
import time
import weakref
from typing import Iterable, Optional

import torch

from lightning_merak.callbacks.delta.profiler import (
    SavedTensorTracker,
    storage_key,
    storage_nbytes,
    unpack_kept,
)
from lightning_merak.callbacks.delta.swap_tiers import FutureToDevice, SwapTier, Transfer, as_bytes

__all__ = ["SwapManager"]


class _SwappedStorage:
    """One device storage on its way out, away, or back; shared by all views packed from it."""

    _serials = itertools.count()

    def __init__(self, manager: SwapManager, data: torch.Tensor, key: tuple[str, int]) -> None:
        self.serial = next(self._serials)
        self.manager = manager
        self.device = data.device
        self.nbytes = data.numel()
        self.key = key
        self.outgoing: Optional[Transfer] = manager.tier.copy_out(data)
        self.device_data: Optional[torch.Tensor] = data
        self.stored: object = None
        self.incoming: Optional[Transfer] = None
        self.loaded: Optional[torch.Tensor] = None
        manager.ledger.acquire(key, self.nbytes)

    def copy_out_done(self) -> bool:
        return self.outgoing is None or self.outgoing.done()

    def finish_copy_out(self) -> None:
        if self.outgoing is None:
            return
        self.stored = self.outgoing.finish()
        self.outgoing = None
        self.device_data = None
        self.manager.forget(self)
        self.manager.ledger.release(self.key)

    def start_copy_in(self) -> None:
        if self.loaded is not None or self.incoming is not None or self.device_data is not None:
            return
        self.finish_copy_out()
        self.incoming = self.manager.tier.copy_in(self.stored, self.device)
        self.manager.ledger.acquire(("swap-in", id(self)), self.nbytes)

    def materialize(self) -> torch.Tensor:
        if self.device_data is not None:
            return self.device_data
        if self.loaded is None:
            started = time.perf_counter()
            self.start_copy_in()
            result = self.incoming.finish()
            if isinstance(result, FutureToDevice):
                result = result.future.result().to(result.device)
            self.loaded = result
            self.incoming = None
            self.manager.wait_s += time.perf_counter() - started
        return self.loaded

    def __del__(self) -> None:
        ledger = self.manager.ledger
        if self.outgoing is not None:
            ledger.release(self.key)
        if self.incoming is not None or self.loaded is not None:
            ledger.release(("swap-in", id(self)))
        if self.outgoing is not None:
            try:
                self.stored = self.outgoing.finish()
            except Exception:
                return
        if self.stored is not None:
            self.manager.tier.discard(self.stored)


class _SwappedView:
    """What autograd keeps for a swapped saved tensor: its storage and how to view it."""

    __slots__ = ("storage", "dtype", "size", "stride", "offset")

    def __init__(self, storage: _SwappedStorage, tensor: torch.Tensor) -> None:
        self.storage = storage
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()


class _SwapHooks(torch.autograd.graph.saved_tensors_hooks):
    """The pack/unpack hooks of one swapped block; leaving them sends the block's last copy-outs."""

    def __init__(self, manager: SwapManager, owner: str) -> None:
        super().__init__(lambda tensor: manager.pack(owner, tensor), manager.unpack)
        self.tier = manager.tier

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        self.tier.submit()


class SwapManager:
    """Pack/unpack hooks of swap-mode blocks, the copy-out stash and prefetching.

    ``budget_bytes`` is enforced on the ledger: if the stash would push resident saved
    bytes over it, the oldest copy-outs are waited for (slower, never over budget).
    """

    def __init__(
        self,
        tier: SwapTier,
        tracker: SavedTensorTracker,
        min_offload_bytes: int = 1024,
        stash_depth: int = 8,
    ) -> None:
        if min_offload_bytes < 0 or stash_depth < 1:
            raise ValueError("min_offload_bytes must be >= 0 and stash_depth >= 1")
        self.tier = tier
        self.tracker = tracker
        self.ledger = tracker.ledger
        self.min_offload_bytes = min_offload_bytes
        self.stash_depth = stash_depth
        self.budget_bytes: float = float("inf")
        self._pending: collections.deque[_SwappedStorage] = collections.deque()
        self._by_key: dict[tuple[str, int], _SwappedStorage] = {}
        self._by_owner: dict[str, list[weakref.ref]] = {}
        self.wait_s = 0.0
        tracker.before_keep = self._make_room

    def take_wait_seconds(self) -> float:
        """Host time spent blocked on copies since the last call (copy time not hidden)."""
        waited, self.wait_s = self.wait_s, 0.0
        return waited

    def hooks(self, owner: str) -> torch.autograd.graph.saved_tensors_hooks:
        return _SwapHooks(self, owner)

    def _swappable(self, tensor: torch.Tensor) -> bool:
        return (
            type(tensor) is torch.Tensor
            and tensor.layout is torch.strided
            and tensor.device.type in ("cpu", "cuda")
            and not tensor.is_sparse
            and storage_nbytes(tensor) >= self.min_offload_bytes
        )

    def pack(self, owner: str, tensor: torch.Tensor) -> object:
        if self.tracker.is_state(tensor) or not self._swappable(tensor):
            return self.tracker.keep(owner, tensor)
        key = storage_key(tensor)
        storage = self._by_key.get(key)
        if storage is None:
            # the tensor exists already; make room for it in the stash before counting it
            self._trim_stash(incoming_bytes=storage_nbytes(tensor), incoming_count=1)
            storage = _SwappedStorage(self, as_bytes(tensor), key)
            self._by_key[key] = storage
            self._pending.append(storage)
            self._by_owner.setdefault(owner, []).append(weakref.ref(storage))
        self.tracker.note(owner, ("swapped", storage.serial), storage.nbytes)
        return _SwappedView(storage, tensor)

    @staticmethod
    def unpack(packed: object) -> torch.Tensor:
        if not isinstance(packed, _SwappedView):
            return unpack_kept(packed)
        data = packed.storage.materialize()
        return torch.empty(0, dtype=packed.dtype, device=data.device).set_(
            data.untyped_storage(), packed.offset, packed.size, packed.stride
        )

    def forget(self, storage: _SwappedStorage) -> None:
        """The device copy is gone: a new storage may now reuse its address."""
        if self._by_key.get(storage.key) is storage:
            del self._by_key[storage.key]

    def _trim_stash(self, incoming_bytes: int = 0, incoming_count: int = 0) -> None:
        """Drop finished copy-outs, then wait for the oldest while the stash is too deep or too big.

        ``incoming_*`` is a storage about to join the stash, counted as if it had already.
        """
        while self._pending and self._pending[0].copy_out_done():
            self._pending.popleft().finish_copy_out()
        started = time.perf_counter()
        while self._pending and (
            len(self._pending) + incoming_count > self.stash_depth
            or self.ledger.resident_bytes + incoming_bytes > self.budget_bytes
        ):
            self._pending.popleft().finish_copy_out()
        self.wait_s += time.perf_counter() - started

    def _make_room(self, nbytes: int) -> None:
        """A kept tensor of ``nbytes`` is about to count: finish copy-outs until it fits the budget."""
        if self._pending and self.ledger.resident_bytes + nbytes > self.budget_bytes:
            self._trim_stash(incoming_bytes=nbytes)

    def flush(self) -> None:
        """Finish every pending copy-out (end of forward)."""
        started = time.perf_counter()
        while self._pending:
            self._pending.popleft().finish_copy_out()
        self.wait_s += time.perf_counter() - started

    def prefetch(self, owners: Iterable[tuple[str, int]]) -> None:
        """Start copy-ins for the storages of each ``(owner, headroom)``, in order, while they fit.

        ``headroom`` is memory that must stay free until that owner's backward (recomputed
        blocks running in between), so a prefetch never pushes a later step over the budget.
        """
        self.flush()
        for owner, headroom in owners:
            for ref in self._by_owner.get(owner, []):
                storage = ref()
                if storage is None or storage.loaded is not None or storage.incoming is not None:
                    continue
                if self.ledger.resident_bytes + storage.nbytes + headroom > self.budget_bytes:
                    self.tier.submit()
                    return
                storage.start_copy_in()
            self.tier.submit()

    def end_step(self) -> None:
        """Backward is over: finish all transfers and forget the step's storages."""
        self.flush()
        self._by_key.clear()
        self._by_owner.clear()
        self.tier.end_step()

    def close(self) -> None:
        self._pending.clear()
        self._by_key.clear()
        self._by_owner.clear()
        self.tier.close()
