"""The data-parallel dimension of a built merak3d layout: gradients reduced in buckets while the
backward runs, and with ``data_parallel_sharding`` the optimizer state split over the replicas.

:class:`DataParallelGradients` keeps the replicated parameters' gradients in a
:class:`~lightning_merak.distributed.gradient_buffer.GradientBuffer`. Once the step's last backward
pass (a pipeline stage's last micro-batch) has finished a bucket, its collective starts while the
backward goes on; :meth:`~DataParallelGradients.finish` launches the rest, waits, and averages.

- ``"none"``: every bucket is all-reduced; each replica steps the whole optimizer.
- ``"optimizer"`` (ZeRO-1): each bucket is reduce-scattered over the shard group (CPU ranks send each rank only
  its part, in one all-to-all: :mod:`~lightning_merak.parallel.data.reduce_scatter`), so rank ``i``
  receives the averaged ``i``-th part of every bucket
  (the parameters' own ``.grad`` are ``None`` after the backward: the averaged gradients are the shard
  parameters'). The optimizer's parameter groups hold *shard parameters*, views of those parts of
  the real parameters, so the optimizer keeps state for one ``1/shards`` of the elements and updates
  them in place; after the step each bucket's updated values are all-gathered into every replica's
  parameters.
- ``"gradients"`` (ZeRO-2): as above, and a bucket's full gradients are freed as soon as its
  reduce-scatter is done (during the backward where the step has one backward pass).

With ``shards`` smaller than the data-parallel degree (hybrid), the reduce-scatter runs inside
groups of ``shards`` ranks and the parts are then all-reduced across the groups' replicas.

On CUDA every collective here (a bucket's all-reduce or reduce-scatter during the backward, a parameter
gather during the next forward) runs on NCCL's stream, which waits for the compute stream at its launch, and
its ``wait()`` makes the compute stream wait for it before the averaging or the copy into the parameters; the
buckets, shard parts and parameters it reads and writes are this object's own buffers, alive until then.

Checkpoints stay layout- and mode-independent: :meth:`DataParallelGradients.consolidated` shows
the optimizer with the real parameters and whole states while a checkpoint is written or read.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_merak.distributed.dtensors import local_tensor
from lightning_merak.distributed.gradient_buffer import Bucket, GradientBuffer, ShardSlice
from lightning_merak.distributed.gradient_norm import ShardedGradients
from lightning_merak.distributed.process_groups import new_group
from lightning_merak.parallel.data.gather_waits import first_users, outside_readers
from lightning_merak.parallel.data.gradients import averaged_parameters
from lightning_merak.parallel.data.owners import spread_whole_matrix_steps
from lightning_merak.parallel.data.reduce_scatter import ReduceScatterQueue, start_reduce_scatter
from lightning_merak.parallel.data.sharding_checks import (
    SHARDED_MODES,
    check_precision,
    check_shardable_optimizer,
    check_sharding,
)
from lightning_merak.parallel.data.skipped_communication import (
    Done,
    communication_skipped,
    keep_own_part,
)
from lightning_merak.parallel.data.sliced_state import elementwise, sliced_state
from lightning_merak.parallel.data.whole_matrices import composite_parts, pieces_in_buckets
from lightning_merak.parallel.layout import LayoutGroups
from lightning_merak.protocols.layout_aware import data_parallel_groups_from_mesh
from lightning_merak.util.timing import DeviceSeconds, DeviceStamp

__all__ = ["SHARDED_MODES", "DataParallelGradients", "check_precision",
           "check_shardable_optimizer", "check_sharding", "data_parallel_gradients", "refreshed", "shard_groups"]


def _storage(param: nn.Parameter) -> torch.Tensor:
    """The tensor holding ``param``'s local elements, outside autograd."""
    return local_tensor(param.detach())


