"""GPT-2 under dynamic micro-batching at pipeline_parallel=2 against one process (gloo ranks).

GPT-2 ends its forward with ``hidden_states.view(output_shape)`` of the traced batch and length, which the last
stage replays on micro-batches of other shapes (it failed: ``shape '[-1, 40, 32]' is invalid``).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.micro_batching.plan import MicroBatch
from lightning_merak.parallel.micro_batching.samples import micro_batch_tensors, summed_token_loss, target_count
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import (
    TrainingTrace,
    assert_traces_match,
    merge_rank_traces,
    run_distributed,
    snapshot_gradients,
)
from lightning_merak.testing.causal_lm import FixedOptimizerModule
from tests.test_micro_batching_distributed import VOCAB, _Data, _global_batches, _Recorder

pytestmark = pytest.mark.distributed

GPT2 = ModelConfig(name="gpt2", model_type="gpt2", config={
    "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 128, "attn_implementation": "eager",
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False})


def _module() -> FixedOptimizerModule:
    torch.manual_seed(0)
    model = build_causal_lm(GPT2, vocab_size=VOCAB)
    model.config.use_cache = False
    return FixedOptimizerModule(model)


def _reference() -> TrainingTrace:
    """Each sample on its own through the whole model; loss = summed token loss / real targets of the batch."""
    module = _module()
    optimizer = torch.optim.SGD(module.model.parameters(), lr=0.5)
    trace = TrainingTrace()
    for batch in _global_batches():
        optimizer.zero_grad()
        total = sum(
            summed_token_loss(module(tensors.input_ids), tensors.labels)
            for tensors in (micro_batch_tensors(batch, MicroBatch(((index,),), len(batch.sample(index))))
                            for index in range(len(batch.lengths))))
        loss = total / target_count(batch.lengths)
        loss.backward()
        trace.append(loss.item(), snapshot_gradients(module.model))
        optimizer.step()
    return trace


def _train_rank(rank: int, world_size: int) -> tuple[list[float], list[dict]]:
    recorder = _Recorder()
    strategy = Merak3DStrategy(pipeline_parallel=2, micro_batching="dynamic", micro_batches=4, micro_batch_tokens=96,
                               timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(_module(), datamodule=_Data())
    return recorder.losses, recorder.gradients


def test_gpt2_dynamic_micro_batches_match_single_process() -> None:
    """Micro-batches of several batch sizes and lengths replay GPT-2's head: same loss and gradients as one
    process."""
    results = run_distributed(_train_rank, 2, timeout_s=300)
    assert_traces_match(_reference(), merge_rank_traces(results))
