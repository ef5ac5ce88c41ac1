"""The built-in module's and Muon's inputs: CausalLMModule reads the batch forms transformers' collators give and
refuses others naming the forms; Muon refuses settings that would step into non-finite or unorthogonalised weights,
and two parameters over one storage."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.modules.muon import MatrixMuon, MuonWithAdamW

IDS = torch.arange(12).view(3, 4)
LABELS = torch.full((3, 4), -100)


@pytest.mark.parametrize("batch, labels", [
    (IDS, IDS), ((IDS,), IDS), ([IDS], IDS), ((IDS, LABELS), LABELS), ({"input_ids": IDS}, IDS),
    ({"input_ids": IDS, "labels": LABELS, "attention_mask": torch.ones_like(IDS)}, LABELS),
])
def test_causal_lm_reads_tensors_tuples_and_dicts_of_token_ids(batch, labels):
    inputs, targets = CausalLMModule(nn.Linear(1, 1)).split_batch(batch)
    assert inputs is IDS and torch.equal(targets, labels)


@pytest.mark.parametrize("batch, message", [
    ({"ids": IDS}, r"reads a tensor of token ids .*; the batch's dict has keys \['ids'\]"),
    ({"input_ids": IDS, "pixel_values": IDS}, r"keys \['input_ids', 'pixel_values'\]"),
    ({"input_ids": IDS, "attention_mask": torch.tril(torch.ones(3, 4))}, "an attention_mask with padding"),
    ((IDS, IDS, IDS), "got a tuple of 3"),
    ("text", "got a str"),
    (IDS.float(), r"input_ids must be integer token ids .* got a torch.float32 tensor of shape \(3, 4\)"),
    (IDS[0], r"shape \[samples, tokens\], got a torch.int64 tensor of shape \(4,\)"),
    ((IDS, IDS[:, :3]), r"labels of shape \(3, 3\) do not match input_ids of shape \(3, 4\)"),
])
def test_causal_lm_refuses_other_batches_naming_the_forms_it_reads(batch, message):
    with pytest.raises(ValueError, match=message):
        CausalLMModule(nn.Linear(1, 1)).split_batch(batch)


def _matrix() -> nn.Parameter:
    return nn.Parameter(torch.randn(8, 4))


@pytest.mark.parametrize("settings, message", [
    ({"lr": -0.02}, r"lr=-0.02 must be a finite number >= 0"),
    ({"lr": math.nan}, r"lr=nan must be a finite number >= 0"),
    ({"momentum": 1.0}, r"momentum=1.0 must be a finite number in \[0, 1\)"),
    ({"momentum": math.nan}, r"momentum=nan must be"),
    ({"ns_steps": 0}, r"ns_steps=0 must be an integer >= 1"),
    ({"ns_steps": 2.5}, r"ns_steps=2.5 must be an integer >= 1"),
    ({"weight_decay": -1.0}, r"weight_decay=-1.0 must be a finite number >= 0"),
    ({"eps": 0.0}, r"eps=0.0 must be a finite number > 0"),
    ({"adjust_lr_fn": "bogus"}, r"adjust_lr_fn='bogus' must be None, 'original' or 'match_rms_adamw'"),
])
def test_muon_refuses_settings_out_of_range(settings, message):
    with pytest.raises(ValueError, match=message):
        MatrixMuon([_matrix()], **{"lr": 0.02, "momentum": 0.95, "newton_schulz_dtype": "float32", **settings})


def test_muon_names_the_settings_it_has_and_the_hybrid_checks_its_momentum():
    with pytest.raises(TypeError, match="Muon has no setting nsteps; its settings are adjust_lr_fn, eps, lr"):
        MatrixMuon([_matrix()], lr=0.02, momentum=0.95, nsteps=3)
    with pytest.raises(ValueError, match=r"momentum=1.5 must be a finite number in \[0, 1\)"):
        MuonWithAdamW([{"params": [_matrix(), nn.Parameter(torch.zeros(4))]}], lr=0.02, momentum=1.5)
    assert MatrixMuon([_matrix()], lr=0.0, momentum=0.0, ns_steps=1, newton_schulz_dtype="float32")


def test_muon_refuses_two_parameters_over_one_storage():
    weight = _matrix()
    alias = nn.Parameter(weight.data)  # a tie by copying .data: both would be stepped
    with pytest.raises(ValueError, match=r"parameters 0 and 1 \(shape \(8, 4\)\) share one storage"):
        MuonWithAdamW([{"params": [weight, alias]}], lr=0.02, momentum=0.95, newton_schulz_dtype="float32")
