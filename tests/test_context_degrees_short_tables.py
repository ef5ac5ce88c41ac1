"""Per-sample context-parallel degrees (``context_parallel_degree='per_micro_batch'``) on a model whose position
table is shorter than ``6 x context_parallel``: the measured cost model's samples fit the table (they stopped the
first step), and fixed-length blocks are refused where they are known, naming the fix."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_merak.parallel.context.rounds import calibration_lengths
from lightning_merak.parallel.micro_batching import GlobalBatches
from lightning_merak.parallel.micro_batching.samples import (
    fixed_blocks_problem,
    global_batch_loader,
    summed_token_loss,
    target_count,
)
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import LayoutTraceRecorder, assert_traces_match, merge_rank_traces, run_distributed
from lightning_merak.testing.causal_lm import FixedOptimizerModule
from lightning_merak.testing.compare import record_reference_trace

VOCAB, POSITIONS = 96, 10  # under 6 x context_parallel=2: three whole chunks of 4 tokens do not fit


def test_calibration_lengths_below_three_whole_chunks_spread_under_the_longest_sample() -> None:
    assert calibration_lengths(4096, 2, longest=POSITIONS) == [2, 5, 10]  # the split runs pad 5 to 8, 10 to 12
    assert calibration_lengths(4096, 4, longest=16) == [4, 8, 16]
    assert calibration_lengths(4096, 2, longest=4) == [2, 3, 4]
    assert calibration_lengths(4096, 2, longest=62) == [12, 28, 60]  # whole chunks where three fit, as before
    assert calibration_lengths(8, 4) == [8, 16, 24]
    with pytest.raises(ValueError, match="the longest sample the model and data allow has 3; set "
                                         "strategy.micro_batching_cost"):
        calibration_lengths(4096, 2, longest=3)


def test_fixed_length_blocks_are_refused_for_per_sample_degrees_naming_both_fixes() -> None:
    problem = fixed_blocks_problem(Merak3DStrategy(context_parallel=2, context_parallel_degree="per_micro_batch"))
    assert problem is not None and "set data.lengths=variable" in problem
    assert "strategy.context_parallel_degree=fixed" in problem
    assert fixed_blocks_problem(Merak3DStrategy(context_parallel=2)) is None
    assert fixed_blocks_problem(None) is None


# A 2-rank run against one process ----------------------------------------------------------------------------------

def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=POSITIONS, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0, tie_word_embeddings=False, use_cache=False)
    return GPT2LMHeadModel(config)


def _samples() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(VOCAB, (length,), generator=generator) for length in (POSITIONS, 3, 7, 9, 2, 6)]


def _token_mean(model: torch.nn.Module, batch) -> torch.Tensor:
    total = sum(summed_token_loss(model(batch.sample(i)[None]).logits[:, :-1], batch.sample(i)[None, 1:])
                for i in range(len(batch.lengths)))
    return total / target_count(batch.lengths)


def _train(rank: int, world_size: int) -> tuple[list[float], list[dict]]:
    recorder = LayoutTraceRecorder()
    strategy = Merak3DStrategy(context_parallel=2, context_parallel_degree="per_micro_batch", timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(FixedOptimizerModule(_gpt2(), lr=0.1),
                train_dataloaders=global_batch_loader(_samples(), len(_samples()), seed=0, shuffle=False))
    return recorder.losses, recorder.gradients


@pytest.mark.distributed
def test_per_sample_degrees_on_a_position_table_under_six_times_the_degree_train_as_one_process() -> None:
    """The cost model is measured on samples of 2, 5 and 10 tokens (it refused to start below 12)."""
    module = FixedOptimizerModule(_gpt2(), lr=0.1)
    batches = list(GlobalBatches(_samples(), len(_samples()), seed=0, shuffle=False))
    reference = record_reference_trace(module.model, batches, _token_mean, module.configure_optimizers())
    results = run_distributed(_train, 2, timeout_s=180)
    assert_traces_match(reference, merge_rank_traces(results), loss_rtol=1e-5, grad_rtol=1e-4)
