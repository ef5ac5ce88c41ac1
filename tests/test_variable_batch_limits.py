"""Variable-length batches at their limits: a mid-pass resume at another global batch, packed padding inside a
learned position table, padding to a multiple of 8 past it, and the checks merak-train makes of them before launch."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lightning_merak.checkpoint.sharded import LIGHTNING_CHECKPOINT
from lightning_merak.cli.checks import check_batches_before_launch
from lightning_merak.cli.overrides import ConfigError
from lightning_merak.modules.config import DataConfig, DataError
from lightning_merak.modules.positions import padded_length_problem
from lightning_merak.modules.resumable import ResumableDataLoader
from lightning_merak.parallel.micro_batching import GlobalBatches
from lightning_merak.parallel.micro_batching.plan import MicroBatch, plan_packed
from lightning_merak.parallel.micro_batching.samples import global_batch_loader, micro_batch_tensors, summed_token_loss
from lightning_merak.strategies.merak3d import Merak3DStrategy

VOCAB = 96


def _gpt2(positions: int, attention: str = "eager") -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=positions, vocab_size=VOCAB,
                        attn_implementation=attention, use_cache=False)
    return GPT2LMHeadModel(config).eval()


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="eager", use_cache=False)
    return LlamaForCausalLM(config).eval()


# 1. global batches of variable lengths record their size, so a mid-pass resume at another one is refused

def _global_loader(batch_size: int, trained: int) -> ResumableDataLoader:
    samples = [torch.full((3 + index % 5,), index) for index in range(48)]
    return global_batch_loader(samples, batch_size, seed=7, shuffle=True, loader_class=ResumableDataLoader,
                               epoch=lambda: 0, trained_batches=lambda: trained, shuffle_seed=7)


def test_a_mid_pass_resume_at_another_global_batch_is_refused():
    state = _global_loader(8, trained=2).state_dict()
    assert (state["replicas"], state["batch_size"]) == (1, 8)
    with pytest.raises(DataError, match="1 data-parallel shares of 8 samples a step, this run reads 1 of 4"):
        _global_loader(4, trained=0).load_state_dict(state)
    same = _global_loader(8, trained=0)
    same.load_state_dict(state)
    assert len(list(same)) == 6 - 2  # the pass's untrained global batches
    older = _global_loader(4, trained=0)  # a checkpoint written before global batches recorded their size
    older.load_state_dict({**state, "batch_size": None})


# 2. packed rows' padding never takes a position id past the longest sample

def _packed_batch(lengths: list[int]) -> tuple[Any, list[MicroBatch]]:
    generator = torch.Generator().manual_seed(5)
    samples = [torch.randint(VOCAB, (length,), generator=generator) for length in lengths]
    batch = next(iter(GlobalBatches(samples, len(samples), seed=0, shuffle=False)))
    return batch, list(plan_packed(lengths, 1, 1, 256, 1).replicas[0])


def test_packed_padding_stays_inside_the_position_table_and_apart_from_the_documents():
    lengths = [60, 60, 60, 60, 60, 10]  # the short row shares its micro-batch with 240-token rows
    batch, micro_batches = _packed_batch(lengths)
    model = _gpt2(positions=64).requires_grad_(False)
    alone = sum(summed_token_loss(model(batch.sample(index)[None]).logits,
                                  micro_batch_tensors(batch, MicroBatch(((index,),), lengths[index])).labels)
                for index in range(len(lengths)))
    packed = torch.zeros(())
    for micro in micro_batches:
        tensors = micro_batch_tensors(batch, micro, packed=True)
        assert int(tensors.position_ids.max()) < max(lengths)
        for row, samples in enumerate(micro.rows):  # the padding starts a document of its own
            assert int(tensors.position_ids[row, sum(lengths[index] for index in samples)]) == 0
        packed += summed_token_loss(model(tensors.input_ids, position_ids=tensors.position_ids).logits, tensors.labels)
    assert float(packed) == pytest.approx(float(alone), rel=1e-5)


def test_packed_loss_and_gradients_of_a_rotary_model_are_those_of_each_document_alone():
    lengths = [30, 7, 20, 3]
    batch, _ = _packed_batch(lengths)
    model = _llama()
    alone = sum(summed_token_loss(model(t.input_ids).logits, t.labels) for t in (
        micro_batch_tensors(batch, MicroBatch(((index,),), 32)) for index in range(len(lengths))))
    expected = torch.autograd.grad(alone, list(model.parameters()))
    together = micro_batch_tensors(batch, MicroBatch(((0, 1), (2, 3)), 64), packed=True)  # 27 and 41 padding tokens
    packed = summed_token_loss(model(together.input_ids, position_ids=together.position_ids).logits, together.labels)
    assert packed.item() == pytest.approx(alone.item(), rel=1e-5)
    for mine, reference in zip(torch.autograd.grad(packed, list(model.parameters())), expected):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-6)


# 3. padding to a multiple of 8 never passes the position table: refused before launch

def test_padding_past_the_position_table_is_refused_with_the_fix():
    problem = padded_length_problem(_gpt2(positions=60), 60)
    assert problem is not None and "pads each batch to 64 tokens" in problem
    assert "data.max_length<=56" in problem and "model.config.n_positions=64" in problem
    assert padded_length_problem(_gpt2(positions=60), 56) is None
    assert padded_length_problem(_gpt2(positions=60), 56, multiple=6) is None  # 56 -> 60: a multiple of 2 x 3
    assert "data.max_length<=48" in padded_length_problem(_gpt2(positions=60), 56, multiple=16)
    assert padded_length_problem(_llama(), 63) is None  # rotary: no table to overrun


def _config(lengths: str, batch_size: int, max_length: int = 60, **strategy: Any) -> SimpleNamespace:
    options = {"data_parallel": "auto", "pipeline_parallel": 1, "tensor_parallel": 1, "context_parallel": 1,
               **strategy}
    data = DataConfig(name="synthetic", lengths=lengths, batch_size=batch_size, max_length=max_length)
    return SimpleNamespace(data=data, trainer=SimpleNamespace(kwargs={}),
                           strategy=SimpleNamespace(strategy_kwargs=lambda: options))


def test_variable_batches_padded_past_the_position_table_are_refused_before_launch():
    strategy = Merak3DStrategy(pipeline_parallel=2, micro_batching="dynamic")
    module = SimpleNamespace(model=_gpt2(positions=60))
    with pytest.raises(ConfigError, match="data.max_length<=56"):
        check_batches_before_launch(_config("variable", 8, pipeline_parallel=2), strategy, module, 2, None)
    check_batches_before_launch(_config("variable", 8, max_length=56, pipeline_parallel=2), strategy, module, 2, None)
    check_batches_before_launch(_config("fixed", 8, pipeline_parallel=2), strategy, module, 2, None)


# 4. a resume at another batch shape is refused before launch, from the checkpoint's loader state

def _checkpoint(path: Path, **state: Any) -> Path:
    loader = {"pass": 0, "batches": 3, "replicas": 2, "batch_size": 4, "pass_length": 1024,  # 8192 sequences
              "order": ["randperm", 1234], **state}
    torch.save({"loops": {"fit_loop": {"state_dict": {"combined_loader": [loader]}}}}, path)
    return path


def test_a_resume_at_another_batch_shape_is_refused_before_launch(tmp_path):
    saved = _checkpoint(tmp_path / "step.ckpt")
    ddp = DDPStrategy()
    with pytest.raises(ConfigError, match=r"step.ckpt: the checkpoint's run read 2 data-parallel shares of 4"):
        check_batches_before_launch(_config("fixed", 2), ddp, None, 2, saved)
    check_batches_before_launch(_config("fixed", 4), ddp, None, 2, saved)  # the same shape
    check_batches_before_launch(_config("fixed", 2), ddp, None, 4, saved)  # its global batch of 8, same order
    finished = _checkpoint(tmp_path / "end.ckpt", batches=1024)
    check_batches_before_launch(_config("fixed", 2), ddp, None, 2, finished)
    sharded = tmp_path / "sharded.ckpt"
    sharded.mkdir()
    _checkpoint(sharded / LIGHTNING_CHECKPOINT, replicas=1, batch_size=8, order=None)
    merak3d = Merak3DStrategy(pipeline_parallel=2, micro_batching="dynamic")
    with pytest.raises(ConfigError, match="1 data-parallel shares of 8 samples a step, this run reads 1 of 4"):
        check_batches_before_launch(_config("variable", 4, pipeline_parallel=2), merak3d, None, 2, sharded)
    check_batches_before_launch(_config("variable", 8, pipeline_parallel=2), merak3d, None, 2, sharded)


def test_merak3d_counts_its_batch_replicas_and_leaves_a_planned_layout_to_the_ranks(tmp_path):
    saved = _checkpoint(tmp_path / "step.ckpt")  # 2 replicas of 4
    fixed = Merak3DStrategy(pipeline_parallel=2)
    with pytest.raises(ConfigError, match="this run reads 1 of 4"):
        check_batches_before_launch(_config("fixed", 4, pipeline_parallel=2), fixed, None, 2, saved)
    check_batches_before_launch(_config("fixed", 4, pipeline_parallel=2), fixed, None, 4, saved)
    planned = Merak3DStrategy(pipeline_parallel="auto")
    check_batches_before_launch(_config("fixed", 4, pipeline_parallel="auto"), planned, None, 2, saved)


# 5. packed rows under context_parallel=auto: the planner may choose 1, where the model must keep documents apart

def test_packing_under_a_planned_context_degree_needs_a_masking_model_before_launch():
    """context_parallel='auto' may plan cp=1, where packed rows need a model that masks them itself: refused by the
    strategy's pre-launch check (merak-train's, and a Python run's setup), unless the fixed degrees force cp>=2."""
    from lightning_merak.modules.causal_lm import CausalLMModule

    strategy = Merak3DStrategy(pipeline_parallel=2, micro_batching="pack", context_parallel="auto")
    with pytest.raises(ValueError, match="micro_batching=pack.*attn_implementation"):
        strategy.validate_before_launch(CausalLMModule(_gpt2(64, "sdpa")), 2)
    strategy.validate_before_launch(CausalLMModule(_gpt2(64)), 2)  # eager attention masks the packed documents
    forced = Merak3DStrategy(data_parallel=1, pipeline_parallel=2, tensor_parallel=1, micro_batching="pack",
                             context_parallel="auto")  # 4 ranks: context_parallel can only be 2
    model = _gpt2(64, "sdpa")
    model.config.attn_pdrop = 0.0  # context parallelism's own requirement
    forced.validate_before_launch(CausalLMModule(model), 4)
