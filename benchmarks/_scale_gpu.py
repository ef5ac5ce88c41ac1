"""The GPU leg of ``python -m benchmarks.scale --device cuda``: one GPU, one rank per leg.

A lent machine has one GPU and NCCL refuses two ranks on one device, so the layouts that need
several ranks (dp2, pp2, tp2, pp2×tp2) cannot run there; this leg measures what one GPU can
show, on a model about a hundred times the CPU run's:

1. *Memory.* merak3d (meta init through ``configure_model``, materialised on the GPU), Lightning's
   ModelParallelStrategy (FSDP2, ``init_module(empty_init=True)``) and DDP (built whole, then moved),
   each training a few fp32 steps in a fresh process. ``peak_over_ideal`` is the CUDA allocator's peak
   (``max_memory_allocated`` above what existed before the model) over parameters + gradients + AdamW's
   two moments + the activations autograd saves, measured on the GPU itself (its attention kernels
   decide what is saved).
2. *Load.* ``save_pretrained`` writes the model (fp32); ``from_pretrained(DIR, device_map="cuda")`` and
   merak3d's pretrained seam (``lightning_merak.hf.load_pretrained`` into the rank's shard on the
   GPU) are timed; logits of one batch compared.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._scale_ranks import (
    MIB,
    RANK_TIMEOUT_S,
    Leg,
    Workload,
    from_pretrained_rank,
    load_rank,
    measure_activations,
    train_rank,
)
from benchmarks.report import cuda_device_name, error_line, print_table, write_json
from lightning_merak.testing import run_distributed
from lightning_merak.testing.distributed import DistributedRunError

GPU_LEGS = (
    Leg("merak3d dp1 (GPU)", "merak3d", 1, {"data_parallel": 1}, accelerator="cuda"),
    Leg("FSDP2 (ModelParallelStrategy, GPU)", "fsdp2", 1, accelerator="cuda"),
    Leg("DDP (GPU)", "ddp", 1, accelerator="cuda"),
)
GPU_WORKLOAD = Workload(hidden=2048, layers=16, vocab=32000, seq=1024, global_batch=8)
GPU_QUICK_WORKLOAD = Workload(hidden=1024, layers=8, vocab=32000, seq=512, global_batch=8)
STEPS = 4
BACKEND = "nccl"



def _memory_row(leg: Leg, workload: Workload, activations: dict[str, float]) -> dict[str, Any]:
    row: dict[str, Any] = {"section": "memory", "leg": leg.name, "params_m": workload.parameters() / 1e6}
    try:
        (rank,) = run_distributed(train_rank, 1, args=(leg, workload, STEPS), timeout_s=RANK_TIMEOUT_S,
                                  backend=BACKEND)
    except DistributedRunError as error:
        row["error"] = error_line(error)
        print(f"  {leg.name}: FAILED: {row['error']}", flush=True)
        return row
    used = rank["peak_mb"] - rank["baseline_mb"]
    per_sample = len(rank["layers_held"]) * activations["per_layer"] + (activations["head"] if rank["has_head"] else 0)
    ideal = (4 * rank["param_bytes"] + rank["micro_batch"] * per_sample) / MIB
    step_s = rank["step_s"][1:] or rank["step_s"]
    row.update(used_mb=used, ideal_mb=ideal, peak_over_ideal=used / ideal,
               reserved_peak_mb=rank.get("cuda_reserved_peak_mb"), param_mb=rank["param_bytes"] / MIB,
               step_s=sum(step_s) / len(step_s), error=None)
    print(f"  {leg.name}: peak {used:.0f} MiB, ideal {ideal:.0f} MiB, peak/ideal {used / ideal:.2f}, "
          f"step {row['step_s']:.3f} s", flush=True)
    return row


def _load_rows(workload: Workload) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(workload.vocab, (2, workload.seq), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory(prefix="merak-scale-gpu-") as tmp:
        source = Path(tmp) / "source"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(workload.config()).save_pretrained(source)
        size = sum(file.stat().st_size for file in source.glob("*.safetensors"))
        (reference,) = run_distributed(from_pretrained_rank, 1, args=(str(source), tokens, "cuda"),
                                       timeout_s=RANK_TIMEOUT_S, backend=BACKEND)
        rows = [{"section": "load", "leg": "from_pretrained (device_map=cuda)", "load_s": reference["load_s"],
                 "gb_per_s": size / reference["load_s"] / 1e9, "logits_rel_err": 0.0, "error": None}]
        try:
            (ours,) = run_distributed(load_rank, 1, timeout_s=RANK_TIMEOUT_S, backend=BACKEND,
                                      args=(str(source), {"data_parallel": 1}, tokens, None, "cuda"))
        except DistributedRunError as error:
            rows.append({"section": "load", "leg": "merak3d dp1 (GPU)", "error": error_line(error)})
            return rows
    rel_err = float((ours["logits"] - reference["logits"]).abs().max() / reference["logits"].abs().max())
    rows.append({"section": "load", "leg": "merak3d dp1 (GPU)", "load_s": ours["load_s"],
                 "gb_per_s": size / ours["load_s"] / 1e9, "logits_rel_err": rel_err, "error": None})
    return rows


def gpu_main(out: Path, quick: bool) -> int:
    """Run the GPU leg and write ``out``; 1 when a leg failed (none may refuse: one GPU runs them all)."""
    device_name = cuda_device_name()
    started = time.perf_counter()
    workload = GPU_QUICK_WORKLOAD if quick else GPU_WORKLOAD
    print(f"GPU leg on {device_name}: {workload.describe()}, {STEPS} fp32 steps per leg", flush=True)
    activations = measure_activations(workload, 1, device="cuda")
    torch.cuda.empty_cache()
    memory = [_memory_row(leg, workload, activations) for leg in GPU_LEGS]
    print("load:", flush=True)
    loads = _load_rows(workload)
    print("\nMemory (CUDA allocator peak; measured)")
    print_table(memory, ["leg", "params_m", "used_mb", "ideal_mb", "peak_over_ideal", "step_s", "error"])
    print("\nLoad (measured)")
    print_table(loads, ["leg", "load_s", "gb_per_s", "logits_rel_err", "error"])
    merak = next((row for row in memory if row["leg"].startswith("merak3d") and row.get("error") is None), None)
    rel_errs = [row["logits_rel_err"] for row in loads if row.get("error") is None and row["leg"].startswith("merak")]
    wall_s = time.perf_counter() - started
    path = write_json(
        out, [*memory, *loads], label="measured", benchmark="scale", device=device_name, backend="one rank per leg",
        quick=quick, workload=workload.describe(), steps=STEPS,
        activations_per_sample_mb={name: value / MIB for name, value in activations.items()},
        peak_over_ideal=merak["peak_over_ideal"] if merak else None,
        logits_max_rel_err=max(rel_errs) if rel_errs else None,
        not_run="dp2, pp2, tp2 and pp2xtp2: one GPU lent, and NCCL refuses two ranks on one device",
        wall_s=round(wall_s, 1),
    )
    print(f"\nwrote {path} in {wall_s:.0f} s")
    return 1 if any(row.get("error") for row in memory + loads) else 0
