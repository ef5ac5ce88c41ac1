"""What a device can do and what a rank holds: the peak FLOP rate MFU divides by, and peak memory.

A CUDA device's peak comes from Lightning's table of datasheet figures (``get_available_flops``); a device
missing from it, and every CPU, gets a measured one: the best of a few square matmuls in the run's compute
dtype. A measured peak is what this rank's cores reach while the others run too, not a datasheet figure, so
the metric built on it carries another name (:data:`MEASURED_PEAK`).
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from lightning.fabric.utilities.throughput import get_available_flops

__all__ = ["DATASHEET_PEAK", "MEASURED_PEAK", "MemoryReading", "PeakFlops", "compute_dtype", "measured_matmul_flops",
           "peak_flops", "read_memory"]

DATASHEET_PEAK = "datasheet"
MEASURED_PEAK = "measured_matmul"
_MIB = 2**20


@dataclass(frozen=True)
class PeakFlops:
    """FLOPs per second one device can do, and where the figure comes from (:data:`DATASHEET_PEAK` or
    :data:`MEASURED_PEAK`)."""

    flops_per_s: float
    source: str


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls run in under a Lightning precision setting (``"bf16-mixed"``, ``"16-true"``, ...)."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("64"):
        return torch.float64
    return torch.float32


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 512, repeats: int = 3) -> float:
    """FLOPs per second of the fastest of ``repeats`` ``size × size`` matmuls on ``device``, after one warm-up."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    left = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    right = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(left, right)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> PeakFlops:
    """The datasheet peak of a known CUDA device, else a measured matmul peak (every CPU)."""
    if device.type == "cuda":
        known = get_available_flops(device, dtype)
        if known:
            return PeakFlops(float(known), DATASHEET_PEAK)
        return PeakFlops(measured_matmul_flops(device, dtype, size=4096), MEASURED_PEAK)
    return PeakFlops(measured_matmul_flops(device, dtype), MEASURED_PEAK)


@dataclass(frozen=True)
class MemoryReading:
    """This rank's memory in MiB: the high-water mark so far and what it holds now."""

    peak_mib: float
    current_mib: float


def _proc_status_kib(field: str) -> Optional[float]:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1])
    return None


def read_memory(device: torch.device) -> MemoryReading:
    """CUDA: allocated tensor memory (``max_memory_allocated``, ``memory_allocated``). Elsewhere the process's
    resident set: its high-water mark (``VmHWM``, or ``ru_maxrss`` where there is no ``/proc``) and ``VmRSS``."""
    if device.type == "cuda":
        return MemoryReading(torch.cuda.max_memory_allocated(device) / _MIB, torch.cuda.memory_allocated(device) / _MIB)
    peak_kib = _proc_status_kib("VmHWM")
    if peak_kib is None:  # ru_maxrss is KiB on Linux, bytes on macOS
        max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_kib = max_rss / 1024 if sys.platform == "darwin" else float(max_rss)
    current_kib = _proc_status_kib("VmRSS")
    return MemoryReading(peak_kib / 1024, (current_kib if current_kib is not None else peak_kib) / 1024)
