"""Which tied parameters merak3d keeps equal across pipeline stages: those the first and the last rank each hold a
copy of; a tie one rank holds whole is one parameter there (it joined no group, and the ranks' differing counts hung
the first collective over the ties); one spread over other ranks is refused."""

from __future__ import annotations

import pytest

from lightning_merak.strategies.merak3d.build import ties_between_end_stages

TIES = [("embeddings.weight", "decoder.weight"), ("head.bias", "decoder.bias")]


def test_only_ties_held_by_the_first_and_the_last_rank_are_joined() -> None:
    assert ties_between_end_stages(TIES, [[0], [0, 1]]) == [0]  # the masked LM's bias: both on the last stage
    assert ties_between_end_stages(TIES, [[0], [], [0, 1]]) == [0]  # a middle rank holds neither
    assert ties_between_end_stages(TIES, [[0, 1], [0, 1]]) == [0, 1]


def test_a_tie_spread_over_another_rank_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"tied parameters head\.bias, decoder\.bias sit on pipeline ranks \[1, 2\]"):
        ties_between_end_stages(TIES, [[0], [1], [0, 1]])


def test_a_stop_iteration_in_the_layout_build_fails_the_run_not_ends_the_epoch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_merak.strategies import Merak3DStrategy
    from lightning_merak.strategies.merak3d import strategy as merak3d_strategy
    from lightning_merak.testing.causal_lm import FixedOptimizerModule
    from lightning_merak.testing.delta_models import tiny_llama

    def broken_build(*args, **kwargs):
        raise StopIteration  # Lightning takes one raised in the data fetch for the end of the data

    monkeypatch.setattr(merak3d_strategy.build, "build_model", broken_build)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Merak3DStrategy(), max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    try:
        with pytest.raises(RuntimeError, match="layout build raised StopIteration"):
            trainer.fit(FixedOptimizerModule(tiny_llama(dropout=0.0)),
                        DataLoader(torch.randint(0, 64, (8, 16)), batch_size=4))
    finally:  # the failed fit leaves merak3d's one-rank process group: later tests of this process create their own
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
