"""merak3d builds the same layout whichever loop brings the first batch, and refuses bad layouts before launch.

The layout is built on the first batch the strategy moves to its device. With Lightning's
sanity check, ``trainer.validate`` or ``trainer.predict`` that batch arrives under
``torch.no_grad`` (gloo) or ``torch.inference_mode`` (NCCL) with the module in eval mode;
training must then give the losses and gradients of the single-process reference, as it
does when the first batch is a training batch (``tests/test_merak3d.py``).

Everything that needs no traced model is refused before any process starts
(``validate_arguments`` / ``validate_before_launch``); those tests start nothing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.parallel.pipeline.stage import tied_parameter_names
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import assert_traces_match, merge_rank_traces, run_distributed
from tests.test_merak3d import BATCH, SEQ, STEPS, VOCAB, _batches, _module, _Recorder, _reference

TP2 = {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 2}
TP2_SP = {**TP2, "sequence_parallel": True}
PP2 = {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1}
PP2_TP2 = {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 2}


class _Data(pl.LightningDataModule):
    """The reference's batches for training; two batches of other sequences for validation and prediction."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(_batches().reshape(-1, SEQ)), batch_size=BATCH, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return _other_batches()


def _other_batches() -> DataLoader:
    held_out = torch.randint(VOCAB, (2 * BATCH, SEQ), generator=torch.Generator().manual_seed(11))
    return DataLoader(TensorDataset(held_out), batch_size=BATCH, shuffle=False)


class _ModeRecorder(_Recorder):
    """Also records whether every module was in the loop's mode at each batch, built stages included."""

    def __init__(self, tied: list[tuple[str, ...]]) -> None:
        super().__init__(tied)
        self.wrong_modes: list[str] = []

    def _check(self, loop: str, pl_module: pl.LightningModule, training: bool) -> None:
        wrong = [name for name, module in pl_module.named_modules() if module.training != training]
        if wrong:
            self.wrong_modes.append(f"{loop}: {wrong[:3]}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._check("train", pl_module, True)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._check("validation", pl_module, False)

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._check("predict", pl_module, False)


def _evaluate_in_inference_mode() -> None:
    """Make Lightning's evaluation loops run under ``torch.inference_mode`` on gloo, as they do on NCCL.

    Lightning picks ``no_grad`` whenever the default process group is gloo; batches made under
    inference mode are inference tensors, which autograd refuses.
    """
    from lightning.pytorch.loops import utilities

    utilities._distributed_is_initialized = lambda: False


def _train_after_first_batch_rank(rank: int, world_size: int, model_name: str, layout: dict, sanity_steps: int,
                                  first: Optional[str] = None, inference_mode: bool = False,
                                  validate_every: Optional[int] = 2) -> tuple:
    """Train the reference's steps after the layout was built by a sanity check, ``validate`` or ``predict``.

    ``validate_every=None`` validates only after the last step: a validation dataloader draws its
    base seed from the global generator, which moves the dropout masks of the steps after it.
    """
    if inference_mode:
        _evaluate_in_inference_mode()
    module = _module(model_name)
    recorder = _ModeRecorder(tied_parameter_names(module.model))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120),
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=sanity_steps, val_check_interval=validate_every,
        limit_val_batches=1.0 if sanity_steps or first else 0, use_distributed_sampler=False, callbacks=[recorder],
    )
    if first == "validate":
        trainer.validate(module, dataloaders=_other_batches())
    elif first == "predict":
        trainer.predict(module, dataloaders=_other_batches())
    assert trainer.strategy.layout_built == (first is not None)
    trainer.fit(module, datamodule=_Data())
    return recorder.losses, recorder.gradients, recorder.wrong_modes


