"""Context parallelism where it used to fail late: GPT-2's head (which reshapes to the sequence length) behind
pipeline stages, per-sample degrees on a model whose position table ends at the data's longest sample, and the
refusals that name the right numbers or come before the work starts."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_merak.parallel.context.model import check_context_parallel_model
from lightning_merak.parallel.context.rounds import calibration_lengths
from lightning_merak.parallel.micro_batching import GlobalBatches
from lightning_merak.parallel.micro_batching.samples import global_batch_loader, summed_token_loss, target_count
from lightning_merak.parallel.pipeline.router_aux import router_aux_loss_problem
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.strategies.merak3d.context_step import longest_sample
from lightning_merak.testing import (
    DistributedRunError,
    LayoutTraceRecorder,
    assert_traces_match,
    merge_rank_traces,
    record_reference_trace,
    run_distributed,
)
from lightning_merak.testing.causal_lm import FixedOptimizerModule

VOCAB, BATCH, SEQ, STEPS = 96, 2, 32, 2  # one row per micro-batch: no -1 in a view absorbs a length


def _gpt2(positions: int = 64) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=positions, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0, tie_word_embeddings=False, use_cache=False)
    return GPT2LMHeadModel(config)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, use_cache=False))


def _module(model: torch.nn.Module) -> FixedOptimizerModule:
    return FixedOptimizerModule(model, lr=0.1)


# Refusals, in one process ---------------------------------------------------------------------------------------

def test_a_router_aux_loss_across_stages_and_context_ranks_is_refused_before_launch() -> None:
    problem = router_aux_loss_problem(True, 2, context_parallel=2)
    assert problem is not None and "set the model's output_router_logits=False, or context_parallel=1" in problem
    assert router_aux_loss_problem(True, 1, context_parallel=2) is None  # one stage: the logits are gathered
    assert router_aux_loss_problem(True, 2, context_parallel="auto") is None  # decided once planned
    assert router_aux_loss_problem(False, 2, context_parallel=2) is None


def test_the_ulysses_refusal_names_the_models_heads_and_each_tensor_parallel_ranks_share() -> None:
    model = _llama()  # 2 key/value heads
    check_context_parallel_model(model, 2, "all_to_all")
    with pytest.raises(ValueError, match="the model has 2 key/value heads split over tensor_parallel=2 ranks: 1 "
                                         "key/value heads per rank, not divisible by 2"):
        check_context_parallel_model(model, 2, "all_to_all", tensor_parallel=2)


def test_the_cost_measurement_runs_no_sample_longer_than_the_model_and_data_allow() -> None:
    assert calibration_lengths(4096, 2, longest=62) == [12, 28, 60]  # not 512..2048 past GPT-2's table
    assert calibration_lengths(4096, 4) == [512, 1024, 2048]
    assert calibration_lengths(4096, 2, longest=10) == [2, 5, 10]  # three whole chunks do not fit: spread, padded
    with pytest.raises(ValueError, match="longest sample the model and data allow has 3; set "
                                         "strategy.micro_batching_cost"):
        calibration_lengths(4096, 2, longest=3)
    assert longest_sample(_gpt2(positions=62), [40, 100]) == 62  # GPT-2's n_positions
    assert longest_sample(_llama(), [40, 17]) == 40


# Distributed runs against one process ----------------------------------------------------------------------------

def _fixed_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    return [(step, step) for step in tokens]


def _train_fixed(rank: int, world_size: int, layout: dict) -> tuple[list[float], list[dict]]:
    module = _module(_gpt2())
    rows = [row for inputs, _ in _fixed_batches() for row in inputs]
    recorder = LayoutTraceRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(module, train_dataloaders=DataLoader([(row, row) for row in rows], batch_size=BATCH))
    return recorder.losses, recorder.gradients


@pytest.mark.distributed
@pytest.mark.parametrize("attention", ["ring", "all_to_all"])
def test_gpt2_behind_pipeline_stages_over_context_ranks_trains_as_one_process(attention: str) -> None:
    """GPT-2's head reshapes its hidden state to the traced sequence length: the last stage holds a shard of it."""
    module = _module(_gpt2())
    reference = record_reference_trace(module.model, _fixed_batches(), lambda _, batch: module.compute_loss(batch),
                                       module.configure_optimizers())
    layout = {"context_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2, "context_attention": attention}
    results = run_distributed(_train_fixed, 4, args=(layout,), timeout_s=120)
    assert_traces_match(reference, merge_rank_traces(results), loss_rtol=1e-5, grad_rtol=1e-4)


def _train_seq30(rank: int, world_size: int) -> None:
    module = _module(_llama())
    rows = [row[:30] for inputs, _ in _fixed_batches() for row in inputs]
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_checkpointing=False,
        strategy=Merak3DStrategy(context_parallel=2, pipeline_parallel=2, micro_batches=2, timeout_s=120),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=DataLoader([(row, row) for row in rows], batch_size=BATCH))


@pytest.mark.distributed
def test_a_sequence_the_context_ranks_cannot_split_is_refused_before_the_first_step() -> None:
    with pytest.raises(DistributedRunError, match="sequence length 30 is not divisible by 2 x context_parallel=2") \
            as error:
        run_distributed(_train_seq30, 4, timeout_s=120)
    assert "training_step" not in str(error.value)  # refused on the first batch, before tracing


POSITIONS = 62  # the longest sample fills GPT-2's position table; split over 2 ranks it pads to 64


def _samples() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(VOCAB, (length,), generator=generator) for length in (POSITIONS, 9, 23, 31, 14, 40)]


def _token_mean(model: torch.nn.Module, batch) -> torch.Tensor:
    total = sum(summed_token_loss(model(batch.sample(i)[None]).logits[:, :-1], batch.sample(i)[None, 1:])
                for i in range(len(batch.lengths)))
    return total / target_count(batch.lengths)


def _train_degrees(rank: int, world_size: int, layout: dict) -> tuple[list[float], list[dict], tuple[int, ...]]:
    recorder = LayoutTraceRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(_module(_gpt2(POSITIONS)),
                train_dataloaders=global_batch_loader(_samples(), len(_samples()), seed=0, shuffle=False))
    return recorder.losses, recorder.gradients, trainer.strategy._pipeline.last_plan.degrees


@pytest.mark.distributed
@pytest.mark.parametrize("cost", [None, [1e-6, 1e-3, 1e-6]], ids=["measured", "long-samples-split"])
def test_per_sample_degrees_on_gpt2_at_its_position_limit_train_as_one_process(cost) -> None:
    """The measured cost runs samples no longer than the table; a split 62-token sample pads past it."""
    module = _module(_gpt2(POSITIONS))
    batches = list(GlobalBatches(_samples(), len(_samples()), seed=0, shuffle=False))
    reference = record_reference_trace(module.model, batches, _token_mean, module.configure_optimizers())
    layout = {"context_parallel": 2, "context_parallel_degree": "per_micro_batch", "micro_batching_cost": cost}
    results = run_distributed(_train_degrees, 2, args=(layout,), timeout_s=120)
    if cost is not None:
        assert all(degrees[0] == 2 for *_, degrees in results)  # the 62-token sample ran split, padded to 64
    assert_traces_match(reference, merge_rank_traces([(losses, grads) for losses, grads, _ in results]),
                        loss_rtol=1e-5, grad_rtol=1e-4)
