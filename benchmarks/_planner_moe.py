"""``python -m benchmarks.planner --moe``: the planner's predicted step against measured steps under ``merak_ep``.

A small Qwen3-MoE (16 experts, top-8) trains with ``moe.experts=merak_ep`` in two fixed layouts whose sharding
is left to the planner (``data_parallel_sharding="auto"``), so each run profiles the machine, the model's MoE
layers and the all-to-all seconds before it trains, and predicts its own layout with the experts' exchange priced:
dp=2 (2 ranks, ep=2) and pp=2 × dp=2 (4 ranks, ep=2 per stage). The layouts alternate round by round (one torch
thread per rank); a run's measured step is the median step of its slowest rank after warm-up, and a layout's
figures are medians over rounds. Error = predicted / measured − 1, paired per run. Other load on the machine skews
both sides; nothing is simulated but the prediction.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.merak3d import Workload, _quiet_lightning, _StepTimer
from benchmarks.report import default_out, print_table, write_json
from lightning_merak.testing import run_distributed

FAMILY, HIDDEN, INTERMEDIATE = "qwen3_moe", 128, 128
WORKLOAD = Workload(hidden=HIDDEN, layers=4, vocab=1024, seq=64, global_batch=8)
"""``global_batch`` is each data-parallel replica's batch (the dataloader's batch_size); the model is Qwen3-MoE."""
LAYOUTS = {
    "dp2 ep2": (2, {"data_parallel": 2, "pipeline_parallel": 1, "tensor_parallel": 1}),
    "pp2 dp2 ep2": (4, {"data_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 1, "micro_batches": 4}),
}
"""name → (ranks, merak3d degrees); the sharding is planned (only ``"none"`` runs with merak_ep)."""
WARMUP = 2
RANK_TIMEOUT_S = 400.0


def _run_rank(rank: int, world_size: int, merak: dict[str, Any], steps: int) -> dict[str, Any]:
    from benchmarks.planner import _ReplicaData
    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.modules.config import OptimConfig
    from lightning_merak.plugins.moe.experts import tiny_moe_model
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    _quiet_lightning()
    model = tiny_moe_model(FAMILY, hidden=HIDDEN, layers=WORKLOAD.layers, vocab=WORKLOAD.vocab, seed=0,
                           intermediate=INTERMEDIATE)
    model.config.use_cache = False
    timer = _StepTimer()
    strategy = Merak3DStrategy(**merak, data_parallel_sharding="auto", timeout_s=RANK_TIMEOUT_S)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[ExpertParallelCallback(ep_size=2, log_every_n_steps=10**6), timer],  # the layouts are named ep2
    )
    torch.manual_seed(0)
    trainer.fit(CausalLMModule(model, OptimConfig(warmup_steps=1)),
                datamodule=_ReplicaData(WORKLOAD, steps))
    choice = strategy.layout_choice
    return {"step_s": timer.step_s, "predicted_s": choice.step_time_s, "components": dict(choice.components),
            "ep": choice.layout.ep}


def _measure(name: str, steps: int) -> dict[str, Any]:
    ranks, merak = LAYOUTS[name]
    results = run_distributed(_run_rank, ranks, args=(merak, steps), timeout_s=RANK_TIMEOUT_S, threads_per_rank=1)
    slowest = [max(step) for step in zip(*(result["step_s"] for result in results))]
    first = results[0]
    return {"measured_s": statistics.median(slowest[WARMUP:]), "predicted_s": first["predicted_s"],
            "components": first["components"], "ep": first["ep"]}


def main(quick: bool, out: Path | None) -> int:
    rounds, steps = (1, WARMUP + 4) if quick else (3, WARMUP + 8)
    out = out or default_out("planner_moe", quick)
    started = time.perf_counter()
    workload = (f"{FAMILY} hidden {HIDDEN}, expert intermediate {INTERMEDIATE}, 16 experts top-8, "
                f"{WORKLOAD.layers} layers, vocab {WORKLOAD.vocab}, seq {WORKLOAD.seq}, batch {WORKLOAD.global_batch} "
                "per replica")
    print(f"planner --moe: {workload}; {rounds} round(s), layouts alternate", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in LAYOUTS}
    for round_index in range(rounds):
        for name in LAYOUTS:
            run = _measure(name, steps)
            runs[name].append(run)
            print(f"  round {round_index + 1}/{rounds} {name}: predicted {1e3 * run['predicted_s']:.0f} ms "
                  f"(exchange {1e3 * run['components']['expert_all_to_all']:.0f} ms), measured "
                  f"{1e3 * run['measured_s']:.0f} ms ({time.perf_counter() - started:.0f} s)", flush=True)
    rows = []
    for name, done in runs.items():
        predicted = statistics.median(run["predicted_s"] for run in done)
        measured = statistics.median(run["measured_s"] for run in done)
        middle = sorted(done, key=lambda run: run["predicted_s"])[(len(done) - 1) // 2]
        rows.append({"layout": name, "ep": middle["ep"], "predicted_s": predicted, "measured_s": measured,
                     "error": predicted / measured - 1.0,
                     "paired_error": statistics.median(run["predicted_s"] / run["measured_s"] - 1.0 for run in done),
                     "predicted_rounds_s": [run["predicted_s"] for run in done],
                     "measured_rounds_s": [run["measured_s"] for run in done],
                     "predicted_components_s": middle["components"]})
    print_table([{"layout": row["layout"], "predicted ms": round(1e3 * row["predicted_s"], 1),
                  "exchange ms": round(1e3 * row["predicted_components_s"]["expert_all_to_all"], 1),
                  "measured ms": round(1e3 * row["measured_s"], 1), "error": f"{100 * row['error']:+.1f}%",
                  "paired error": f"{100 * row['paired_error']:+.1f}%"} for row in rows])
    write_json(out, rows, "measured", workload=workload, rounds=rounds, steps=steps, warmup=WARMUP,
               predictions="each run's own plan (data_parallel_sharding='auto', the degrees fixed): its profile of "
                           "the machine, the MoE layers and the all-to-all, taken seconds before it trains",
               summary={"max_abs_error": max(abs(row["error"]) for row in rows),
                        "max_abs_paired_error": max(abs(row["paired_error"]) for row in rows)},
               mode="quick" if quick else "full", wall_s=time.perf_counter() - started)
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s)")
    return 0
