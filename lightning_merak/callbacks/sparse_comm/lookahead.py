"""The next batch, read one step ahead from Lightning's batch iterator: EmbRace's ``priority`` sends the rows
it looks up first."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch

_NOTHING = object()
_EXHAUSTED = object()


class Lookahead(Iterator[Any]):
    """An iterator whose next item can be read before its turn; it yields exactly the items,
    in the order, of the iterator it wraps."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator
        self._peeked: Any = _NOTHING

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        if self._peeked is _NOTHING:
            return next(self._iterator)
        item, self._peeked = self._peeked, _NOTHING
        if item is _EXHAUSTED:
            raise StopIteration
        return item

    def peek(self) -> Any | None:
        """The next item without consuming it; ``None`` when the iterator is exhausted."""
        if self._peeked is _NOTHING:
            try:
                self._peeked = next(self._iterator)
            except StopIteration:
                self._peeked = _EXHAUSTED
        return None if self._peeked is _EXHAUSTED else self._peeked


def next_batch_ids(trainer: pl.Trainer, pl_module: pl.LightningModule,
                   priority_ids: Callable[[Any], torch.Tensor] | None) -> torch.Tensor | None:
    """The ids of the batch after this one (``priority_ids`` of it, else ``pl_module.split_batch(batch)[0]``), or
    ``None`` at the end of the epoch; wraps the fit loop's batch iterator in a :class:`Lookahead` once."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if getattr(fetcher, "iterator", None) is None:
        raise RuntimeError(
            "priority=True reads the next batch from the iterator of Lightning's data fetcher "
            "(trainer.fit_loop._data_fetcher.iterator), which this Lightning version lacks; set priority=False"
        )
    if not isinstance(fetcher.iterator, Lookahead):
        fetcher.iterator = Lookahead(fetcher.iterator)
    upcoming = fetcher.iterator.peek()
    if upcoming is None:
        return None
    next_batch = upcoming[0]  # the iterator yields (batch, batch_idx, dataloader_idx)
    ids = priority_ids(next_batch) if priority_ids is not None else pl_module.split_batch(next_batch)[0]
    return ids.to(pl_module.device)
