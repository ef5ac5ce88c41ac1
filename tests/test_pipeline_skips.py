"""Blocks that read earlier blocks' outputs (value residuals, U-Net long skips) split into pipeline stages.

The trace finds each skip value by identity, every stage boundary between its producer and its last reader
carries it (and its gradient back), and the partitioners count its bytes. Trained under merak3d on real gloo
ranks, losses and every gradient equal one process's.
"""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_merak import testing
from lightning_merak.parallel.materialize import copy_full_tensors
from lightning_merak.parallel.pipeline import BlockCost, partition_autopipe, simulate_schedule
from lightning_merak.parallel.pipeline.costs import build_partition
from lightning_merak.parallel.pipeline.recording import SkipValue
from lightning_merak.parallel.pipeline.trace import TraceError, trace_model
from lightning_merak.planning.planner import Layout, predict
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.strategies.merak3d.build import check_skips_split
from tests.test_merak3d import VOCAB, _Recorder, _reference, _ShardedData, _TestModule
from tests.test_pipeline_shared_modules import chained_stages_match_the_model
from tests.test_planner_core import SLOW, space, synthetic_model

SEQ, WIDTH = 8, 16
TRAINED_STEPS = 3
"""Steps compared at 1e-5: the micro-batches sum gradients in another order, and SGD at lr 0.5 grows that
rounding past 1e-5 by the fourth step (1.07e-5 on block 0's mixing weights)."""


