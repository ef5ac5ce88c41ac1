"""Which rows of a table split over ranks each rank holds: the vocabulary split over tensor-parallel ranks
(:mod:`lightning_merak.parallel.tensor.vocab`) and over pipeline ranks
(:mod:`lightning_merak.parallel.pipeline.vocab_stages`) cut it alike."""

from __future__ import annotations

import math

__all__ = ["padded_rows", "row_shard_range"]


def padded_rows(rows: int, parts: int) -> int:
    """``rows`` rounded up to a multiple of ``parts``: the width of the gathered shards before cutting."""
    return math.ceil(rows / parts) * parts


def row_shard_range(rows: int, parts: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of the rows rank ``rank`` of ``parts`` holds (``torch.chunk``'s, DTensor's ``Shard(0)``)."""
    width = padded_rows(rows, parts) // parts
    start = min(rank * width, rows)
    return start, min(start + width, rows)
