"""Gradients kept as views of flat bucket tensors, for collectives that run on them in place.

Averaging gradients over data-parallel replicas with one collective needs them contiguous.
Concatenating them after the backward costs a second copy of every gradient at the step's peak
(and a copy back); holding them in flat buckets from the start costs nothing extra: each
gradient autograd creates is moved into its slice the moment it is accumulated (a
post-accumulate hook), later accumulations add into the slice in place, and the collective runs
on the bucket itself. Parameters are laid out in reverse order, the order a backward usually
finishes them in, so the first buckets are complete first.

A bucket is *ready* once every parameter in it has been accumulated as many times as the step
runs backward passes (:meth:`GradientBuffer.arm`: one, or a pipeline stage's micro-batches):
its gradients are final, and the caller's ``on_ready`` starts the bucket's collective while the
backward goes on. Parameters whose gradients change after the backward (summed over tensor-
parallel or pipeline ranks first) go into buckets of their own that are never ready early.

Each bucket's length is a multiple of ``shards``; :meth:`Bucket.shard_slices` says which part of
which parameter the ``i``-th of those equal parts covers (ZeRO's partition of a bucket).

Pure runtime: no process groups; the caller runs the collectives.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_merak.runtime.dtensors import local_tensor

__all__ = ["Bucket", "GradientBuffer", "ShardSlice"]


class ShardSlice(NamedTuple):
    """Elements ``[start, stop)`` of ``param``'s flattened local tensor, at ``offset`` in the shard."""

    param: nn.Parameter
    start: int
    stop: int
    offset: int


@dataclass(eq=False)
class Bucket:
    """Consecutive gradients of one dtype in one flat tensor (padded to a multiple of the shard count)."""

    index: int
    flat: torch.Tensor
    params: list[nn.Parameter]
    offsets: list[int]
    late: bool
    shards: int
    views: list[torch.Tensor] = field(default_factory=list)
    waiting: int = 0
    """Parameters not yet accumulated as often as the armed step's backward passes."""

    @property
    def shard_numel(self) -> int:
        return self.flat.numel() // self.shards

    @property
    def released(self) -> bool:
        return self.flat.untyped_storage().size() == 0

    def shard_slices(self, shard: int) -> list[ShardSlice]:
        """The parts of parameters that shard ``shard`` of this bucket covers, in bucket order."""
        low, high = shard * self.shard_numel, (shard + 1) * self.shard_numel
        slices = []
        for param, offset in zip(self.params, self.offsets):
            numel = local_tensor(param).numel()
            start, stop = max(low, offset), min(high, offset + numel)
            if start < stop:
                slices.append(ShardSlice(param, start - offset, stop - offset, start - low))
        return slices

    def release(self) -> None:
        """Free the bucket's memory (its gradients must be dropped first); :meth:`restore` brings it back."""
        self.flat.untyped_storage().resize_(0)

    def restore(self) -> None:
        """Give a released bucket its memory back, zeroed (every view of it is valid again)."""
        if self.released:
            self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())
            self.flat.zero_()


