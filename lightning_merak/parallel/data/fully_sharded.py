"""``data_parallel_sharding="full"``: FSDP2's ``fully_shard`` on the data-parallel dimension of a built layout.

The build has already cut this rank's stages and split its blocks over the tensor-parallel ranks
(DTensors on the mesh's ``tp`` dimension); :func:`apply_fully_shard` then shards every parameter
over the data-parallel ranks as torchtitan composes FSDP2 with tensor and pipeline parallelism:
each transformer block first, then each stage root, on ``mesh["dp"]`` (a tensor-parallel shard
becomes a 2-D ``(dp, tp)`` DTensor). Hybrid sharding unflattens ``dp`` into
``(dp_replicate, dp_shard)``: shard inside groups, replicate across them. FSDP2 reduce-scatters
(and, hybrid, all-reduces) the gradients as the backward finishes each block, so the strategy
must not average them over the data-parallel ranks again. Pipeline stages need nothing more:
torch's ``PipelineStage`` keeps gradients unreduced until a stage's last micro-batch and then
reduces them (``backward_maybe_with_nosync`` / ``perform_reduce_grad``).

Frozen weights FSDP2 cannot shard (a bitsandbytes int8 base, whose layer keeps a second reference to
its codes) are left whole on every rank (``replicated``); the adapters on them are sharded.

Mixed precision is left to Lightning's precision plugin: the sharded parameters keep their dtype
(fp32 master weights under ``*-mixed``), autocast casts the gathered ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Optional, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["FullySharded", "apply_fully_shard", "data_parallel_mesh"]


def data_parallel_mesh(mesh: DeviceMesh, shard_size: Optional[int] = None) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``mesh["dp"]``, or with ``shard_size`` below dp the 2-D
    ``(dp_replicate, dp_shard)`` mesh of hybrid sharding (a collective: every rank calls it).

    Both stay slices of ``mesh``, which FSDP2 requires to join them with the tensor-parallel dimension.
    """
    data_parallel = mesh["dp"].size()
    if shard_size is None or shard_size == data_parallel:
        return mesh["dp"]
    if data_parallel % shard_size:
        raise ValueError(f"data_parallel_shard_size={shard_size} does not divide data_parallel={data_parallel}")
    # torchtitan's ParallelDims unflattens its dp dimension the same way (a private API of DeviceMesh)
    hybrid = mesh._unflatten("dp", (data_parallel // shard_size, shard_size), ("dp_replicate", "dp_shard"))
    return hybrid["dp_replicate", "dp_shard"]


@dataclass(frozen=True)
class FullySharded:
    """What :func:`apply_fully_shard` made: the FSDP modules (stage roots last) and, by ``id`` of each
    parameter it replaced, the sharded parameter now registered in its place."""

    modules: list[FSDPModule]
    replaced: dict[int, nn.Parameter]

    def sharded(self, param: nn.Parameter) -> nn.Parameter:
        """The sharded parameter that replaced ``param`` (``param`` itself if FSDP2 left it)."""
        return self.replaced.get(id(param), param)


def apply_fully_shard(roots: Sequence[nn.Module], blocks: Sequence[Sequence[nn.Module]], mesh: DeviceMesh, *,
                      pipelined: bool, replicated: Collection[nn.Parameter] = (),
                      reduced_elsewhere: Collection[nn.Parameter] = ()) -> FullySharded:
    """Shard ``blocks[k]`` (stage ``k``'s transformer blocks, in execution order), then ``roots[k]``, over ``mesh``.

    ``pipelined``: keep gathered parameters from forward to backward (torchtitan's choice with
    pipeline parallelism: every micro-batch would gather them again otherwise). Without it the
    blocks free theirs after forward; FSDP2 keeps the root's. Each block prefetches the next
    block's parameters in forward and the previous one's in backward.

    ``replicated``: frozen parameters FSDP2 leaves whole on every rank (``ignored_params``), which it cannot
    shard. Frozen, they need no gradient reduction; every rank holds the same copy, as it quantised the same
    weights. ``reduced_elsewhere``: trainable parameters FSDP2 leaves alone too, whose gradients their owner sets
    and averages over the data-parallel ranks itself (the vocabulary rows split over the pipeline stages).
    """
    if len(roots) != len(blocks):
        raise ValueError(f"{len(roots)} stage roots but {len(blocks)} lists of blocks")
    before = {id(root): dict(root.named_parameters(remove_duplicate=False)) for root in roots}
    modules: list[FSDPModule] = []
    if any(param.requires_grad for param in replicated):
        raise ValueError("only frozen parameters can stay replicated under data_parallel_sharding='full'")
    ignored = {*replicated, *reduced_elsewhere} or None
    for root, stage_blocks in zip(roots, blocks):
        sharded = [fully_shard(block, mesh=mesh, reshard_after_forward=not pipelined,
                               ignored_params=ignored) for block in stage_blocks]
        for previous, following in zip(sharded, sharded[1:]):
            previous.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([previous])
        modules.extend(sharded)
        # the root last: it owns what the blocks left (embeddings, final norm, head) and starts each step
        modules.append(fully_shard(root, mesh=mesh, reshard_after_forward=False if pipelined else None,
                                   ignored_params=ignored))
        # a forward without gradients (validation, predict) leaves the root's gathered parameters registered
        # until the next backward: reshard them, so what reads the module in between sees the sharded ones
        root.register_forward_hook(_ReshardWithoutGradients(modules[-len(sharded) - 1:]))
    replaced = {}
    for root in roots:
        after = dict(root.named_parameters(remove_duplicate=False))
        for name, old in before[id(root)].items():
            if after[name] is not old:
                replaced[id(old)] = after[name]
    return FullySharded(modules, replaced)


class _ReshardWithoutGradients:
    """Forward hook: reshard ``modules`` after a forward that recorded no graph (no backward will)."""

    def __init__(self, modules: list[FSDPModule]) -> None:
        self.modules = modules

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            for sharded in self.modules:
                sharded.reshard()
