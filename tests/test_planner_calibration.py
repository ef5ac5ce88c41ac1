"""``planner_calibration``: a short traced run calibrates the replay predictor, and the planner ranks layouts by it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from lightning_merak.testing import run_distributed

pytestmark = pytest.mark.distributed


def _trace_then_plan(rank: int, world_size: int, out: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.callbacks.profiler import MerakTraceProfiler
    from lightning_merak.strategies.merak3d import Merak3DStrategy
    from tests.test_merak3d import BATCH, _batches, _module

    def trainer(strategy: Merak3DStrategy, **kwargs: Any) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0, **kwargs)

    data = DataLoader(TensorDataset(_batches().reshape(-1, _batches().shape[-1])), batch_size=BATCH)
    profiler = MerakTraceProfiler(dirpath=out, skip_steps=1, steps=2)
    trainer(Merak3DStrategy(data_parallel=2, timeout_s=120), max_steps=4, profiler=profiler).fit(
        _module("llama"), data)
    trace = Path(out) / "merak_trace.json"
    deadline = time.monotonic() + 60
    while not trace.is_file() and time.monotonic() < deadline:  # rank 0 writes it after the ranks gather
        time.sleep(0.1)
    strategy = Merak3DStrategy(pipeline_parallel="auto", tensor_parallel="auto", plan_only=True,
                               planner_calibration=str(trace), timeout_s=120)
    trainer(strategy, max_epochs=1).fit(_module("llama"), data)
    return {"ranked": [(p.layout, p.step_time_s, p.components["analytic_step_s"])
                       for p in strategy.layout_plan.ranked],
            "chosen": (strategy.data_parallel, strategy.pipeline_parallel, strategy.tensor_parallel),
            "trace": str(trace)}


def test_a_traced_run_calibrates_the_predictor_the_planner_ranks_by(tmp_path: Path) -> None:
    from lightning_merak.callbacks.profiler import Trace
    from lightning_merak.callbacks.profiler.lightning_profiler import model_shape
    from lightning_merak.planning.replay.calibration import predictor_from_files
    from tests.test_merak3d import BATCH, SEQ, _module

    results = run_distributed(_trace_then_plan, 2, args=(str(tmp_path),), timeout_s=240)
    assert results[0]["ranked"] == results[1]["ranked"]  # every rank plans alike
    trace = Trace.load(results[0]["trace"])
    assert trace.meta["layout"] == {"dp": 2, "pp": 1, "tp": 1, "micro_batches": 1, "overlap": 1, "cp": 1}
    assert trace.meta["model"]["blocks"] == 4
    shape = model_shape(_module("llama").model, SEQ)
    predictor = predictor_from_files([results[0]["trace"]], shape, BATCH)
    ranked = results[0]["ranked"]
    layouts = {(layout.dp, layout.pp, layout.tp) for layout, _, _ in ranked}
    assert {(2, 1, 1), (1, 2, 1), (1, 1, 2)} <= layouts
    for layout, replayed, analytic in ranked:
        assert replayed == pytest.approx(predictor.planner_step_time(layout, BATCH))
        assert analytic > 0
    per_sample = [seconds / (BATCH * layout.dp) for layout, seconds, _ in ranked]
    assert per_sample == sorted(per_sample)  # ranked by the replay
    best = ranked[0][0]
    assert results[0]["chosen"] == (best.dp, best.pp, best.tp)
