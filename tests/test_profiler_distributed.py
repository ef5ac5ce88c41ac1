"""MerakTraceProfiler on real gloo ranks: DDP, a merak3d pipeline and tensor parallelism with sub-batches record every
op, and the replay matches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.profiler import MerakTraceProfiler, Trace, WhatIf, replay_trace, summary_numbers
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.planning.replay.synthesize import LayoutSpec, _rank_breakdown
from lightning_merak.testing import run_distributed

pytestmark = pytest.mark.distributed

VOCAB, SEQ, BATCH, STEPS = 128, 16, 4, 5
MODEL = ModelConfig(name="gpt2", model_type="gpt2", config={
    "n_embd": 32, "n_layer": 2, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})


def _train(rank: int, world_size: int, strategy_name: str, out: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_merak.strategies.merak3d import Merak3DStrategy

    torch.manual_seed(0)
    model = build_causal_lm(MODEL, vocab_size=VOCAB)
    model.config.use_cache = False
    module = CausalLMModule(model)
    strategy = (DDPStrategy(process_group_backend="gloo") if strategy_name == "ddp"
                else Merak3DStrategy(tensor_parallel=2, tp_overlap=2) if strategy_name == "merak3d_tp2_k2"
                else Merak3DStrategy(pipeline_parallel=2, micro_batches=2))
    profiler = MerakTraceProfiler(dirpath=out, skip_steps=1, steps=3, untraced_steps=1)
    data = torch.randint(VOCAB, (STEPS * BATCH * world_size, SEQ), generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         profiler=profiler, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=BATCH))
    return {"summary": profiler.summary(), "paths": {k: str(v) for k, v in profiler.paths.items()}}


@pytest.mark.parametrize("strategy_name", ["ddp", "merak3d_pp2", "merak3d_tp2_k2"])
def test_profiler_records_and_replays(tmp_path: Path, strategy_name: str) -> None:
    results = run_distributed(_train, 2, args=(strategy_name, str(tmp_path)), timeout_s=120)
    assert "replayed" in results[0]["summary"]
    trace = Trace.load(results[0]["paths"]["trace"])
    assert trace.world_size == 2 and trace.steps() == [0, 1, 2]
    assert len(trace.meta["untraced_step_s"]) == 1  # the fifth step, gathered after it (its slowest rank)
    for rank in trace.ranks:
        categories = {s.category for s in rank.spans}
        assert {"step", "FW", "BW", "UPDATE"} <= categories
    ops = {c.op for r in trace.ranks for c in r.comms}
    if strategy_name == "ddp":
        assert "ddp_all_reduce" in ops
    elif strategy_name == "merak3d_pp2":
        assert {"isend", "irecv"} <= ops
    else:
        # each sub-batch times its own blocks, forward and backward, and its waits for the turn
        for rank in trace.ranks:
            for category in ("FW", "BW"):
                threads = {(s.step, s.name, s.thread) for s in rank.spans if s.is_block(category)}
                assert threads == {(step, f"block {b}", f"sub-batch {i}") for step in (0, 1, 2) for b in (0, 1)
                                   for i in (0, 1)}
            assert {s.thread for s in rank.spans if s.category == "WAIT"} == {"sub-batch 0", "sub-batch 1"}
        for totals in _rank_breakdown(trace, LayoutSpec(1, 1, 2, 1, BATCH, overlap=2)):
            assert 0.0 < totals["block"] < totals["FW"]  # the sub-batches' blocks, less their waits for the turn
            assert 0.0 < totals["block BW"] < totals["BW"]
            assert totals["block FW timed"] == pytest.approx(totals["block"])
    assert any(s.name.startswith("block") for r in trace.ranks for s in r.spans)
    assert Path(results[0]["paths"]["perfetto"]).stat().st_size > 0
    # replaying the unmodified trace reproduces the traced steps: dPRO's validation rule (within 5%) where the steps
    # repeat, widened to the steps' own spread where they do not (ranks sharing two cores with the other test worker
    # measured steps 25-50% apart within one run, and the replay 7% off)
    step_times = trace.step_times().values()
    assert abs(summary_numbers(trace)["replay_error"]) < max(0.05, max(step_times) / min(step_times) - 1.0)
    assert replay_trace(trace, WhatIf(bandwidth_ratio=0.5)).step_time >= replay_trace(trace).step_time
