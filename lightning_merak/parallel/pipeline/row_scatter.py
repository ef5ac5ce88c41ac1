"""Hand each pipeline rank its rows of a vocabulary table held whole on one rank, at build.

The split vocabulary layers (:mod:`.vocab_stages`, :mod:`.embedding_stages`) start from the whole table on the
stage that built it (the last for the head, the first for the embedding). A broadcast would make every rank
allocate the whole table for a moment, the memory the split is there to save, so the holder scatters: each rank
receives ``⌈V/pp⌉`` rows (the last rank's share padded), its own.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_merak.util.row_shards import padded_rows, row_shard_range

__all__ = ["scatter_rows"]


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