def shard_groups(groups: LayoutGroups, shards: int) -> tuple[dist.ProcessGroup, Optional[dist.ProcessGroup]]:
    """The group of ``shards`` data-parallel ranks this rank shares a bucket with, and the group of its
    replicas across those groups (``None`` when the shard group spans every data-parallel rank).

    A collective: every rank creates every group, in the same order."""
    data_parallel = groups.layout.data_parallel
    if shards == data_parallel:
        return groups.data_parallel_group, None
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for members in data_parallel_groups_from_mesh(groups.mesh.mesh.tolist(), groups.mesh.mesh_dim_names):
        for start in range(0, data_parallel, shards):
            chunk = members[start:start + shards]
            group = new_group(chunk)
            if rank in chunk:
                mine["shard"] = group
        for offset in range(shards):
            replicas = members[offset::shards]
            group = new_group(replicas)
            if rank in replicas:
                mine["replicate"] = group
    return mine["shard"], mine["replicate"]


class DataParallelGradients:
    """Bucketed, overlapped reduction of the replicated parameters' gradients, and ZeRO-1/2 sharding.

    Args:
        params: the replicated trainable parameters (one copy on every data-parallel rank).
        late: those whose gradients are still summed over tensor-parallel or pipeline ranks after
            the backward; their buckets are reduced after that.
        groups: the layout's groups.
        mode: ``"none"``, ``"optimizer"`` or ``"gradients"``.
        shards: ranks a bucket is split over (the data-parallel degree unless hybrid).
        overlap: start a bucket's collective when the last backward pass has finished it.
        bucket_bytes: bucket size.
        overlap_param_gather: with ``"optimizer"``, the module whose forward waits for each bucket of
            updated parameters just before the first of its modules that uses it, or before the reads of a module
            read outside its forward (:mod:`~.gather_waits`) (``None``: gathered at once).
        ready_order: the order the first step finished the gradients in, agreed over the replicas
            (:meth:`agreed_finish_order`); the buckets follow it, their memory given on first use
            (:meth:`take_gradients` moves a previous reduction's gradients in).

    With overlap, the first step's reduction (no overlap yet) is replaced by one in ready order (:func:`refreshed`):
    laid out in reversed registration order, a decoder layer's norms (registered last, finished last) held each
    bucket back until the layer's whole backward had run, and the last 6 MB became ready only as the backward ended
    (``docs/design/data-parallel-sharding.md``).
    """

    def __init__(self, params: Sequence[nn.Parameter], late: Sequence[nn.Parameter], *, groups: LayoutGroups,
                 mode: str, shards: int, overlap: bool, bucket_bytes: int,
                 overlap_param_gather: Optional[nn.Module] = None,
                 ready_order: Optional[Sequence[nn.Parameter]] = None) -> None:
        self.mode = mode
        self.sharded = mode in SHARDED_MODES
        self._data_parallel = groups.layout.data_parallel
        self._group = groups.data_parallel_group
        if self.sharded:
            self._shard_group, self._replicate_group = shard_groups(groups, shards)
            self._shard_rank = dist.get_rank(self._shard_group)
        self.buffer = GradientBuffer(params, bucket_bytes=bucket_bytes, shards=shards if self.sharded else 1,
                                     late=late, on_ready=self._launch_early if overlap else None,
                                     ready_order=ready_order, released=ready_order is not None)
        self.ready_ordered = ready_order is not None
        self._positions = {id(param): index for index, param in enumerate(self.buffer.params)}
        self._overlap = overlap
        self._micro_batches = 1
        self.early_launches = 0
        """Buckets whose collective started during a backward (overlapped), over the run."""
        self.validated = False
        """Whether a step has confirmed the averaged parameters (overlap starts after it)."""
        self._communicate = not communication_skipped()
        self._works: dict[int, Any] = {}
        """Plain data parallelism's all-reduces by bucket index (sharded modes queue reduce-scatters instead)."""
        self._scatters = (ReduceScatterQueue(self._shard_group, self._reduced,
                                             start=start_reduce_scatter if self._communicate else keep_own_part)
                          if self.sharded else None)
        self._ready: set[int] = set()
        self._next_launch = 0
        """Buckets ready during this backward, and the index of the next one to start (starts go in order)."""
        self._shard_grads = ([torch.zeros(bucket.shard_numel, dtype=bucket.flat.dtype, device=bucket.flat.device)
                              for bucket in self.buffer.buckets] if self.sharded else [])
        self._shards_of: list[list[tuple[ShardSlice, nn.Parameter]]] = [[] for _ in self.buffer.buckets]
        """By bucket index: the parts of parameters this rank steps, and the shard parameter viewing each."""
        self._step_hooks: list[Any] = []
        self._whole_groups: dict[int, list[list[nn.Parameter]]] = {}
        """Each sharded optimizer's parameter groups as they were, by ``id`` of the optimizer."""
        if self.sharded:
            self._make_shard_parameters()
        self._pending_gathers: dict[int, Any] = {}
        self._gather_waits: list[Any] = []
        """Handles of the forward pre-hooks and read waits that finish the overlapped gathers."""
        if overlap_param_gather is not None:
            self.buffer.before_write = self._finish_gather
            for caller, indices in first_users(overlap_param_gather, self._bucket_index).items():
                self._gather_waits.append(caller.register_forward_pre_hook(self._gathered_before(sorted(indices))))
            for reader, indices in outside_readers(overlap_param_gather, self._bucket_index).items():
                self._gather_waits.append(reader.register_read_wait(self._gathered_before(sorted(indices))))
        self._device = self.buffer.flats[0].device if self.buffer.buckets else torch.device("cpu")
        self.exposed_s = DeviceSeconds()
        """Seconds each step waited for the gradient collectives after its backward ended, on the device."""

    def _bucket_index(self, param: nn.Parameter) -> Optional[int]:
        return self.buffer.bucket_of(param).index if id(param) in self._positions else None

    # Shard parameters ----------------------------------------------------------------------------

    def _make_shard_parameters(self) -> None:
        for bucket in self.buffer.buckets:
            for piece in bucket.shard_slices(self._shard_rank):
                storage = _storage(piece.param)
                if not storage.is_contiguous():
                    raise RuntimeError("data-parallel sharding needs contiguous parameters; a parameter of shape "
                                       f"{tuple(storage.shape)} is not")
                shard = nn.Parameter(storage.view(-1)[piece.start:piece.stop])
                shard.sharded_from = piece.param  # type: ignore[attr-defined]
                shard.shard_start = piece.start  # type: ignore[attr-defined]
                self._shards_of[bucket.index].append((piece, shard))

    @property
    def _shards(self) -> list[tuple[Bucket, ShardSlice, nn.Parameter]]:
        return [(bucket, piece, shard) for bucket in self.buffer.buckets
                for piece, shard in self._shards_of[bucket.index]]

    @property
    def shard_parameters(self) -> list[nn.Parameter]:
        """The slices of parameters this rank steps (sharded modes)."""
        return [shard for _, _, shard in self._shards]

    @property
    def shard_group(self) -> Optional[dist.ProcessGroup]:
        """The group the shard parameters partition the replicated parameters over (sharded modes)."""
        return self._shard_group if self.sharded else None

    def attach(self, optimizers: Sequence[torch.optim.Optimizer], precision: Any,
               sharded_gradients: ShardedGradients) -> None:
        """Sharded: each of ``optimizers`` steps this rank's slices, clipping counting them as parts of a whole;
        replicated: optimizers stepping whole matrices (Muon) divide them over the replicas."""
        if not self.sharded:
            return spread_whole_matrix_steps(optimizers, self.buffer.params, self._group)
        check_precision(precision, self.mode)
        for optimizer in optimizers:
            self.shard_optimizer(optimizer)
        sharded_gradients.register(self.shard_parameters, self._shard_group)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Put this rank's shard parameters in ``optimizer``'s groups (a composite's parts') in place of the
        parameters they slice (any state it holds is sliced too), and all-gather the updated parameters after each
        of its steps. An optimizer stepping whole matrices (Muon) first learns where their slices lie."""
        check_shardable_optimizer(optimizer, self.mode)
        assemble = getattr(getattr(optimizer, "optimizer", optimizer), "assemble_pieces", None)
        if callable(assemble):
            assemble(lambda matrices: pieces_in_buckets(self.buffer.buckets, matrices, self._shard_group))
        by_param: dict[int, list[nn.Parameter]] = defaultdict(list)
        for _, piece, shard in self._shards:
            by_param[id(piece.param)].append(shard)
        sharded = {id(param) for param in self.buffer.params}
        for part in composite_parts(optimizer):
            whole_state = part.state
            part.state = defaultdict(dict)
            self._whole_groups[id(part)] = [list(group["params"]) for group in part.param_groups]
            for group in part.param_groups:
                params = []
                for param in group["params"]:
                    if id(param) not in sharded:
                        params.append(param)
                        if param in whole_state:
                            part.state[param] = whole_state[param]
                        continue
                    for shard in by_param.get(id(param), []):
                        params.append(shard)
                        if param in whole_state:
                            part.state[shard] = sliced_state(whole_state[param], shard)
                group["params"] = params
        self._step_hooks.append(optimizer.register_step_post_hook(lambda *_: self.gather_parameters()))

    @contextlib.contextmanager
    def consolidated(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Inside: ``optimizer`` as an unsharded run's (:meth:`unshard`); on exit, whatever state it holds then is
        sliced back to this rank's shards. A collective. For writing and reading checkpoints."""
        if not self.sharded:
            yield
            return
        self.wait_for_parameters()
        self.unshard(optimizer)
        try:
            yield
        finally:
            self.shard_optimizer(optimizer)

    def unshard(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the real parameters back in ``optimizer``'s groups with their whole states, gathered over the shard
        group, and stop gathering parameters after its steps. A collective."""
        shard_of = {id(shard): piece for _, piece, shard in self._shards}
        for part in composite_parts(optimizer):
            whole = self._gather_states(part)
            for group, params in zip(part.param_groups, self._whole_groups.pop(id(part))):
                group["params"] = params  # every parameter, with or without a slice on this rank
            others = {param: state for param, state in part.state.items() if id(param) not in shard_of}
            part.state = defaultdict(dict, {**others, **whole})
        for hook in self._step_hooks:
            hook.remove()
        self._step_hooks = []

    def _gather_states(self, optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, dict[str, Any]]:
        """Every replicated parameter's whole optimizer state, assembled from the shard group's slices."""
        scalars: dict[int, dict[str, Any]] = {}
        element_keys: set[str] = set()
        for _, piece, shard in self._shards:
            for key, value in optimizer.state.get(shard, {}).items():
                if elementwise(value, shard):
                    element_keys.add(key)
                else:
                    scalars.setdefault(self._index(piece.param), {})[key] = value
        everyone: list[Any] = [None] * dist.get_world_size(self._shard_group)
        dist.all_gather_object(everyone, (sorted(element_keys), scalars), group=self._shard_group)
        keys = sorted({key for part_keys, _ in everyone for key in part_keys})
        scalar_state: dict[int, dict[str, Any]] = {}
        for _, part in everyone:
            for index, values in part.items():
                scalar_state.setdefault(index, {}).update(values)
        states: dict[nn.Parameter, dict[str, Any]] = {}
        for bucket in self.buffer.buckets:
            mine = self._shards_of[bucket.index]
            for key in keys:
                part = torch.zeros(bucket.shard_numel, dtype=torch.float32, device=bucket.flat.device)
                for piece, shard in mine:
                    value = optimizer.state.get(shard, {}).get(key)
                    if value is not None:
                        part = part.to(value.dtype)
                        part[piece.offset:piece.offset + value.numel()] = value
                whole = torch.empty(bucket.flat.numel(), dtype=part.dtype, device=part.device)
                dist.all_gather_single(whole, part, group=self._shard_group)
                for param, offset in zip(bucket.params, bucket.offsets):
                    local = _storage(param)
                    entry = whole[offset:offset + local.numel()].view(local.shape).clone()
                    if isinstance(param, DTensor):
                        entry = DTensor.from_local(entry, param.device_mesh, param.placements, run_check=False,
                                                   shape=param.shape, stride=param.stride())
                    states.setdefault(param, {})[key] = entry
            for param in bucket.params:
                if self._index(param) in scalar_state:
                    states.setdefault(param, {}).update(scalar_state[self._index(param)])
        return states

    def _index(self, param: nn.Parameter) -> int:
        """``param``'s position in the buffer, the same on every replica."""
        return self._positions[id(param)]

    def gather_parameters(self) -> None:
        """All-gather every bucket's updated slices into the parameters, and drop the step's gradients.

        No memory of its own: a bucket's shard of averaged gradients (consumed by the step) stages this rank's
        slice, and the bucket itself (its gradients were dropped after the reduction) receives the gather. With
        ZeRO-2 a released bucket is restored for its gather and released again, two at a time."""
        in_flight: list[tuple[Bucket, Any]] = []
        overlapped = bool(self._gather_waits)
        # buckets lie in backward order; overlapped with a forward, the first one it needs goes first
        order = reversed(self.buffer.buckets) if overlapped else self.buffer.buckets
        with torch.no_grad():
            for bucket in order:
                self.buffer.drop_gradients(bucket)
                bucket.restore()
                part = self._shard_grads[bucket.index]
                part.zero_()
                for piece, shard in self._shards_of[bucket.index]:
                    self._check_view(piece, shard)
                    part[piece.offset:piece.offset + shard.numel()] = shard
                work = dist.all_gather_single(bucket.flat, part, group=self._shard_group, async_op=True)
                if overlapped:  # finished by the next forward (or whatever reads the parameters first)
                    self._pending_gathers[bucket.index] = work
                    continue
                in_flight.append((bucket, work))
                if self.mode == "gradients" and len(in_flight) == 2:
                    self._copy_into_parameters(*in_flight.pop(0))
            for gathered in in_flight:
                self._copy_into_parameters(*gathered)

    def _gathered_before(self, indices: list[int]) -> Any:
        """A wait for the gathers of the buckets at ``indices``: a forward pre-hook, or the read wait of a module read
        outside its forward (:class:`~.gather_waits.ReadsOutsideForward`)."""
        def wait(*_: Any) -> None:
            for index in indices:
                self._finish_gather(self.buffer.buckets[index])
        return wait

    def _finish_gather(self, bucket: Bucket) -> None:
        work = self._pending_gathers.pop(bucket.index, None)
        if work is not None:
            with torch.no_grad():
                self._copy_into_parameters(bucket, work)

    def wait_for_parameters(self) -> None:
        """Finish every parameter gather still in flight (before anything outside a forward reads the parameters)."""
        for bucket in self.buffer.buckets:
            self._finish_gather(bucket)

    def _copy_into_parameters(self, bucket: Bucket, work: Any) -> None:
        work.wait()
        for param, offset in zip(bucket.params, bucket.offsets):
            storage = _storage(param)
            storage.view(-1).copy_(bucket.flat[offset:offset + storage.numel()])
        if self.mode == "gradients":
            bucket.release()

    @staticmethod
    def _check_view(piece: ShardSlice, shard: nn.Parameter) -> None:
        storage = _storage(piece.param)
        if shard.data_ptr() != storage.data_ptr() + piece.start * storage.element_size():
            raise RuntimeError(
                "a parameter's storage was replaced after data-parallel sharding began (its optimizer slice no longer "
                "views it); replace parameters before the first batch, or use data_parallel_sharding='none'"
            )

    # Bucket order --------------------------------------------------------------------------------

    @property
    def wants_ready_order(self) -> bool:
        """Whether the first step is still running (on buckets in the guessed order) and would overlap afterwards."""
        return self._overlap and not self.validated and not self.ready_ordered

    def agreed_finish_order(self) -> list[nn.Parameter]:
        """The order the first data-parallel rank's last backward finished the gradients in, on every replica (their
        buckets must match, and a rank whose batch skips a parameter finishes it at another time). A collective."""
        params = self.buffer.params
        mine = [[self._positions[id(param)] for param in self.buffer.finish_order()]]
        dist.broadcast_object_list(mine, src=dist.get_global_rank(self._group, 0), group=self._group)
        return [params[position] for position in mine[0]]

    def take_gradients(self, previous: DataParallelGradients) -> None:
        """Move ``previous``'s gradients into these buckets one at a time, freeing each of its buckets once all of its
        gradients have moved, so that the two layouts never hold every gradient twice."""
        moving = {id(param) for param in self.buffer.params}
        left = {bucket.index: len(bucket.params) for bucket in previous.buffer.buckets
                if all(id(param) in moving for param in bucket.params)}  # one kept by a callback stays
        for bucket in self.buffer.buckets:
            self.buffer.gather_bucket(bucket)
            for param in bucket.params:
                if id(param) in previous._positions:
                    old = previous.buffer.bucket_of(param)
                    if old.index in left:
                        left[old.index] -= 1
                        if left[old.index] == 0:
                            old.release()

    # Reduction -----------------------------------------------------------------------------------

    def arm(self, backwards: int) -> frozenset[int]:
        """A step of ``backwards`` backward passes begins: start each bucket's collective once they finish it
        (only once a step has confirmed the averaged parameters: callbacks may change them on the first step).

        Returns the parameters (by id) whose summed gradients :meth:`finish` will also divide by ``backwards``:
        collectives may be running on them when the backward ends, so the caller must not scale them."""
        self._micro_batches = 1
        self._ready, self._next_launch = set(), 0
        if not (self._overlap and self.validated):
            return frozenset()
        self.buffer.arm(backwards)
        self._micro_batches = backwards
        return frozenset(self._positions)

    def _launch_early(self, bucket: Bucket) -> None:
        """Start the collectives of the ready buckets in bucket order, the same on every rank: gloo and NCCL
        pair a group's collectives by order, and readiness order differs between ranks (an MoE expert with no
        tokens on one rank, a parameter unused by one rank's batch)."""
        self._ready.add(bucket.index)
        while self._next_launch in self._ready:
            self.early_launches += 1
            self._launch(self.buffer.buckets[self._next_launch])
            self._next_launch += 1
        if self._scatters is not None:
            self._scatters.poll()

    def _launch(self, bucket: Bucket) -> None:
        if self._scatters is not None:
            self._scatters.submit(bucket.index, self._shard_grads[bucket.index], bucket.flat)
        else:
            self._works[bucket.index] = (dist.all_reduce(bucket.flat, group=self._group, async_op=True)
                                         if self._communicate else Done())

    def _launched(self, bucket: Bucket) -> bool:
        return bucket.index in (self._scatters if self._scatters is not None else self._works)

    def _reduced(self, index: int) -> None:
        """A bucket's reduce-scatter is done (its exchange's receive buffer summed and freed): ZeRO-2 frees the
        bucket's full gradients, so that they do not outlive the reduction."""
        bucket = self.buffer.buckets[index]
        if self.mode == "gradients" and not bucket.released:
            self.buffer.drop_gradients(bucket)
            bucket.release()

    def finish(self) -> None:
        """After the backward (and any tensor-parallel or pipeline sums): reduce the buckets not yet started,
        wait for all, and average over the replicas (and the backward passes :meth:`arm` took over)."""
        divide_by = self._data_parallel * self._micro_batches
        self._micro_batches = 1
        self.validated = True
        start = DeviceStamp(self._device)
        for bucket in self.buffer.buckets:
            if not self._launched(bucket):
                self.buffer.gather_bucket(bucket)
                self._launch(bucket)
        if self._scatters is not None:
            self._scatters.drain()
        for index in sorted(self._works):
            self._works[index].wait()
        self._works = {}
        self.buffer.disarm()
        if not self.sharded:
            for flat in self.buffer.flats:
                flat /= divide_by
            self.exposed_s.append(start, DeviceStamp(self._device))
            return
        for part in self._shard_grads:
            if self._replicate_group is not None and self._communicate:
                dist.all_reduce(part, group=self._replicate_group)
            part /= divide_by
        for bucket in self.buffer.buckets:  # the averaged gradients are the shards'; the buckets hold local sums
            self.buffer.drop_gradients(bucket)
            if self.mode == "gradients" and not bucket.released:
                bucket.release()
        for bucket, piece, shard in self._shards:
            shard.grad = self._shard_grads[bucket.index][piece.offset:piece.offset + shard.numel()]
        self.exposed_s.append(start, DeviceStamp(self._device))

    def stats(self) -> dict[str, float]:
        """Seconds each step waited for the gradient collectives after its backward (mean over the steps after the
        first, which runs without overlap while it confirms the averaged parameters), steps, bytes reduced per
        step, and buckets started during a backward."""
        waits = self.exposed_s[1:] or self.exposed_s
        return {
            "exposed_s_mean": sum(waits) / len(waits) if waits else 0.0,
            "steps": float(len(self.exposed_s)),
            "bytes_per_step": float(sum(flat.numel() * flat.element_size() for flat in self.buffer.flats)),
            "early_launches": float(self.early_launches),
        }

    def close(self) -> None:
        """Stop adopting gradients and gathering before forwards, once every gather in flight is done (and drop the
        shards of averaged gradients: a replacement allocates its own)."""
        self.wait_for_parameters()
        self.buffer.remove()
        self._shard_grads = []
        for hook in self._gather_waits:
            hook.remove()
        self._gather_waits = []

    def holds(self, params: Sequence[nn.Parameter]) -> bool:
        """Whether the buckets hold exactly the gradients of ``params``."""
        return {id(param) for param in params} == set(self._positions)


def data_parallel_gradients(module: nn.Module, built: Any, groups: LayoutGroups, arguments: Any,
                            ready_order: Optional[Sequence[nn.Parameter]] = None) -> Optional[DataParallelGradients]:
    """The bucketed reduction (and ZeRO sharding) of ``module``'s replicated gradients, for a layout with more
    than one replica that does not shard fully (FSDP2 reduces its own)."""
    layout = groups.layout
    if layout.data_parallel == 1 or layout.data_parallel_sharding == "full":
        return None
    params = averaged_parameters(module)
    inside = {id(param) for param in built.stages.parameters()} if built.stages is not None else None
    outside = [param for param in params if inside is not None and id(param) not in inside]  # summed over the stages
    late = [*built.tensor_partial, *(param for _, param, _ in built.tied), *outside]
    shards = layout.data_parallel_shard_size or layout.data_parallel
    return DataParallelGradients(params, late, groups=groups, mode=layout.data_parallel_sharding, shards=shards,
                                 overlap=arguments.overlap_grad_reduce,
                                 bucket_bytes=bucket_bytes(arguments.grad_bucket_mb, params),
                                 overlap_param_gather=module if gathers_overlapped(arguments, layout) else None,
                                 ready_order=ready_order)


def gathers_overlapped(arguments: Any, layout: Any) -> bool:
    """ZeRO-1 gathers during the next forward (hidden as DDP hides its all-reduce) unless told not to."""
    return layout.data_parallel_sharding == "optimizer" and arguments.overlap_param_gather is not False


DEFAULT_BUCKET_MB = 25.0
"""The largest default bucket (DDP's): bigger buckets pay less per-collective latency, smaller ones start sooner."""
MIN_DEFAULT_BUCKETS = 8
MIN_DEFAULT_BUCKET_MB = 1.0


def bucket_bytes(bucket_mb: Optional[float], params: Sequence[nn.Parameter]) -> int:
    """``bucket_mb`` in bytes; by default 25 MB, or an eighth of ``params``' gradients when that is smaller (at least
    1 MB): one bucket holding a small model's every gradient could start only when the backward ends."""
    if bucket_mb is not None:
        return int(bucket_mb * 2**20)
    total = sum(local_tensor(param).nbytes for param in params if param.requires_grad)
    return int(min(DEFAULT_BUCKET_MB * 2**20, max(MIN_DEFAULT_BUCKET_MB * 2**20, total / MIN_DEFAULT_BUCKETS)))


def refreshed(current: DataParallelGradients, module: nn.Module, built: Any, groups: LayoutGroups, arguments: Any,
              optimizers: Sequence[torch.optim.Optimizer]) -> DataParallelGradients:
    """After a backward: ``current`` if it holds the gradients of exactly ``module``'s averaged parameters in
    buckets of the order they are finished in, else a new reduction for them (holding the step's gradients), the
    optimizers unsharded (the caller shards them again). Both change only before the first step completes: a
    callback names the parameters it reduces itself in its first ``on_after_backward``, and the first backward
    shows the order its gradients are finished in (:attr:`DataParallelGradients.wants_ready_order`)."""
    params = averaged_parameters(module)
    if current.holds(params) and not current.wants_ready_order:
        return current
    if current.validated:
        raise RuntimeError(
            "the parameters averaged over data-parallel ranks changed after the first step (a callback added to "
            "_ddp_params_and_buffers_to_ignore); name them before or during the first backward"
        )
    order = current.agreed_finish_order() if current.wants_ready_order else None
    current.close()
    for optimizer in optimizers:
        if current.sharded:
            current.unshard(optimizer)
    rebuilt = data_parallel_gradients(module, built, groups, arguments, ready_order=order)
    assert rebuilt is not None
    rebuilt.take_gradients(current)
    return rebuilt