class GradientBuffer:
    """The gradients of ``params`` (trainable, each once) as views of flat bucket tensors.

    Args:
        params: the parameters whose gradients the buffer holds.
        bucket_bytes: close a bucket once it holds this many bytes (``None``: one bucket per dtype).
        shards: pad every bucket to a multiple of this many elements (the ranks sharing it).
        late: parameters whose gradients the caller still changes after the backward; their
            buckets are never ready early.
        on_ready: called with a bucket when an armed step has finished its gradients.

    A gradient assigned directly (``param.grad = ...``, as zero-bubble schedules do for weight
    gradients) is moved into its slice by :meth:`gather`, which a collective's caller runs first.
    A parameter whose gradient is ``None`` keeps ``None``; its slice is zeroed so that a
    collective over the buffer adds nothing for it.
    """

    def __init__(self, params: Sequence[nn.Parameter], *, bucket_bytes: Optional[int] = None, shards: int = 1,
                 late: Collection[nn.Parameter] = (),
                 on_ready: Optional[Callable[[Bucket], None]] = None) -> None:
        seen: set[int] = set()
        trainable = []
        for param in params:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                trainable.append(param)
        late_ids = {id(param) for param in late}
        ordered = [param for param in reversed(trainable) if id(param) not in late_ids]
        ordered += [param for param in reversed(trainable) if id(param) in late_ids]
        self.buckets: list[Bucket] = []
        groups: dict[tuple[torch.dtype, bool], list[nn.Parameter]] = {}
        filled: dict[tuple[torch.dtype, bool], int] = {}
        for param in ordered:
            local = local_tensor(param)
            key = (local.dtype, id(param) in late_ids)
            groups.setdefault(key, []).append(param)
            filled[key] = filled.get(key, 0) + local.numel() * local.element_size()
            if bucket_bytes is not None and filled[key] >= bucket_bytes:
                self._add_bucket(groups.pop(key), key[1], shards)
                del filled[key]
        for (_, is_late), group in groups.items():
            self._add_bucket(group, is_late, shards)
        self._bucket_of = {id(param): bucket for bucket in self.buckets for param in bucket.params}
        self._on_ready = on_ready
        self.before_write: Optional[Callable[[Bucket], None]] = None
        """Called with a bucket before gradients are written into it (a caller using the bucket for something
        else in between waits for that here)."""
        self._backwards = 0
        self._accumulated: dict[int, int] = {}
        self._hooks = [param.register_post_accumulate_grad_hook(self._adopt_hook(param, view))
                       for bucket in self.buckets for param, view in zip(bucket.params, bucket.views)]

    def _add_bucket(self, params: list[nn.Parameter], late: bool, shards: int) -> None:
        locals_ = [local_tensor(param) for param in params]
        offsets, total = [], 0
        for local in locals_:
            offsets.append(total)
            total += local.numel()
        padded = -(-total // shards) * shards
        flat = torch.zeros(padded, dtype=locals_[0].dtype, device=locals_[0].device)
        bucket = Bucket(len(self.buckets), flat, params, offsets, late, shards)
        bucket.views = [flat[offset:offset + local.numel()].view(local.shape)
                        for offset, local in zip(offsets, locals_)]
        self.buckets.append(bucket)

    @property
    def flats(self) -> list[torch.Tensor]:
        """Every bucket's flat tensor, in bucket order."""
        return [bucket.flat for bucket in self.buckets]

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters whose gradients the buffer holds, in buffer order."""
        return [param for bucket in self.buckets for param in bucket.params]

    def bucket_of(self, param: nn.Parameter) -> Bucket:
        return self._bucket_of[id(param)]

    def arm(self, backwards: int) -> None:
        """Announce a step of ``backwards`` backward passes: a bucket is ready once each of its parameters has
        been accumulated that often (0: no bucket is ready early)."""
        self._backwards = backwards
        self._accumulated = {}
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)

    def disarm(self) -> None:
        self._backwards = 0

    def _adopt_hook(self, param: nn.Parameter, view: torch.Tensor) -> Any:
        bucket = self._bucket_of[id(param)]

        def adopt(tensor: nn.Parameter) -> None:
            if self.before_write is not None:
                self.before_write(bucket)
            bucket.restore()
            _adopt(tensor, view)
            if self._backwards and not bucket.late:
                self._count(param, bucket)
        return adopt

    def _count(self, param: nn.Parameter, bucket: Bucket) -> None:
        times = self._accumulated.get(id(param), 0) + 1
        self._accumulated[id(param)] = times
        if times > self._backwards:
            raise RuntimeError(
                f"a gradient was accumulated {times} times in a step of {self._backwards} backward passes, after its "
                "bucket's reduction had started; set overlap_grad_reduce=False for this model"
            )
        if times == self._backwards:
            bucket.waiting -= 1
            if bucket.waiting == 0 and self._on_ready is not None:
                self._on_ready(bucket)

    def gather(self) -> None:
        """Move every gradient not yet in the buffer into its slice; zero the slices of absent gradients."""
        for bucket in self.buckets:
            self.gather_bucket(bucket)

    def gather_bucket(self, bucket: Bucket) -> None:
        """:meth:`gather` for one bucket (its padding stays zero)."""
        if self.before_write is not None:
            self.before_write(bucket)
        bucket.restore()
        for param, view in zip(bucket.params, bucket.views):
            if param.grad is None:
                view.zero_()
            else:
                _adopt(param, view)

    def drop_gradients(self, bucket: Bucket) -> None:
        """Set the gradients viewing ``bucket`` to ``None`` (before releasing it, or to start a step afresh)."""
        for param in bucket.params:
            param.grad = None

    def remove(self) -> None:
        """Stop adopting new gradients (the buffer's memory goes with the last gradient that views it)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _adopt(param: nn.Parameter, view: torch.Tensor) -> None:
    """Point ``param.grad`` at ``view``, copying the gradient there unless it already lives there."""
    grad = param.grad
    local = local_tensor(grad)
    if local.data_ptr() == view.data_ptr() and local.shape == view.shape:
        return
    view.copy_(local)
    if isinstance(grad, DTensor):
        param.grad = DTensor.from_local(view, grad.device_mesh, grad.placements, run_check=False,
                                        shape=grad.shape, stride=grad.stride())
    else:
        param.grad = view
