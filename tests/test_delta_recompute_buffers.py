"""DeltaMemory's recomputation replays a block in training mode; the block's buffers (BatchNorm's running
statistics and batch counter) must end each step as plain training leaves them: every batch counted once, with
swapped blocks beside and gradients accumulated over several micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_merak.callbacks.delta.blocks import discover_blocks
from lightning_merak.callbacks.delta.budget import parse_budget
from lightning_merak.callbacks.delta.memory_planner import Action
from lightning_merak.callbacks.delta.runtime import ManagerOptions, MemoryManager
from lightning_merak.testing.delta_models import SmallResNet

RECOMPUTE_ALL = {f"stages.{stage}.{block}": Action.RECOMPUTE for stage in range(3) for block in range(2)}
RECOMPUTE_AND_SWAP = {**RECOMPUTE_ALL, "stages.0.1": Action.SWAP, "stages.2.0": Action.SWAP}


@pytest.mark.parametrize(("overrides", "micro_batches"), [(RECOMPUTE_ALL, 1), (RECOMPUTE_AND_SWAP, 2)],
                         ids=["recompute", "recompute_swap_accumulated"])
def test_recomputed_blocks_count_every_batch_once_in_their_running_statistics(overrides, micro_batches) -> None:
    torch.manual_seed(0)
    model = SmallResNet(width=8, dropout=0.3)
    reference = copy.deepcopy(model)
    model.train(), reference.train()
    options = ManagerOptions(budget=parse_budget(10**9), swap_tier="host", warmup_steps=1, overrides=overrides)
    manager = MemoryManager(discover_blocks(model), options, log=lambda message: None)
    manager.start(model, torch.device("cpu"))
    images = torch.randn(3, micro_batches, 4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    for step, batches in enumerate(images):
        manager.begin_step("images", batches[0].numel())
        for index, batch in enumerate(batches):
            torch.manual_seed(10 * step + index)
            model(batch).square().mean().backward()
            torch.manual_seed(10 * step + index)
            reference(batch).square().mean().backward()
        manager.end_forward()
        manager.end_backward()
        for (name, buffer), expected in zip(model.named_buffers(), reference.buffers()):
            assert torch.equal(buffer, expected), f"step {step}: {name} differs from plain training"
        for param, expected in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, expected.grad, rtol=1e-6, atol=1e-7)
            param.grad = expected.grad = None
    assert manager.plan.actions == overrides
    manager.close()
