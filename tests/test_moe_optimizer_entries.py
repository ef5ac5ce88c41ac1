"""Expert optimizer state found by parameter position in both saved formats: torch's, and the parts a composite
optimizer (``MuonWithAdamW``) saves — checkpoints of expert parallelism with Muon crashed on ``saved["state"]``."""

from __future__ import annotations

import torch

from lightning_merak.modules.muon import MuonWithAdamW
from lightning_merak.plugins.moe.checkpoint import slice_entries
from lightning_merak.util.optimizer_state import entry_slots


def _stepped(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> dict:
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer.state_dict()


def test_entries_are_found_by_position_in_torchs_format_and_in_parts() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4)),
              torch.nn.Parameter(torch.randn(2, 4, 4))]
    adamw = torch.optim.AdamW(params, lr=0.1)
    muon = MuonWithAdamW([{"params": params}], lr=0.1, momentum=0.9, newton_schulz_dtype="float32")
    for optimizer in (adamw, muon):
        saved = _stepped(optimizer, params)
        order = [param for group in optimizer.param_groups for param in group["params"]]
        slots = entry_slots(saved)
        assert sorted(slots) == list(range(len(params)))
        for position, (entries, key) in slots.items():  # each position's entry is its parameter's state
            shapes = {tuple(value.shape) for value in entries[key].values() if value.ndim}
            assert shapes == {tuple(order[position].shape)}
        names = [f"p{index}" for index in range(len(order))]
        position = next(index for index, param in enumerate(order) if param is params[2])
        expert = names[position]
        slice_entries(saved, names, lambda name, value: value[:1] if name == expert and value.ndim == 3 else value)
        entries, key = slots[position]
        assert {tuple(value.shape) for value in entries[key].values() if value.ndim} == {(1, 4, 4)}


def test_a_composite_optimizers_state_goes_through_the_expert_checkpoint_hooks() -> None:
    """Saving and loading a checkpoint of a Muon run through the expert slices (every expert whole on save, this
    rank's on load): they read torch's ``state`` and failed on the parts."""
    from lightning_merak.plugins.moe.checkpoint import FusedExpertSlices

    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    muon = MuonWithAdamW([{"params": list(module.parameters())}], lr=0.1, momentum=0.9, newton_schulz_dtype="float32")
    saved = _stepped(muon, list(module.parameters()))
    checkpoint = {"state_dict": module.state_dict(), "optimizer_states": [saved]}
    slices = FusedExpertSlices({})
    slices.whole_checkpoint(checkpoint, module, [muon])
    slices.local_checkpoint(checkpoint, module)
    muon.load_state_dict(checkpoint["optimizer_states"][0])
