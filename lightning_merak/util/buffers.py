"""Module buffers that a forward changes: BatchNorm's running statistics, EMA and step counters.

:func:`buffers_kept` runs a module for a while and leaves its buffers as they were. The build's trace and
profiling, and torch's pipeline metadata inference, run the real module in training mode (the inference even on
uninitialised ``torch.empty`` inputs); a running statistic must count the training batches only, as it would
without merak3d.

:class:`ReplicaBuffers` keeps the buffers training changes equal over the data-parallel replicas, as Lightning's
DDP (``broadcast_buffers=True``) does: data-parallel rank 0's values become every replica's before each training
forward and before a fit's validation. A buffer is sent from the sync after its first change on, whenever that
comes (after a warm-up, a BatchNorm unfrozen at epoch 2), so a model whose buffers training leaves alone (rotary
tables, position ids) sends none.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["BufferSlot", "BufferSnapshot", "KeptBuffers", "ReplicaBuffers", "buffer_snapshot", "buffers_kept",
           "changed_buffers", "replicated_buffers"]

BufferSlot = tuple[nn.Module, str]
"""A buffer as its owner holds it: ``owner._buffers[name]`` (a forward may replace the tensor there)."""

BufferSnapshot = dict[BufferSlot, tuple[torch.Tensor, Optional[int], torch.Tensor]]
"""Each buffer's tensor, its in-place version counter and a copy of its value at one moment."""


