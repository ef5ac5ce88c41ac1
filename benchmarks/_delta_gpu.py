"""The GPU leg of ``python -m benchmarks.delta --device cuda``: DeltaMemory's host tier on one GPU.

Same configurations as the CPU leg, on the GPU: ``none``; ``checkpoint`` (``torch.utils.checkpoint``
around every block); ``offload-all`` (``torch.autograd.graph.save_on_cpu(pin_memory=True)``: every
saved activation copied to pinned host memory and back, synchronously, no prefetch); ``delta``
(DeltaMemory's plan over swap to pinned host memory on a side stream, and recompute, within a
budget of ``--delta-budget-fraction`` of ``none``'s saved activations). Memory is the CUDA
allocator's peak (``max_memory_allocated``) above what was allocated before the first step (model,
gradients and data), over every step including DELTA's warm-up; step time the median of the timed
steps, each ended by ``torch.cuda.synchronize``. One process runs the configurations one after another;
the allocator's peak is reset between them.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.delta import train_step
from benchmarks.report import cuda_device_name, print_table, write_json

MIB = 2**20
CONFIGS = ("none", "checkpoint", "offload-all", "delta")
WARMUP = 2
DEVICE = "cuda"


@dataclass(frozen=True)
class GpuSetting:
    """The GPU leg's model and batch (BenchGPT: pre-norm blocks, SDPA attention, 4× MLP)."""

    hidden: int
    layers: int
    heads: int
    batch: int
    seq: int
    steps: int
    vocab: int = 8192


GPU_FULL = GpuSetting(hidden=2048, layers=12, heads=16, batch=8, seq=1024, steps=6)
GPU_QUICK = GpuSetting(hidden=1024, layers=8, heads=8, batch=8, seq=512, steps=4)


def _saved_peak_bytes(model: torch.nn.Module, data: torch.Tensor) -> int:
    """Peak bytes of activations saved for backward in one unmanaged step (DELTA's own ledger)."""
    from lightning_merak.callbacks.delta.ledger import ResidentLedger
    from lightning_merak.callbacks.delta.profiler import SavedTensorTracker

    ledger = ResidentLedger()
    tracker = SavedTensorTracker(ledger)
    tracker.exclude_module_state(model)
    ledger.start_step()
    with tracker.hooks("all"):
        loss = model(data)
    loss.backward()
    model.zero_grad(set_to_none=False)
    return ledger.peak_bytes


def run_config(config: str, setting: GpuSetting, budget_bytes: int) -> dict[str, Any]:
    """Train ``setting.steps`` timed steps (after warm-up) under ``config``; its memory and time."""
    from torch.utils.checkpoint import checkpoint

    from lightning_merak.callbacks.delta.blocks import discover_blocks
    from lightning_merak.callbacks.delta.budget import parse_budget
    from lightning_merak.callbacks.delta.runtime import ManagerOptions, MemoryManager
    from lightning_merak.testing.delta_models import BenchGPT

    device = torch.device(DEVICE)
    torch.manual_seed(0)
    model = BenchGPT(vocab=setting.vocab, hidden=setting.hidden, layers=setting.layers, heads=setting.heads).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randint(0, setting.vocab, (setting.batch, setting.seq),
                         generator=torch.Generator().manual_seed(1)).to(device)
    small = data[:max(1, setting.batch // 4)]
    model(small[:1, :8]).backward()  # gradients exist before measuring
    optimizer.zero_grad(set_to_none=False)
    manager = None
    if config == "checkpoint":
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    elif config == "delta":
        options = ManagerOptions(budget=parse_budget(budget_bytes), swap_tier="host", warmup_steps=WARMUP)
        manager = MemoryManager(discover_blocks(model), options, log=print)
        manager.start(model, device)
    offload = config == "offload-all"

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    times = []
    for step in range(WARMUP + setting.steps):
        ids = small if (manager is not None and step < WARMUP) else data
        torch.cuda.synchronize()
        start = time.perf_counter()
        saved_tensors = torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext()
        train_step(model, optimizer, ids, manager, saved_tensors)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    row: dict[str, Any] = {"config": config, "batch": setting.batch,
                           "activation_peak_MiB": (torch.cuda.max_memory_allocated() - before) / MIB,
                           "step_s": statistics.median(times[WARMUP:])}
    if manager is not None:
        report = manager.step_reports[-1]
        row.update(saved_peak_MiB=report.peak_saved_bytes / MIB, budget_MiB=manager.budget_bytes / MIB,
                   swapped_blocks=report.swapped_blocks, recomputed_blocks=report.recomputed_blocks,
                   exposed_copy_s=report.exposed_copy_s)
        manager.close()
    del model, optimizer, data, small
    torch.cuda.empty_cache()
    return row


def gpu_main(out: Path, quick: bool, budget_fraction: float) -> int:
    """Run every configuration on the GPU and write ``out``; 1 when one failed."""
    device_name = cuda_device_name()
    started = time.perf_counter()
    setting = GPU_QUICK if quick else GPU_FULL
    print(f"GPU leg on {device_name}: BenchGPT {setting}", flush=True)
    torch.manual_seed(0)
    probe = run_config("none", setting, 0)
    from lightning_merak.testing.delta_models import BenchGPT

    model = BenchGPT(vocab=setting.vocab, hidden=setting.hidden, layers=setting.layers,
                     heads=setting.heads).to(DEVICE)
    data = torch.randint(0, setting.vocab, (setting.batch, setting.seq),
                         generator=torch.Generator().manual_seed(1)).to(DEVICE)
    saved_peak = _saved_peak_bytes(model, data)
    del model, data
    torch.cuda.empty_cache()
    budget = int(budget_fraction * saved_peak)
    rows, failed = [dict(probe, saved_peak_MiB=saved_peak / MIB)], []
    for config in CONFIGS[1:]:
        try:
            rows.append(run_config(config, setting, budget))
        except Exception as error:  # a failed configuration is a row, and the script's exit status
            rows.append({"config": config, "error": f"{type(error).__name__}: {error}"})
            failed.append(config)
        print(f"  {rows[-1]}", flush=True)
    none = rows[0]
    for row in rows:
        if row.get("error") is None:
            row["activation_vs_none"] = row["activation_peak_MiB"] / none["activation_peak_MiB"]
            row["time_vs_none"] = row["step_s"] / none["step_s"]
    print_table(rows, ["config", "batch", "activation_peak_MiB", "activation_vs_none", "step_s", "time_vs_none",
                       "error"])
    delta = next((row for row in rows if row["config"] == "delta" and row.get("error") is None), None)
    targets = None if delta is None else {
        "activation_reduction_ge_60pct_allocated": 1 - delta["activation_vs_none"] >= 0.6,
        "step_time_overhead_le_10pct": delta["time_vs_none"] <= 1.10,
    }
    wall = time.perf_counter() - started
    path = write_json(out, rows, label="measured", benchmark="delta", quick=quick, device=device_name,
                      setting=asdict(setting), delta_budget_fraction=budget_fraction, delta_budget_MiB=budget / MIB,
                      memory="CUDA max_memory_allocated above the start", targets=targets, wall_s=round(wall, 1))
    print(f"targets: {targets}\nwrote {path} in {wall:.0f} s")
    return 1 if failed else 0
