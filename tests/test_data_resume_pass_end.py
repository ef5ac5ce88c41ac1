"""A checkpoint written when ``max_steps`` stopped a run on the last batch of a pass (``merak-train``'s final.ckpt)
resumes on the next pass's first batch, in the next epoch, with the step count going on; a trained batch count means
the same samples at another data-parallel split of the same global batch and order."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DistributedSampler

from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import DataConfig, DataError, OptimConfig, Schedule
from lightning_merak.modules.data import LanguageModelingData
from lightning_merak.modules.resumable import ResumableDataLoader
from lightning_merak.testing import run_distributed

from .test_resume import MODEL, checkpointing_trainer
from .test_resume import _fit as _fit_losses


class _Batches(pl.Callback):
    """Each trained batch with where the loops count it: (epoch, batch index, logged step, tokens)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the step loggers record
        self.seen.append((trainer.current_epoch, batch_idx, step, batch[0].clone()))


def _fit(max_steps: int, resume_from: str | None = None, save_to: str | None = None,
         epoch_checkpoints: str | None = None, limit_train_batches: int | float = 1.0,
         checkpoint_every: int | None = None) -> list[tuple]:
    """The tiny Llama on generated data, 10 batches a pass (``limit_train_batches`` of them an epoch);
    ``epoch_checkpoints``: a folder for a checkpoint at each epoch's end (``on_train_epoch_end``), and with
    ``checkpoint_every`` one each that many steps (``on_train_batch_end``)."""
    pl.seed_everything(0, workers=True)
    data = LanguageModelingData(DataConfig(name="synthetic", seq_len=16, batch_size=4, vocab_size=64,
                                           num_sequences=40))
    module = CausalLMModule(build_causal_lm(MODEL, 64), OptimConfig(warmup_steps=2, lr_schedule=Schedule.constant))
    trainer, _ = checkpointing_trainer(max_steps, "auto", 1, epoch_checkpoints, checkpoint_every,
                                       limit_train_batches=limit_train_batches)
    batches = _Batches()
    trainer.callbacks.append(batches)
    if epoch_checkpoints is not None:
        trainer.callbacks.append(ModelCheckpoint(dirpath=epoch_checkpoints, every_n_epochs=1, save_top_k=-1,
                                                 save_on_train_epoch_end=True, filename="{epoch}"))
    trainer.fit(module, datamodule=data, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return batches.seen


def test_a_run_stopped_at_a_pass_end_resumes_on_the_next_pass_as_the_straight_run(tmp_path: Path) -> None:
    """Written after the run (``merak-train``'s final.ckpt) or at the epoch's end: either resumes in epoch 1 at
    batch 0, logging step 10, on the batches the straight run trained."""
    straight = _fit(14)
    _fit(10, save_to=str(tmp_path / "pass_end.ckpt"), epoch_checkpoints=str(tmp_path))
    for checkpoint in ("pass_end.ckpt", "epoch=0.ckpt"):
        resumed = _fit(14, resume_from=str(tmp_path / checkpoint))
        assert [where for *where, _ in resumed] == [where for *where, _ in straight[10:]], checkpoint
        assert all(torch.equal(a[-1], b[-1]) for a, b in zip(resumed, straight[10:], strict=True)), checkpoint


@pytest.mark.parametrize("limit", [3, 0.3])
def test_an_epoch_cut_by_limit_train_batches_resumes_on_the_next_pass(tmp_path: Path, limit: int | float) -> None:
    """Three batches of the loader's ten make an epoch: a checkpoint at its end is a finished pass, so the resumed
    run reads the next pass's first batch where it once read the fourth batch the limit left out of the first.
    Written at the last batch's end (``step=3``), every later epoch read the pass after its own."""
    straight = _fit(10, limit_train_batches=limit)
    _fit(3, save_to=str(tmp_path / "pass_end.ckpt"), epoch_checkpoints=str(tmp_path), limit_train_batches=limit,
         checkpoint_every=3)
    for checkpoint in ("pass_end.ckpt", "epoch=0.ckpt", "step=3.ckpt"):
        resumed = _fit(10, resume_from=str(tmp_path / checkpoint), limit_train_batches=limit)
        assert [where for *where, _ in resumed] == [where for *where, _ in straight[3:]], checkpoint
        assert all(torch.equal(a[-1], b[-1]) for a, b in zip(resumed, straight[3:], strict=True)), checkpoint



def _pass_end_rank(rank: int, world_size: int, directory: str) -> dict[str, dict[str, list[float]]]:
    """Each strategy's straight run and its resume from the end of the first pass (5 batches a rank)."""
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    losses = {}
    for name in ("ddp", "merak3d"):
        def strategy() -> Any:
            return "ddp" if name == "ddp" else Merak3DStrategy(data_parallel=world_size, timeout_s=120)

        path = str(Path(directory) / f"{name}.ckpt")
        straight = _fit_losses(8, strategy(), world_size)
        _fit_losses(5, strategy(), world_size, save_to=path)
        losses[name] = {"straight": straight, "resumed": _fit_losses(8, strategy(), world_size, resume_from=path)}
    return losses


@pytest.mark.distributed
def test_data_parallel_ranks_stopped_at_a_pass_end_resume_on_the_next_pass(tmp_path: Path) -> None:
    for result in run_distributed(_pass_end_rank, 2, args=(str(tmp_path),), timeout_s=300):
        for name, losses in result.items():
            assert losses["resumed"] == pytest.approx(losses["straight"][5:], rel=1e-6), name


SAMPLES = list(range(40))


def _rank_loader(rank: int, replicas: int, batch_size: int, seed: int, trained: int) -> ResumableDataLoader:
    """A loader as Lightning makes it for data-parallel rank ``rank``: a shuffling distributed sampler."""
    sampler = DistributedSampler(SAMPLES, num_replicas=replicas, rank=rank, shuffle=True, seed=seed)
    return ResumableDataLoader(SAMPLES, batch_size=batch_size, sampler=sampler, drop_last=True, epoch=lambda: 0,
                               trained_batches=lambda: trained, shuffle_seed=seed)


def _single_loader(batch_size: int, seed: int, epoch: int = 0) -> ResumableDataLoader:
    """A one-device loader as :class:`TokenDataModule` makes it, in trainer epoch ``epoch``: shuffled by its
    reseeded generator."""
    return ResumableDataLoader(SAMPLES, batch_size=batch_size, shuffle=True, drop_last=True,
                               generator=torch.Generator(), epoch=lambda: epoch, trained_batches=lambda: 0,
                               shuffle_seed=seed)


def _global_steps(replicas: int, batch_size: int, saved: dict[str, Any] | None = None) -> list[list[int]]:
    """The samples of each step of a pass over every data-parallel rank, resumed from ``saved``."""
    loaders = [_rank_loader(rank, replicas, batch_size, seed=7, trained=2) for rank in range(replicas)]
    for loader in loaders:
        if saved is not None:
            loader.load_state_dict(saved)
    return [sorted(sum((batch.tolist() for batch in step), [])) for step in zip(*loaders)]


def test_ranks_that_keep_the_global_batch_and_order_resume_on_the_untrained_samples() -> None:
    """Every rank's step ``s`` reads positions ``8s`` to ``8s + 7`` of the pass's order at a global batch of 8."""
    saved = _rank_loader(0, 2, 4, seed=7, trained=2).state_dict()
    assert _global_steps(4, 2, saved) == _global_steps(2, 4)[2:]
    for other in (_single_loader(8, seed=7), _rank_loader(0, 2, 8, seed=7, trained=0),
                  _rank_loader(0, 4, 2, seed=8, trained=0)):  # a one-device shuffle, a global batch, an order
        with pytest.raises(DataError, match=re.escape(
                "Resume with the same data-parallel degree and data.batch_size, or on data-parallel ranks that keep "
                "its global batch of 8 samples a step (data-parallel degree x data.batch_size, 2 ranks or more) with "
                "the same trainer.seed, or resume a checkpoint written at the end of a pass")):
            other.load_state_dict(saved)


def test_a_pass_finished_at_another_data_parallel_split_resumes_on_the_next_pass() -> None:
    """Nothing is left to skip, so the next pass may split its samples otherwise: not refused."""
    finished = _rank_loader(0, 2, 4, seed=7, trained=5).state_dict()
    assert finished["pass_length"] == 5
    resumed = _single_loader(8, seed=7, epoch=1)
    resumed.load_state_dict(finished)
    next_pass = _single_loader(8, seed=7, epoch=1)
    assert [batch.tolist() for batch in resumed] == [batch.tolist() for batch in next_pass]