def _slots(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(full name, owner, name, tensor)`` of every buffer of ``module`` (a shared submodule once)."""
    for prefix, owner in module.named_modules():
        for name, tensor in owner._buffers.items():
            if tensor is not None:
                yield f"{prefix}.{name}" if prefix else name, owner, name, tensor


@contextlib.contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Every buffer of ``module`` with the value (and tensor) it had before the block, whatever ran inside.

    Every value is written back (BatchNorm's kernel updates its running statistics without counting a version),
    keeping the version counter the block left: a buffer it left alone reads as untouched, and a graph it built
    (torch's shape inference differentiates its forward afterwards) does not see a tensor it saved as modified.
    Buffers on the meta device hold no value to keep; buffers registered inside the block stay.
    """
    saved = [(owner, name, tensor, tensor.detach().clone())
             for _, owner, name, tensor in _slots(module) if not tensor.is_meta]
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, tensor, value in saved:
                owner._buffers[name] = tensor
                with torch.autograd._unsafe_preserve_version_counter(tensor):
                    tensor.copy_(value)


class KeptBuffers:
    """:func:`buffers_kept` of ``module`` around each entry, then ``inner``'s (a context entered alike): re-enterable,
    as ``torch.utils.checkpoint``'s recompute context must be (torch recomputes a region once per backward pass that
    reaches it), so a recomputed block's running statistics count each training batch once."""

    def __init__(self, module: nn.Module, inner: Optional[contextlib.AbstractContextManager] = None) -> None:
        self.module, self.inner = module, inner
        self._entered: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(buffers_kept(self.module))
        if self.inner is not None:
            stack.enter_context(self.inner)
        self._entered.append(stack)

    def __exit__(self, *exc_info: object) -> Optional[bool]:
        return self._entered.pop().__exit__(*exc_info)


def _replicated_slots(module: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """``(owner, name, tensor)`` of every buffer each data-parallel replica holds a copy of. Left out, by the
    conventions DDP and DeepSpeed use for parameters: names in ``_ddp_params_and_buffers_to_ignore`` on
    ``module``, and the buffers of a module holding this rank's experts: one with ``allreduce=False`` weights, or
    one that says so with ``holds_local_experts`` (an INT4 expert tensor's scales and zero-points)."""
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    for full_name, owner, name, tensor in _slots(module):
        if (full_name not in ignored and not getattr(owner, "holds_local_experts", False)
                and all(getattr(param, "allreduce", True) is not False for param in owner.parameters(recurse=False))):
            yield owner, name, tensor


def replicated_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The buffers of ``module`` every data-parallel replica holds a copy of (:func:`_replicated_slots`): those a
    setup may make equal by broadcasting rank 0's, as DDP does at construction."""
    return [tensor for _, _, tensor in _replicated_slots(module)]


def _version(tensor: torch.Tensor) -> Optional[int]:
    """``tensor``'s in-place version counter, where this torch has one (without, its value alone tells)."""
    return getattr(tensor, "_version", None)


def buffer_snapshot(module: nn.Module) -> BufferSnapshot:
    """The replicated buffers of ``module`` (:func:`replicated_buffers`), each with its tensor, version and value
    now."""
    return {(owner, name): (tensor, _version(tensor), tensor.detach().clone())
            for owner, name, tensor in _replicated_slots(module)}


def changed_buffers(before: BufferSnapshot) -> list[BufferSlot]:
    """The buffers of ``before`` replaced, written in place or holding another value since (BatchNorm's kernel
    updates its running statistics without counting a version, so a buffer whose version stayed is compared; the
    comparisons stay on the buffers' device until one transfer of their results)."""
    moved, compared = [], []
    for slot, (tensor, version, value) in before.items():
        owner, name = slot
        if owner._buffers.get(name) is not tensor or _version(tensor) != version or tensor.shape != value.shape:
            moved.append(slot)
        else:
            compared.append((slot, torch.ne(tensor, value).any()))
    if not compared:
        return moved
    device = compared[0][1].device
    differs = torch.stack([flag.to(device) for _, flag in compared]).tolist()
    return moved + [slot for (slot, _), flag in zip(compared, differs) if flag]


def _broadcast(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """``tensors`` as the group's first rank holds them, on every rank of ``group``: one message per dtype."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for same in by_kind.values():
            flat = torch.cat([tensor.reshape(-1) for tensor in same])
            dist.broadcast(flat, src=source, group=group)
            for tensor, part in zip(same, flat.split([tensor.numel() for tensor in same])):
                tensor.copy_(part.view_as(tensor))


class ReplicaBuffers:
    """The buffers training changes, made equal over a data-parallel group as DDP makes them.

    The replicas start equal (the strategy's setup broadcasts :func:`replicated_buffers`; a meta model is
    materialised alike).
    Before every training step, and before a fit's validation when a training step ran since (DDP syncs before a
    forward that follows a training forward), the ranks agree on the buffers that changed since the last sync (a
    write, a new value or a replaced tensor, on any rank of the group: one small all-reduce of flags while some
    buffer has not changed yet) and rank 0's values of every buffer that ever changed reach the group. A buffer
    that never changes is never sent.
    """

    def __init__(self) -> None:
        self._unchanged: Optional[BufferSnapshot] = None
        """The buffers no sync has seen change yet, with their tensors, versions and values at the first sync."""
        self._changing: list[BufferSlot] = []
        """The buffers a sync saw change: sent at every sync from then on."""
        self._trained_since_sync = False

    def before_training_step(self, module: nn.Module, group: dist.ProcessGroup) -> None:
        """Rank 0's values of the changing buffers of ``module`` (this rank's part) on every rank of ``group``."""
        self._sync(module, group)
        self._trained_since_sync = True

    def before_validation(self, module: nn.Module, group: dist.ProcessGroup) -> None:
        """As :meth:`before_training_step`, where a training step changed them since."""
        if self._trained_since_sync:
            self._sync(module, group)
            self._trained_since_sync = False

    def _sync(self, module: nn.Module, group: dist.ProcessGroup) -> None:
        if group.size() == 1:
            return
        if self._unchanged is None:  # the first training step: the replicas are equal
            self._unchanged = buffer_snapshot(module)
            return
        if self._unchanged:
            self._changing += self._agreed_changes(self._unchanged, group)
        if self._changing:
            _broadcast([owner._buffers[name] for owner, name in self._changing], group)

    @staticmethod
    def _agreed_changes(unchanged: BufferSnapshot, group: dist.ProcessGroup) -> list[BufferSlot]:
        """The buffers of ``unchanged`` changed since on any rank of ``group`` (they run the same code, on other
        data), taken out of it."""
        slots = list(unchanged)
        changed = set(changed_buffers(unchanged))
        device = next(iter(unchanged.values()))[0].device  # where the group's backend takes tensors (NCCL: GPU)
        flags = torch.tensor([slot in changed for slot in slots], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        agreed = [slot for slot, flag in zip(slots, flags.tolist()) if flag]
        for slot in agreed:
            del unchanged[slot]
        return agreed
