"""DeltaMemory recompute on transformers models that keep their default ``use_cache=True``: the replay must
be the same computation as the first forward (no key/value cache taking the keys twice), and a run no
longer than the warm-up says that nothing will be managed."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.delta import DeltaMemory
from lightning_merak.callbacks.delta.recompute_switch import install_switch
from lightning_merak.testing import TraceRecorder, TrainingTrace, assert_traces_match
from lightning_merak.testing.delta_models import CausalLMModule

RECOMPUTE_BOTH = {"model.model.layers.0": "recompute", "model.model.layers.1": "recompute"}


def eager_gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=128, attn_implementation="eager")
    return Gemma2ForCausalLM(config)


def eager_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, attention_dropout=0.1, attn_implementation="eager")
    return LlamaForCausalLM(config)


def fit(make_model: Callable[[], nn.Module], callbacks: list[pl.Callback], root: Path,
        steps: int = 3) -> tuple[TrainingTrace, nn.Module]:
    pl.seed_everything(0, verbose=False)
    model = make_model()
    assert model.config.use_cache is True  # the default this file is about
    tokens = torch.randint(0, 128, (12, 16), generator=torch.Generator().manual_seed(1))
    recorder = TraceRecorder()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
                         callbacks=[recorder, *callbacks])
    trainer.fit(CausalLMModule(model), DataLoader(TensorDataset(tokens), batch_size=4))
    return recorder.trace, model


@pytest.mark.parametrize("make_model", [eager_gemma2, eager_llama], ids=["gemma2", "llama_eager"])
def test_recompute_matches_plain_training_with_the_default_cache(make_model, tmp_path: Path) -> None:
    reference, _ = fit(make_model, [], tmp_path / "plain")
    delta = DeltaMemory(budget="1KiB", warmup_steps=1, plot=False, overrides=RECOMPUTE_BOTH)
    managed, model = fit(make_model, [delta], tmp_path / "delta")
    assert_traces_match(reference, managed, loss_rtol=1e-6, grad_rtol=1e-6)
    assert model.config.use_cache is True, "the user's config is given back as it was"


class BlockTakingCache(nn.Module):
    def forward(self, hidden: torch.Tensor, cache: object = None) -> torch.Tensor:
        return hidden * 2


class FakeCache:
    def get_seq_length(self) -> int:
        return 0


def test_recompute_refuses_a_cache_passed_explicitly() -> None:
    block = BlockTakingCache()
    install_switch(block).recompute = True
    with pytest.raises(ValueError, match=r"key/value cache \(cache=FakeCache\).*use_cache=False"):
        block(torch.ones(2, requires_grad=True), cache=FakeCache())
    assert block(torch.ones(2, requires_grad=True), cache=None).sum().item() == 4.0


def test_warmup_as_long_as_the_run_is_announced(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(eager_llama, [DeltaMemory(budget="1KiB", warmup_steps=2, plot=False)], tmp_path / "shorter")
    assert not [w for w in caught if "covers the whole run" in str(w.message)]
    delta = DeltaMemory(budget="1KiB", warmup_steps=5, plot=False)
    with pytest.warns(UserWarning, match=r"warmup_steps=5 covers the whole run \(max_steps=3"):
        fit(eager_llama, [delta], tmp_path / "as_long")
    assert delta.manager.plan is None
