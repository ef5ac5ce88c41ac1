"""Sequence parallelism on families whose attention takes its input more than once (CTRL: value, key, query)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.pipeline.stage import tied_parameter_names
from lightning_merak.parallel.tensor.sequence import find_sequence_parallel_plan
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.strategies.merak3d.block_splits import tensor_parallel_plan
from lightning_merak.testing import assert_traces_match, merge_rank_traces, run_distributed
from tests.test_merak3d import STEPS, VOCAB, _batches, _Recorder, _reference, _ShardedData, _TestModule

CTRL = ModelConfig(name="ctrl", model_type="ctrl", config={
    "n_embd": 32, "n_layer": 2, "n_head": 4, "dff": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0})


def _ctrl_module() -> _TestModule:
    torch.manual_seed(0)
    model = build_causal_lm(CTRL, vocab_size=VOCAB)
    model.config.use_cache = False
    return _TestModule(model)


def test_every_argument_holding_the_column_input_is_gathered():
    """CTRL calls ``multi_head_attention(normed, normed, normed)``: value, key and query must all be gathered,
    or the query, still this rank's slice, sets the sequence length the others are viewed with."""
    from lightning_merak.parallel.pipeline.trace import trace_model
    from lightning_merak.strategies.merak3d.build import call_model

    model = _ctrl_module().model
    trace = trace_model(model, _batches()[0], call_model, profile=False)
    block = model.get_submodule(trace.trunk_path)[0]
    args, kwargs = trace.block_arguments(trace.sample_side_tensors)
    plan = tensor_parallel_plan(block, trace)
    sequence_plan = find_sequence_parallel_plan(block, lambda: block(trace.sample_hidden, *args, **kwargs),
                                                plan.column_groups, plan.row)
    assert sequence_plan.owners == ["multi_head_attention", "ffn"]
    assert sequence_plan.owner_inputs == [(0, 1, 2), (0,)]


def _train_ctrl_rank(rank: int, world_size: int, layout: dict) -> tuple:
    from lightning_merak.distributed.collectives import record_communication

    module = _ctrl_module()
    recorder = _Recorder(tied_parameter_names(_ctrl_module().model))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder],
    )
    with record_communication() as communication:
        trainer.fit(module, datamodule=_ShardedData(0, STEPS))
    return recorder.losses, recorder.gradients, {event["op"] for event in communication.events}


@pytest.mark.distributed
def test_ctrl_with_sequence_parallel_matches_single_process():
    layout = {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 2, "sequence_parallel": True}
    results = run_distributed(_train_ctrl_rank, 2, args=(layout,), timeout_s=120)
    assert all("reduce_scatter" in ops for _, _, ops in results)  # the blocks really ran sequence-split
    merged = merge_rank_traces([(losses, gradients) for losses, gradients, _ in results])
    reference = _reference("ctrl", module=_ctrl_module())
    # A key bias shifts every score of a query alike, which softmax ignores: its gradient is rounding noise
    # (~1e-12), compared against the largest gradient of its step instead of its own.
    for expected, actual in zip(reference.gradients, merged.gradients, strict=True):
        largest = max(float(gradient.abs().max()) for gradient in expected.values())
        for name in [name for name in expected if name.endswith("Wk.bias")]:
            assert float((actual.pop(name) - expected.pop(name)).abs().max()) <= 1e-6 * largest, name
    assert_traces_match(reference, merged, loss_rtol=1e-5, grad_rtol=1e-4)
