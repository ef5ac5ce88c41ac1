"""What a callback or plugin may ask a parallel strategy about its layout, without importing it.

:class:`LayoutAwareStrategy` is the protocol merak3d implements; callbacks (SparseCommunication,
DeltaMemory) and the MoE plugin ask :func:`layout_aware` for it and fall back to plain
data parallelism when a strategy does not implement it. Recomputed blocks carry a
:class:`RecomputedForward` on the instance, so they are recognised by type, not by who made them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional, Protocol

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from lightning_merak.distributed.collectives import collective_replay_contexts
from lightning_merak.util.buffers import KeptBuffers

__all__ = ["LayoutAwareStrategy", "RecomputedForward", "data_parallel_groups_from_mesh", "layout_aware"]


class LayoutAwareStrategy(Protocol):
    """A data × pipeline × tensor parallel strategy, as callbacks and plugins see it.

    The groups and degrees exist once processes have started (``setup_environment``), the
    blocks once the first batch built the layout (``layout_built``).
    """

    @property
    def data_parallel(self) -> int:
        """Replicas of the model."""

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """The ranks gradients are averaged over; callbacks communicate over it too."""

    @property
    def tensor_parallel(self) -> int:
        """Ranks each block is split over."""

    @property
    def tensor_parallel_group(self) -> dist.ProcessGroup:
        """The ranks this rank's blocks are split over."""

    @property
    def pipeline_parallel(self) -> int:
        """Pipeline stages (each rank holds its stages' blocks only)."""

    @property
    def pipeline_rank(self) -> int:
        """This rank's place in the pipeline."""

    @property
    def device_mesh(self) -> DeviceMesh:
        """Every rank's place; one dimension is named ``"dp"`` (:func:`data_parallel_groups_from_mesh`)."""

    @property
    def recompute(self) -> str:
        """How the strategy recomputes blocks (``"none"`` when it does not); such blocks hold a
        :class:`RecomputedForward`."""

    @property
    def layout_built(self) -> bool:
        """Whether the first batch has cut and split the model."""

    @property
    def local_blocks(self) -> dict[int, nn.Module]:
        """This rank's transformer blocks by trunk index, once the layout is built."""

    def register_sharded_gradients(self, params: Iterable[nn.Parameter], group: Optional[dist.ProcessGroup]) -> None:
        """Have the strategy's clipping count ``params``' gradients as parts of one whole split over ``group``
        (each rank of it holds different columns or rows), rather than as replicas."""


_MEMBERS = ("data_parallel", "data_parallel_group", "tensor_parallel", "tensor_parallel_group", "pipeline_parallel",
            "pipeline_rank", "device_mesh", "recompute", "layout_built", "local_blocks", "register_sharded_gradients")


def layout_aware(strategy: Any) -> Optional[LayoutAwareStrategy]:
    """``strategy`` when it implements :class:`LayoutAwareStrategy`, else ``None``.

    Checked on its type: the groups are properties that raise before processes start, which an
    ``isinstance`` against a runtime-checkable protocol would call.
    """
    return strategy if all(hasattr(type(strategy), member) for member in _MEMBERS) else None


def data_parallel_groups_from_mesh(mesh_ranks: Sequence[Any], dim_names: Sequence[str]) -> list[list[int]]:
    """Every data-parallel group of a device mesh (nested lists of global ranks, one axis named ``"dp"``),
    in the same order on every rank, so each can create them all with ``new_group``."""
    if "dp" not in dim_names:
        raise ValueError(f"mesh dimensions {tuple(dim_names)} have no 'dp' dimension to take data-parallel groups from")
    axis = list(dim_names).index("dp")
    shape: list[int] = []
    level: Any = mesh_ranks
    for _ in dim_names:
        shape.append(len(level))
        level = level[0]
    groups = []
    for index in itertools.product(*(range(n) if i != axis else [0] for i, n in enumerate(shape))):
        group = []
        for position in range(shape[axis]):
            entry: Any = mesh_ranks
            for i, coordinate in enumerate(index):
                entry = entry[position if i == axis else coordinate]
            group.append(int(entry))
        groups.append(group)
    return groups


class RecomputedForward:
    """A block's forward run under non-reentrant checkpointing, its collectives replayed on recomputation and the
    block's buffers left as its forward left them (a BatchNorm's running statistics count each batch once).

    A strategy installs it on the block instance (``block.forward = RecomputedForward(block.forward)``);
    callbacks that recompute blocks themselves recognise it by type and leave the block alone.
    """

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.forward, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=self._contexts, **kwargs)

    def _contexts(self) -> tuple[Any, Any]:
        forward, recompute = collective_replay_contexts()
        block = getattr(self.forward, "__self__", None)  # the module of a bound forward
        return forward, KeptBuffers(block, recompute) if isinstance(block, nn.Module) else recompute
