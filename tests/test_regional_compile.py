"""Regional compilation's core and its callback, in one process: each block compiled once per class, equal to eager
(inductor, fp32, 10 steps), and a block dynamo cannot capture whole compiled in parts with one notice."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.compile import RegionalCompile
from lightning_merak.parallel.regional_compile import (
    CompiledForward,
    compile_blocks,
    compile_counts,
    compiled_forward_of,
)
from lightning_merak.protocols.layout_aware import RecomputedForward
from tests.test_merak3d import MODELS, VOCAB, _module

STEPS, BATCH, SEQ = 10, 4, 16
OPTIMIZER = "sgd"
"""Not Adam, whose normalisation amplifies kernels' rounding (the compiled test's docstring)."""


class _DataDependentBlock(nn.Module):
    """A block whose own forward branches on its data (as a MoE dispatch sizes its work): not capturable whole."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attention(self.norm(hidden))
        if hidden.sum() > 0:  # known only at run time
            return hidden * 2
        return hidden


def _losses(module: pl.LightningModule, callbacks: list[pl.Callback]) -> list[float]:
    class Losses(pl.Callback):
        values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.values.append(float(outputs["loss"]))

    recorder = Losses()
    recorder.values = []
    data = torch.randint(VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder, *callbacks])
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=BATCH))
    return recorder.values


@pytest.mark.distributed  # inductor starts its C++ compiler
def test_callback_compiles_each_block_once_per_class_and_trains_like_eager():
    """SGD: inductor's kernels round differently from eager's (1e-7 of the loss), and Adam turns that rounding on
    near-zero gradients into whole learning-rate steps (2.2e-5 at step 10 on an AVX512 host), which says nothing
    about the compiled blocks."""
    eager = _losses(_module("llama", OPTIMIZER), [])
    torch.compiler.reset()  # graphs an earlier test compiled for this block class would be reused
    before = compile_counts()
    callback = RegionalCompile()
    compiled = _losses(_module("llama", OPTIMIZER), [callback])
    counts = compile_counts() - before
    assert len(callback.compiled) == MODELS["llama"].config["num_hidden_layers"]
    assert all(forward.eager_reason is None for forward in callback.compiled)
    assert counts.graphs == 1, "every block of one class reuses one graph"
    assert counts.graph_breaks == 0 and counts.recompiles == 0
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_a_block_not_captured_whole_is_compiled_in_parts_with_one_notice():
    torch.manual_seed(0)
    blocks = nn.ModuleList(_DataDependentBlock() for _ in range(3))
    reference = [_DataDependentBlock() for _ in range(3)]
    for copy, block in zip(reference, blocks):
        copy.load_state_dict(block.state_dict())
    notices: list[str] = []
    compiled = compile_blocks(((f"layers.{i}", block) for i, block in enumerate(blocks)), backend="eager",
                              notify=notices.append)
    hidden = torch.randn(2, 5, 8)
    out, expected = hidden, hidden
    for block, copy in zip(blocks, reference):
        out, expected = block(out), copy(expected)
    torch.testing.assert_close(out, expected)
    assert [forward.eager_reason is not None for forward in compiled] == [True] * 3
    assert [part.name for part in compiled[0].parts] == ["layers.0.attention", "layers.0.norm"]
    assert all(part.eager_reason is None for forward in compiled for part in forward.parts)
    assert len(notices) == 3 and "layers.0 is not captured whole" in notices[0]
    assert "its parts (attention, norm) are compiled one by one" in notices[0]


def test_compiling_twice_and_under_recomputation_finds_the_same_forward():
    block = nn.Linear(4, 4)
    first = compile_blocks([("block", block)], backend="eager")[0]
    assert compile_blocks([("block", block)], backend="eager")[0] is first
    block.forward = RecomputedForward(block.forward)
    assert compiled_forward_of(block) is first
    hidden = torch.randn(3, 4, requires_grad=True)
    block(hidden).sum().backward()
    assert hidden.grad is not None


def test_callback_refuses_a_model_without_blocks_and_the_merak3d_strategy():
    class NoTrunk(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

    with pytest.raises(ValueError, match="compiles transformer blocks one by one"):
        RegionalCompile()._compile(NoTrunk())

    class Trainer:
        class strategy:
            strategy_name = "merak3d"

    with pytest.raises(ValueError, match=r"Merak3DStrategy\(compile=True\)"):
        RegionalCompile().setup(Trainer(), NoTrunk(), "fit")


@pytest.mark.distributed  # inductor starts its C++ compiler
def test_the_pipeline_profile_times_compiled_blocks_without_installing_them():
    from lightning_merak.parallel.fast_blocks import FastBlocks
    from lightning_merak.parallel.pipeline.trace import trace_model

    model = _module("llama").model
    inputs = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    torch.compiler.reset()
    before = compile_counts()
    trace = trace_model(model, inputs, fast_blocks=FastBlocks(compile=True), profile_repeats=2)
    assert compile_counts().graphs > before.graphs, "the blocks were timed through torch.compile"
    assert len(trace.costs) == MODELS["llama"].config["num_hidden_layers"] + 2
    assert all(cost.forward_s > 0 for cost in trace.costs[1:-1])
    assert all(compiled_forward_of(block) is None for block in model.model.layers), "nothing installed"


@pytest.mark.gpu
def test_compiled_blocks_match_eager_on_a_cuda_device():
    device = torch.device("cuda")
    hidden = torch.randn(4, SEQ, MODELS["llama"].config["hidden_size"], device=device)
    losses = {}
    for compiled in (False, True):
        model = _module("llama").model.to(device)
        if compiled:
            compile_blocks((f"layers.{i}", block) for i, block in enumerate(model.model.layers))
        positions = torch.arange(SEQ, device=device)[None]
        embeddings = model.model.rotary_emb(hidden, positions)
        out = hidden
        for block in model.model.layers:
            out = block(out, position_embeddings=embeddings, position_ids=positions)
            out = out[0] if isinstance(out, tuple) else out
        loss = out.pow(2).mean()
        loss.backward()
        losses[compiled] = loss.item()
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


def test_compile_workers_are_capped_at_the_process_threads_without_cuda(monkeypatch):
    """On CPU inductor's default pool (one worker per core) would compile beside the ranks' training threads."""
    from torch._inductor import config

    from lightning_merak.parallel.regional_compile import share_compile_workers

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(config, "compile_threads", 8)
    share_compile_workers()
    assert config.compile_threads == 1
    monkeypatch.setattr(config, "compile_threads", 8)
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "8")  # the user's count stands
    share_compile_workers()
    assert config.compile_threads == 8
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU run's CPU is free for compiling
    share_compile_workers()
    assert config.compile_threads == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    CompiledForward(torch.nn.Linear(2, 2), "layer")  # every compiled block shares them
    assert config.compile_threads == 1