class _ValueBlock(nn.Module):
    """Mixes the embedding output ``x0`` into its input and block 0's values into its own (value residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.value = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.mix = nn.Parameter(torch.empty(3, WIDTH))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Also what initialises the mix of a block built on the meta device once it is materialised."""
        with torch.no_grad():
            self.mix.copy_(torch.tensor([0.5, 0.5, 0.3]).repeat_interleave(WIDTH).view(3, WIDTH))

    def forward(self, x: torch.Tensor, x0: torch.Tensor,
                first_value: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.mix[0] * x + self.mix[1] * x0
        value = self.value(self.norm(x))
        if first_value is not None:
            value = value + self.mix[2] * first_value
        return x + self.out(torch.tanh(value)), value


class _Net(nn.Module):
    """An embedding, ``depth`` blocks of ``block`` and a head; subclasses call the blocks."""

    def __init__(self, block: type[nn.Module], depth: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)


class ValueResidualNet(_Net):
    """Block i > 0 reads block 0's values (and every block the embedding output)."""

    def __init__(self) -> None:
        super().__init__(_ValueBlock, depth=6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = x0 = self.embedding(ids)
        first = None
        for block in self.blocks:
            x, value = block(x, x0, first_value=first)
            first = value if first is None else first
        return self.head(self.norm(x))


class _UBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Parameter(torch.empty(WIDTH))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.gate.fill_(0.7)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if skip is not None:
            x = x + self.gate * skip
        return x + self.linear(torch.tanh(self.norm(x)))


class UNet(_Net):
    """Block n-1-i reads block i's output (i < n/2), U-Net style."""

    def __init__(self) -> None:
        super().__init__(_UBlock, depth=8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        half = len(self.blocks) // 2
        skips = []
        for block in self.blocks[:half]:
            x = block(x)
            skips.append(x)
        for block in self.blocks[half:]:
            x = block(x, skips.pop())
        return self.head(self.norm(x))


class _MixedOutside(UNet):
    """Mixes the skip into the hidden state in the model's forward, outside any block."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = first = self.blocks[0](self.embedding(ids))
        for block in self.blocks[1:]:
            x = block(x + first)
        return self.head(self.norm(x))


MODELS = {"value_residual": ValueResidualNet, "unet": UNet}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def test_trace_finds_each_skip_value_and_the_boundaries_it_crosses():
    ids = torch.randint(VOCAB, (2, SEQ))
    value = trace_model(_model("value_residual"), ids, profile=False)
    assert value.skips == (SkipValue(producer=0, leaf=1, consumers=(1, 2, 3, 4, 5)),)
    assert value.side_tensor_count == 1  # x0, made before the blocks
    assert [value.skips_across(block) for block in range(7)] == [(), (0,), (0,), (0,), (0,), (0,), ()]

    unet = trace_model(_model("unet"), ids, profile=False)
    assert sorted((skip.producer, skip.consumers) for skip in unet.skips) == [
        (0, (7,)), (1, (6,)), (2, (5,)), (3, (4,))]
    assert [len(unet.skips_across(block)) for block in range(9)] == [0, 1, 2, 3, 4, 3, 2, 1, 0]
    hidden = unet.sample_hidden.numel() * 4
    assert unet.boundary_bytes(4) == 5 * hidden  # the hidden state and four skips in the middle


@pytest.mark.parametrize("name", list(MODELS))
def test_a_meta_model_traces_the_same_skips(name):
    """On the meta device the blocks run shapes only: the skips are found by identity all the same, and their
    samples are real tensors of the recorded shapes."""
    ids = torch.randint(VOCAB, (2, SEQ))
    real = trace_model(_model(name), ids)
    with torch.device("meta"):
        model = MODELS[name]()
    traced = trace_model(model, ids)
    assert traced.skips == real.skips and traced.block_signatures == real.block_signatures
    assert [cost.output_bytes for cost in traced.costs] == [cost.output_bytes for cost in real.costs]
    assert [(t.shape, t.dtype, t.is_meta) for t in traced.sample_skips] == [
        (t.shape, t.dtype, False) for t in real.sample_skips]


def test_stage_costs_count_the_skip_bytes_crossing_each_boundary():
    ids = torch.randint(VOCAB, (2, SEQ))
    trace = trace_model(_model("unet"), ids)
    hidden = trace.sample_hidden.numel() * 4
    assert [cost.output_bytes for cost in trace.costs] == [hidden * n for n in (1, 2, 3, 4, 5, 4, 3, 2, 1, 1)]
    partition = build_partition(trace.costs, (0, 3, 5, 7), "custom")
    assert partition.boundary_bytes == (3 * hidden, 5 * hidden, 3 * hidden)


def test_autopipe_prices_the_bytes_each_cut_sends():
    """Equal blocks, a cut sending 10x the bytes elsewhere: with a per-byte link cost AutoPipe moves off it."""
    blocks = [BlockCost(f"layers.{i}", 1.0, 2.0, 10, 1000 if i == 1 else 100, 10) for i in range(4)]
    assert partition_autopipe(blocks, 2, 4).boundaries == (0, 2)
    priced = partition_autopipe(blocks, 2, 4, p2p_s_per_byte=1e-2)
    assert priced.boundaries in ((0, 1), (0, 3))
    per_boundary = simulate_schedule([3.0, 6.0], [6.0, 12.0], 4, "1f1b", p2p_s=[0.5])
    assert per_boundary.iteration_s == simulate_schedule([3.0, 6.0], [6.0, 12.0], 4, "1f1b", p2p_s=0.5).iteration_s


def test_the_planner_prices_the_skip_values_each_cut_sends():
    """A U-Net profile (0..4 skip values crossing a cut, as the trace reports them) predicts a slower
    pipelined step than the same blocks without skips on a slow link; one stage sends nothing."""
    plain = synthetic_model(num_blocks=8)
    hidden = plain.hidden_bytes_per_sample
    unet = dataclasses.replace(plain, carried_bytes_per_sample=tuple(
        hidden * count for count in (0, 1, 2, 3, 4, 3, 2, 1, 0)))
    search = space(world_size=2, tp_degrees_allowed=(1,), max_pipeline_stages=2)
    piped, whole = Layout(1, 2, 1, 4, 1, 0.0), Layout(2, 1, 1, 4, 1, 0.0)
    assert predict(piped, unet, SLOW, search).step_time_s > predict(piped, plain, SLOW, search).step_time_s
    assert predict(whole, unet, SLOW, search).step_time_s == predict(whole, plain, SLOW, search).step_time_s
    assert predict(piped, unet, SLOW, search).memory_bytes >= predict(piped, plain, SLOW, search).memory_bytes
    with pytest.raises(ValueError, match="carried_bytes_per_sample needs num_blocks"):
        dataclasses.replace(plain, carried_bytes_per_sample=(0, 1))


@pytest.mark.parametrize("boundaries", [(0, 3, 5, 7), (0, 1, 9), (0, 2, 3, 6)])
def test_chained_stages_reproduce_loss_and_gradients(boundaries):
    """Stages run one after another in one process, each boundary's tensors cut from the graph and their
    gradients handed back by hand: as one model."""
    chained_stages_match_the_model(_model("unet"), boundaries, torch.randint(VOCAB, (2, SEQ)))


class _SkipIntoHead(UNet):
    """Adds block 0's output to the logits' input: a skip into the head, not into a block."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = first = self.blocks[0](self.embedding(ids))
        for block in self.blocks[1:]:
            x = block(x)
        return self.head(self.norm(x) + first)


def test_unsupported_skips_are_refused_with_the_fix():
    with pytest.raises(TraceError, match="compute the mix inside the block that reads it"):
        trace_model(_MixedOutside(), torch.randint(VOCAB, (1, SEQ)), profile=False)
    with pytest.raises(TraceError, match="head reads an output of block 0.*pass it to the last block"):
        trace_model(_SkipIntoHead(), torch.randint(VOCAB, (1, SEQ)), profile=False)


def test_tensor_parallel_splits_the_skips_would_break_are_refused():
    """Block 0's values leave a column-parallel layer split by heads; a U-Net's skips are whole hidden states."""
    ids = torch.randint(VOCAB, (2, SEQ))
    value, unet = (trace_model(_model(name), ids, profile=False) for name in ("value_residual", "unet"))
    with pytest.raises(ValueError, match="read an output of block 0 other than its hidden state.*tensor_parallel=1"):
        check_skips_split(value, 2, sequence_parallel=False)
    check_skips_split(value, 1, sequence_parallel=False)
    check_skips_split(unet, 2, sequence_parallel=False)
    with pytest.raises(ValueError, match="set sequence_parallel=False"):
        check_skips_split(unet, 2, sequence_parallel=True)


# Trained under merak3d -------------------------------------------------------------------------------------

class _BuiltOnMeta(_TestModule):
    """Built on the meta device in ``configure_model``; each rank fills its stage from the reference's weights."""

    def __init__(self, name: str) -> None:
        super().__init__(None, model_factory=MODELS[name])
        self.name = name

    def load_pretrained_weights(self, tensors, layout_changes) -> None:
        copy_full_tensors(tensors, layout_changes, _model(self.name).state_dict())


def _train_rank(rank: int, world_size: int, runs: list[tuple[str, dict, bool]]) -> list[tuple[list, list]]:
    """Each ``(model, layout, on meta)`` of ``runs`` trained in turn on these ranks; every run's losses and
    gradients."""
    results = []
    for name, layout, on_meta in runs:
        recorder = _Recorder([])
        trainer = pl.Trainer(
            accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120),
            max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[recorder],
            use_distributed_sampler=False)
        module = _BuiltOnMeta(name) if on_meta else _TestModule(_model(name))
        trainer.fit(module, datamodule=_ShardedData(0, TRAINED_STEPS))
        results.append((recorder.losses, recorder.gradients))
    return results


def _layout(pp: int, schedule: str, **extra: int) -> dict:
    return {"data_parallel": 1, "pipeline_parallel": pp, "tensor_parallel": 1, "micro_batches": 4,
            "schedule": schedule, "partition": "uniform", **extra}


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "layouts"), [
    (2, [_layout(2, "1f1b")] + [_layout(2, name, virtual_stages=2)
                                for name in ("interleaved_1f1b", "interleaved_zero_bubble")]),
    (4, [_layout(4, "gpipe"), _layout(4, "shifted_critical_path"), {**_layout(4, "1f1b"), "on_meta": True}]),
], ids=["pp2-1f1b-interleaved-zero-bubble", "pp4-gpipe-shifted-meta"])
def test_skips_across_stages_match_single_process(world_size, layouts):
    """Both models on every schedule: the skip values cross one boundary (pp=2) or pass through the stages
    between (pp=4, and 4 interleaved stages on 2 ranks, the zero-bubble one splitting each backward); at pp=4
    also built on the meta device, traced there and each stage materialised and loaded alone."""
    runs = [(name, {k: v for k, v in layout.items() if k != "on_meta"}, layout.get("on_meta", False))
            for layout in layouts for name in MODELS]
    results = testing.run_distributed(_train_rank, world_size, args=(runs,), timeout_s=300)
    for index, (name, *_) in enumerate(runs):
        candidate = testing.merge_rank_traces([rank_results[index] for rank_results in results])
        reference = _reference(name, module=_TestModule(_model(name)))
        reference = testing.TrainingTrace(reference.losses[:TRAINED_STEPS], reference.gradients[:TRAINED_STEPS])
        testing.assert_traces_match(reference, candidate, loss_rtol=1e-5, grad_rtol=1e-5)
