"""The per-rank model state that the layout leg of ``python -m benchmarks.adapters`` compares."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks._adapters_layouts import state_bytes


def test_a_ranks_state_counts_weights_statistics_gradients_and_adam_once():
    """Weights, gradients and Adam's two moments (and step counts) of a trained float layer; a 4-bit base's packed
    codes with their absmax and code map, as its state dict holds them; a tied weight once."""
    from lightning_merak.adapters import quantize_model

    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.Linear(32, 64, bias=False))
    model[1].weight = nn.Parameter(model[0].weight.t().contiguous())
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    weights = 2 * 64 * 32 * 4
    steps = sum(state["step"].numel() * state["step"].element_size() for state in optimizer.state.values())
    assert state_bytes(model, [optimizer]) == 4 * weights + steps  # weights, gradients, exp_avg, exp_avg_sq
    tied = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    tied[1].weight = tied[0].weight
    assert state_bytes(tied, []) == 64 * 64 * 4
    quantised = quantize_model(nn.Sequential(nn.Linear(128, 64, bias=False)), "nf4", double_quant=False, skip=())
    # codes at 4 bits, one float32 absmax per 64 weights, the 16-entry code map and the serialised quant state
    codes_and_statistics = 128 * 64 // 2 + 128 * 64 // 64 * 4 + 16 * 4
    assert codes_and_statistics < state_bytes(quantised, []) < codes_and_statistics + 512
