"""GPT-2 under dynamic micro-batching at pipeline_parallel=2 against one process (gloo ranks).

GPT-2 ends its forward with ``hidden_states.view(output_shape)`` of the traced batch and length, which the last
stage replays on micro-batches of other shapes (it failed: ``shape '[-1, 40, 32]' is invalid``).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_merak.modules.config import ModelConfig
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import (
    assert_traces_match,
    merge_rank_traces,
    run_distributed,
)
from tests.test_micro_batching_distributed import _Data, _module, _Recorder, _reference

pytestmark = pytest.mark.distributed

GPT2 = ModelConfig(name="gpt2", model_type="gpt2", config={
    "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 128, "attn_implementation": "eager",
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False})


def _train_rank(rank: int, world_size: int) -> tuple[list[float], list[dict]]:
    recorder = _Recorder()
    strategy = Merak3DStrategy(pipeline_parallel=2, micro_batching="dynamic", micro_batches=4, micro_batch_tokens=96,
                               timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(_module(GPT2), datamodule=_Data())
    return recorder.losses, recorder.gradients


def test_gpt2_dynamic_micro_batches_match_single_process() -> None:
    """Micro-batches of several batch sizes and lengths replay GPT-2's head: same loss and gradients as one
    process."""
    results = run_distributed(_train_rank, 2, timeout_s=300)
    assert_traces_match(_reference(GPT2), merge_rank_traces(results))
