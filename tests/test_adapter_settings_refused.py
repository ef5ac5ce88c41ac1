"""Adapter sizes refused before any model is touched (PEFT refuses ``r=0`` in its own words and takes a negative
``alpha``, which flips the update's sign, without a word), and a rank above a targeted layer's smaller side warned."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_merak.cli.options.adapter import LoRAAdapterConfig, Quantization


@pytest.mark.parametrize(("settings", "message"), [
    ({"r": 0}, r"adapter.r=0 must be an integer >= 1"),
    ({"alpha": -16.0}, r"adapter.alpha=-16.0 must be a finite number > 0"),
    ({"alpha": float("nan")}, r"adapter.alpha=nan must be a finite number > 0"),
    ({"dropout": 1.0}, r"adapter.dropout=1.0 must be in \[0, 1\)"),
    ({"r": 0, "alpha": 0.0}, r"adapter.r=0 .*; adapter.alpha=0.0"),
])
def test_a_bad_adapter_size_is_refused_naming_the_key(settings: dict, message: str):
    with pytest.raises(ValueError, match=message):
        LoRAAdapterConfig(quantization=Quantization.none, **settings).check_settings()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 32)
        self.k_proj = nn.Linear(32, 8)


@pytest.mark.filterwarnings("error::UserWarning")
def test_a_rank_above_a_targeted_layer_s_smaller_side_is_warned():
    with pytest.warns(UserWarning, match=r"adapter.r=16 exceeds k_proj's smaller side \(8\).*adapter.r=8 or lower"):
        LoRAAdapterConfig(r=16, quantization=Quantization.none, target_modules=["q_proj", "k_proj"]).check_targets(
            _Block())
    LoRAAdapterConfig(r=8, quantization=Quantization.none, target_modules=["q_proj", "k_proj"]).check_targets(_Block())