def _check_against_reference(model_name: str, results: list[tuple]) -> None:
    for _, _, wrong_modes in results:
        assert not wrong_modes, f"modules in the wrong train/eval mode: {wrong_modes}"
    trace = merge_rank_traces([(losses, gradients) for losses, gradients, _ in results])
    assert len(trace.losses) == STEPS
    assert_traces_match(_reference(model_name), trace, loss_rtol=1e-5, grad_rtol=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize(("layout", "inference_mode"), [
    (TP2, False), (TP2, True), (TP2_SP, False), (PP2, False), (PP2_TP2, True),
], ids=["tp2", "tp2-inference-mode", "tp2-sp", "pp2", "pp2-tp2-inference-mode"])
def test_layout_built_in_the_sanity_check_trains_like_the_reference(layout, inference_mode):
    """The sanity check's first validation batch builds the layout (no_grad, or inference mode as on NCCL)."""
    world_size = layout["pipeline_parallel"] * layout["tensor_parallel"]
    results = run_distributed(_train_after_first_batch_rank, world_size, args=("llama", layout, 2),
                              kwargs={"inference_mode": inference_mode}, timeout_s=300)
    _check_against_reference("llama", results)


@pytest.mark.distributed
@pytest.mark.parametrize(("layout", "first"), [(TP2, "predict"), (PP2_TP2, "validate")],
                         ids=["tp2-predict", "pp2-tp2-validate"])
def test_layout_built_by_validate_or_predict_before_fit_trains_like_the_reference(layout, first):
    world_size = layout["pipeline_parallel"] * layout["tensor_parallel"]
    results = run_distributed(_train_after_first_batch_rank, world_size, args=("llama", layout, 0),
                              kwargs={"first": first}, timeout_s=300)
    _check_against_reference("llama", results)


@pytest.mark.distributed
def test_sanity_check_build_draws_no_dropout_mask():
    """With dropout on, a layout built in the sanity check (eval mode, its random state isolated by Lightning)
    trains exactly as one built on the first training batch: building draws nothing from the generators."""
    def run(sanity_steps: int) -> tuple:
        results = run_distributed(_train_after_first_batch_rank, 2, args=("gpt2_dropout", TP2, sanity_steps),
                                  kwargs={"validate_every": None}, timeout_s=300)
        for _, _, wrong_modes in results:
            assert not wrong_modes, f"modules in the wrong train/eval mode: {wrong_modes}"
        return merge_rank_traces([(losses, gradients) for losses, gradients, _ in results])

    assert_traces_match(run(0), run(2), loss_rtol=1e-6, grad_rtol=1e-6)


def _merak_train(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_merak.cli.train", *overrides],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.distributed
def test_merak_train_with_tensor_parallel_validates_and_trains(tmp_path: Path):
    """The default Llama at tensor_parallel=2, its sanity check and a validation every 2 steps (2 processes).

    With sequence parallelism, merak-train is the README's command (tests/test_readme.py) and validation
    every 2 steps is test_layout_built_in_the_sanity_check_trains_like_the_reference[tp2-sp].
    """
    result = _merak_train("strategy.tensor_parallel=2", "trainer.max_steps=4", "trainer.val_check_interval=2",
                          "trainer.limit_val_batches=1", "data.num_sequences=128", "trainer.enable_progress_bar=false",
                          f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "merak-train: done." in result.stdout


# Refusals before launch: no process, no traced model -------------------------------------------------


def _llama_module() -> pl.LightningModule:
    """The test Llama: 4 blocks (6 pipeline nodes), 4 attention heads and 2 key/value heads."""
    return _module("llama")


@pytest.mark.parametrize(("kwargs", "world_size", "batch", "message"), [
    # the run: 3 stages default to 6 micro-batches, and a batch of 16 does not split into 6
    ({"pipeline_parallel": 3}, 3, {"batch_size": 16},
     "batch size 16 is not divisible by micro_batches=6 (the default, 2 × pipeline_parallel=3); "
     "set micro_batches to 4 or 8 or 16, or make the batch size a multiple of 6"),
    # an explicit count; the choices offered respect each schedule (here: at least one per stage)
    ({"pipeline_parallel": 2, "micro_batches": 3}, 2, {"batch_size": 8},
     "batch size 8 is not divisible by micro_batches=3; set micro_batches to 2 or 4 or 8"),
    # micro-batches of 2 samples cannot be cut into 4 overlapped sub-batches
    ({"pipeline_parallel": 2, "tensor_parallel": 2, "tp_overlap": 4}, 4, {"batch_size": 8},
     "micro-batches of 2 samples (batch size 8 / micro_batches=4) cannot be split into tp_overlap=4 sub-batches; "
     "set micro_batches to 2, or make the batch size a multiple of 16"),
    # sequence parallelism splits each sequence over the tensor-parallel ranks
    ({"tensor_parallel": 2, "sequence_parallel": True}, 2, {"sequence_length": 63},
     "the sequence length 63 is not divisible by it"),
    # merak3d accumulates over micro-batches itself
    ({}, 2, {"accumulate_grad_batches": 2}, "set accumulate_grad_batches=1"),
    # the planner chooses the stages, but a fixed micro-batch count must still split the batch
    ({"pipeline_parallel": "auto", "micro_batches": 5}, 2, {"batch_size": 16},
     "batch size 16 is not divisible by micro_batches=5; set micro_batches to 1 or 2 or 4 or 8 or 16"),
], ids=["default-micro-batches", "explicit-micro-batches", "tp-overlap", "sequence-length", "accumulation",
        "planned-stages"])
def test_arguments_and_batches_are_refused_before_launch(kwargs, world_size, batch, message):
    strategy = Merak3DStrategy(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        strategy.validate_arguments(world_size, **batch)
    with pytest.raises(ValueError, match=re.escape(message)):
        strategy.validate_before_launch(_llama_module(), world_size, **batch)


def test_checks_without_the_batch_shape_still_pass_and_the_old_call_keeps_working():
    """``validate_before_launch(module, world_size)`` as train.py called it: the batch checks are skipped, and
    layouts whose micro-batch count the planner chooses are not checked against the batch."""
    Merak3DStrategy(pipeline_parallel=3).validate_before_launch(_llama_module(), 3)
    Merak3DStrategy(pipeline_parallel=3, micro_batches=4).validate_before_launch(_llama_module(), 3, batch_size=16)
    Merak3DStrategy(pipeline_parallel=2, tensor_parallel="auto").validate_arguments(4, batch_size=6)


@pytest.mark.parametrize(("kwargs", "message"), [
    # the schedule needs a micro-batch per stage
    ({"pipeline_parallel": 3, "micro_batches": 2},
     "micro_batches=2 is smaller than pipeline_parallel=3; pipeline schedules need at least one micro-batch per "
     "stage; set micro_batches to a multiple of pipeline_parallel=3 (the default is 6)"),
    # torch's interleaved schedules run micro_batches // pipeline_parallel rounds of equal size
    ({"pipeline_parallel": 2, "micro_batches": 5, "schedule": "interleaved_1f1b"},
     "schedule='interleaved_1f1b' runs micro_batches=5 in 5 // pipeline_parallel=2 = 2 rounds of equal size, and 2 "
     "does not divide 5; set micro_batches to a multiple of pipeline_parallel=2 (the default is 4)"),
    ({"pipeline_parallel": 3, "micro_batches": 7, "schedule": "interleaved_zero_bubble"},
     "schedule='interleaved_zero_bubble' runs micro_batches=7 in 7 // pipeline_parallel=3 = 2 rounds"),
], ids=["fewer-than-stages", "interleaved-1f1b-rounds", "zero-bubble-rounds"])
def test_micro_batches_a_schedule_cannot_run_are_refused_by_the_constructor(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Merak3DStrategy(**kwargs)


def test_model_checks_run_before_launch():
    """The model's config and structure, without tracing it: heads per rank, stages per node, a network to split."""
    with pytest.raises(ValueError, match=re.escape("tensor_parallel=3 does not divide num_attention_heads=4")):
        Merak3DStrategy(tensor_parallel=3).validate_before_launch(_llama_module(), 3, batch_size=8)
    with pytest.raises(ValueError, match=re.escape("7 pipeline stages (pipeline_parallel × virtual_stages) exceed "
                                                   "the 6 nodes")):
        Merak3DStrategy(pipeline_parallel=7).validate_before_launch(_llama_module(), 7, batch_size=14)
    with pytest.raises(TypeError, match="merak3d splits a transformer network, and finds none among "
                                        "LightningModule's children"):
        Merak3DStrategy(tensor_parallel=2).validate_before_launch(pl.LightningModule(), 2, batch_size=8)
