"""DeltaMemory refuses a module FSDP2's ``fully_shard`` wrapped (Lightning's ``ModelParallelStrategy`` shards in
``configure_model``, after the callback's setup): it resizes storage FSDP2's parameters own, which failed inside FSDP2
at the first managed step with no word of DeltaMemory."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_merak.callbacks import DeltaMemory
from lightning_merak.callbacks.delta.callback import _refuse_fully_sharded


class _Module(pl.LightningModule):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block, nn.Linear(4, 4)])


def test_a_fully_sharded_block_is_refused_naming_the_reason_and_the_fixes():
    block = nn.Linear(4, 4)
    block.__class__ = type("FSDPLinear", (FSDPModule, nn.Linear), {})  # the class swap fully_shard makes
    with pytest.raises(ValueError, match=r"DeltaMemory cannot manage a module FSDP2 shards \(blocks.0 and 0 more.*"
                                         r"resizes storage that FSDP2's parameters own.*DDPStrategy"):
        _refuse_fully_sharded(_Module(block), DeltaMemory.fully_sharded_refusal)
    _refuse_fully_sharded(_Module(nn.Linear(4, 4)), DeltaMemory.fully_sharded_refusal)
