"""The rows of a vocabulary table split over ranks, as the split vocabulary layers (:mod:`.vocab_stages`,
:mod:`.embedding_stages`) hold them: handed out at build, kept as DTensors, given their gradients.

They start from the whole table on the stage that built it (the last for the head, the first for the embedding).
A broadcast would make every rank allocate the whole table for a moment, the memory the split is there to save, so
the holder scatters (:func:`scatter_rows`): each rank receives ``⌈V/pp⌉`` rows (the last rank's share padded), its
own. Each rank keeps them as a DTensor with the table's whole shape (:func:`rows_dtensor`), so a sharded checkpoint
holds the unsplit table under its own name, and sets their gradients by hand after the schedule
(:func:`add_rows_gradient`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_merak.util.row_shards import padded_rows, row_shard_range

__all__ = ["add_rows_gradient", "rows_dtensor", "scatter_rows"]


def scatter_rows(table: Optional[Tensor], rows: int, trailing: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, group: dist.ProcessGroup, source: int) -> Tensor:
    """This rank's rows ``row_shard_range(rows, size, rank)`` of ``table`` ``[rows, *trailing]``, which group rank
    ``source`` holds (``table`` is read there only); every rank of ``group`` calls it."""
    parts, rank = dist.get_world_size(group), dist.get_rank(group)
    width = padded_rows(rows, parts) // parts
    received = torch.empty((width, *trailing), dtype=dtype, device=device)
    chunks = None
    if rank == source:
        assert table is not None, "the source rank holds the table"
        chunks = []
        for part in range(parts):
            start, end = row_shard_range(rows, parts, part)
            chunk = table[start:end].to(device=device, dtype=dtype)
            if end - start < width:  # the last ranks' shares: fewer rows (or none)
                chunk = torch.cat([chunk, chunk.new_zeros((width - (end - start), *trailing))])
            chunks.append(chunk.contiguous())
    dist.scatter(received, chunks, src=dist.get_global_rank(group, source), group=group)
    start, end = row_shard_range(rows, parts, rank)
    return received[:end - start]


def rows_dtensor(local: Tensor, rows: int, mesh: DeviceMesh) -> DTensor:
    """A copy of this rank's ``local`` rows as a DTensor sharded ``Shard(0)`` over ``mesh``, with the whole table's
    ``rows``."""
    shape = torch.Size((rows, *local.shape[1:]))
    stride = (local.shape[1], 1) if local.ndim == 2 else (1,)
    return DTensor.from_local(local.detach().clone().contiguous(), mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=stride)


def add_rows_gradient(param: nn.Parameter, grad: Tensor) -> None:
    """Add this rank's rows' gradient ``grad`` to the DTensor ``param``'s (set it where there is none)."""
    if param.grad is None:
        param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
    else:
        param.grad.to_local().add_(grad)
