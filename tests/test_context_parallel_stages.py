"""A pipeline stage's context-parallel forward (``ContextStageForward``): the document ids packed rows send between
stages, and the single-column marker for rows that are each one sequence, told apart by shape alone."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import Tensor, nn

from lightning_merak.parallel.context.model import ContextShard, ContextState
from lightning_merak.parallel.context.stages import ContextStageForward

BATCH, LENGTH, WIDTH = 2, 8, 4



class _Stage(nn.Module):
    """A stage whose model call, when it is the first, sets the shard as the context-parallel model does."""

    def __init__(self, state: ContextState, *, is_first: bool, is_last: bool = False,
                 documents: Optional[Tensor] = None) -> None:
        super().__init__()
        self.is_first, self.is_last, self._state, self._documents = is_first, is_last, state, documents
        self.seen: Optional[ContextShard] = None

    def forward(self, hidden: Tensor) -> tuple[Tensor]:
        if self.is_first:
            self._state.shard = ContextShard(torch.arange(LENGTH), self._documents)
        self.seen = self._state.shard
        return (hidden + 1,)


def _forward(stage: _Stage, state: ContextState) -> ContextStageForward:
    return ContextStageForward(stage, state, carries_documents=True)


@pytest.mark.parametrize("documents", [None, torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]] * BATCH)],
                         ids=["one-sequence-rows", "packed-rows"])
def test_document_ids_travel_to_the_next_stage(single_rank_group, documents: Optional[Tensor]) -> None:
    first_state, next_state = ContextState(single_rank_group, "ring"), ContextState(single_rank_group, "ring")
    first = _Stage(first_state, is_first=True, documents=documents)
    hidden, sent = _forward(first, first_state)(torch.zeros(BATCH, LENGTH, WIDTH))
    # rows that are each one sequence send one column: the next stage reads that from the shape, not the values
    assert sent.shape == ((BATCH, 1) if documents is None else (BATCH, LENGTH))
    following = _Stage(next_state, is_first=False, is_last=True)
    (output,) = _forward(following, next_state)(hidden, sent)
    assert following.seen is not None
    if documents is None:
        assert following.seen.document_ids is None
    else:
        torch.testing.assert_close(following.seen.document_ids, documents)
    torch.testing.assert_close(output, torch.full((BATCH, LENGTH, WIDTH), 2.0))
