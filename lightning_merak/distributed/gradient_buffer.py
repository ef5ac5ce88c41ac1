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

from lightning_merak.distributed.dtensors import local_tensor

__all__ = ["Bucket", "GradientBuffer", "ShardSlice", "TAIL_BUCKET_BYTES", "tail_first_sizes"]

TAIL_BUCKET_BYTES = 2**19
"""The last bucket of a buffer in ready order closes at this size (or ``bucket_bytes`` when smaller), and the buckets
before it double up to ``bucket_bytes``: the last ones start only as the backward ends, so they are what is left
exposed once the link has kept up (DDP keeps its first bucket, the same role in its order, at 1 MiB)."""


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
        ready_order: the order an earlier step finished these gradients in (:meth:`finish_order`); buckets
            then follow it and are filled from the last one (:func:`tail_first_sizes`) instead of from the
            reversed ``params``. Parameters it leaves out go last, in reverse order.
        released: start every bucket without memory (:meth:`Bucket.restore` gives it on the first write),
            so that gradients can move in from another buffer bucket by bucket.

    A gradient assigned directly (``param.grad = ...``, as zero-bubble schedules do for weight
    gradients) is moved into its slice by :meth:`gather`, which a collective's caller runs first.
    A parameter whose gradient is ``None`` keeps ``None``; its slice is zeroed so that a
    collective over the buffer adds nothing for it.
    """

    def __init__(self, params: Sequence[nn.Parameter], *, bucket_bytes: Optional[int] = None, shards: int = 1,
                 late: Collection[nn.Parameter] = (),
                 on_ready: Optional[Callable[[Bucket], None]] = None,
                 ready_order: Optional[Sequence[nn.Parameter]] = None, released: bool = False) -> None:
        seen: set[int] = set()
        trainable = []
        for param in params:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                trainable.append(param)
        late_ids = {id(param) for param in late}
        self.buckets: list[Bucket] = []
        self._released = released
        if ready_order is None:
            self._reversed_buckets(trainable, late_ids, bucket_bytes, shards)
        else:
            self._ready_order_buckets(trainable, late_ids, ready_order, bucket_bytes, shards)
        self._bucket_of = {id(param): bucket for bucket in self.buckets for param in bucket.params}
        self._on_ready = on_ready
        self.before_write: Optional[Callable[[Bucket], None]] = None
        """Called with a bucket before gradients are written into it (a caller using the bucket for something
        else in between waits for that here)."""
        self._backwards = 0
        self._accumulated: dict[int, int] = {}
        self._accumulations = 0
        self._finished: dict[int, int] = {}
        """By ``id``: when each parameter's gradient was last accumulated (a count of accumulations)."""
        self._hooks = [param.register_post_accumulate_grad_hook(self._adopt_hook(param, view))
                       for bucket in self.buckets for param, view in zip(bucket.params, bucket.views)]

    def _reversed_buckets(self, trainable: list[nn.Parameter], late_ids: set[int], bucket_bytes: Optional[int],
                          shards: int) -> None:
        """Reversed ``params``, each dtype's bucket closed once it holds ``bucket_bytes``."""
        ordered = [param for param in reversed(trainable) if id(param) not in late_ids]
        ordered += [param for param in reversed(trainable) if id(param) in late_ids]
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

    def _ready_order_buckets(self, trainable: list[nn.Parameter], late_ids: set[int],
                             ready_order: Sequence[nn.Parameter], bucket_bytes: Optional[int], shards: int) -> None:
        """Each dtype's gradients in ``ready_order`` cut by :func:`tail_first_sizes`; buckets ordered by when their
        last gradient is finished, the late ones after (in reverse order, as they are never ready early)."""
        members = {id(param) for param in trainable if id(param) not in late_ids}
        position = {}
        for param in [*ready_order, *reversed(trainable)]:
            if id(param) in members and id(param) not in position:
                position[id(param)] = len(position)
        ordered = sorted((param for param in trainable if id(param) in members), key=lambda p: position[id(p)])
        groups: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in ordered:
            groups.setdefault(local_tensor(param).dtype, []).append(param)
        cuts = []
        for group in groups.values():
            sizes = [local_tensor(param).nbytes for param in group]
            start = 0
            for count in tail_first_sizes(sizes, bucket_bytes, TAIL_BUCKET_BYTES):
                cuts.append(group[start:start + count])
                start += count
        for cut in sorted(cuts, key=lambda cut: position[id(cut[-1])]):
            self._add_bucket(cut, False, shards)
        self._reversed_buckets([param for param in trainable if id(param) in late_ids], late_ids, bucket_bytes,
                               shards)

    def _add_bucket(self, params: list[nn.Parameter], late: bool, shards: int) -> None:
        locals_ = [local_tensor(param) for param in params]
        offsets, total = [], 0
        for local in locals_:
            offsets.append(total)
            total += local.numel()
        padded = -(-total // shards) * shards
        make = torch.empty if self._released else torch.zeros
        flat = make(padded, dtype=locals_[0].dtype, device=locals_[0].device)
        bucket = Bucket(len(self.buckets), flat, params, offsets, late, shards)
        bucket.views = [flat[offset:offset + local.numel()].view(local.shape)
                        for offset, local in zip(offsets, locals_)]
        if self._released:
            bucket.release()
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

    def finish_order(self) -> list[nn.Parameter]:
        """The parameters of the early buckets by when their gradients were last accumulated, earliest first (the
        order the last backward finished them in), then those never accumulated, in buffer order."""
        early = [param for bucket in self.buckets if not bucket.late for param in bucket.params]
        seen = sorted((param for param in early if id(param) in self._finished), key=lambda p: self._finished[id(p)])
        return seen + [param for param in early if id(param) not in self._finished]

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
            self._accumulations += 1
            self._finished[id(param)] = self._accumulations
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


def tail_first_sizes(sizes: Sequence[int], bucket_bytes: Optional[int], tail_bytes: Optional[int]) -> list[int]:
    """How many of consecutive items of ``sizes`` bytes each bucket holds, first to last, filled from the last: the
    last bucket closes once it holds ``tail_bytes`` (``None``: ``bucket_bytes``), each one before it at twice the
    size of the one after, up to ``bucket_bytes``, and the first keeps what is left (``bucket_bytes=None``: one
    bucket). A bucket waits for its last gradient, so the buckets finished as the backward ends stay small."""
    if bucket_bytes is None:
        return [len(sizes)] if sizes else []
    counts: list[int] = []
    count, filled, limit = 0, 0, min(bucket_bytes, bucket_bytes if tail_bytes is None else tail_bytes)
    for size in reversed(sizes):
        count, filled = count + 1, filled + size
        if filled >= limit:
            counts.append(count)
            count, filled, limit = 0, 0, min(bucket_bytes, 2 * limit)
    if count:
        counts.append(count)
    return counts[::-1]


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
