"""Benchmark DeltaMemory against no management, full checkpointing and offload-everything.

    python -m benchmarks.delta [--quick] [--out PATH] [--device cpu|cuda]

Every configuration runs in its own fresh subprocess, so the process's peak resident
memory (VmHWM) is its own; activation memory is the peak minus the resident memory just
before the first step (model, gradients and data already allocated). Step times are
medians over the steps after warm-up, and every measurement is repeated (``--repeats``)
and reported as the median because the CPU is shared. Each row also carries the CPU time
per step of the whole process and of the training thread: on a busy machine the wall
time includes waiting for a core, and DELTA's copy thread competes for one; the training
thread's CPU time is what the step would take if the copy thread had a core of its own
and no copy were waited for.

Two memory figures, side by side:
* ``activation_peak_MiB`` - peak resident memory (RSS) above the start, what the issue's
  CPU leg asks for. It includes heap pages glibc keeps after they are freed (fragmentation),
  some tens of MiB in every configuration.
* ``allocated_peak_MiB`` - peak of the allocator's bytes in use (glibc ``mallinfo2``:
  ``uordblks + hblkhd``) above the start, the CPU analogue of CUDA's
  ``max_memory_allocated``. It is sampled every 0.2 ms by a thread, in a second run of
  the configuration (the sampler would perturb the timed run), over all steps including
  warm-up.
The targets are evaluated on both.

Workload: a GPT-style model (``BenchGPT``), batch 8, seq 128; hidden 256 and 6 layers with
``--quick``, hidden 384 and 8 layers otherwise. The full run adds a sweep of ``none`` vs
``delta`` over hidden 128, 256 and 512 (6 layers): the bytes DELTA copies grow with hidden x
tokens, a block's compute with hidden² x tokens, so the share of the step the swap costs shrinks
as the model grows, and at small hidden sizes per-tensor costs dominate.

Allocator: glibc returns the top of its heap to the OS whenever enough of it is free. DELTA
frees most activations during the forward and allocates them again in the backward, so
with glibc's defaults the pages it gives back are faulted in again (a few thousand page
faults per step, microseconds each), while ``none`` reuses one resident heap. The
full run's equal-batch leg therefore runs twice: under glibc's defaults, and for ``none`` and
``delta`` under ``glibc-no-trim`` (``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``
in the workers' environment), where freed pages stay resident like in a caching allocator:
fewer faults, more resident memory. Each leg's ratios are to its own ``none``.

CPU leg (this machine): DELTA with the disk tier (and recompute) vs
* ``none`` - no management;
* ``checkpoint`` - ``torch.utils.checkpoint`` around every block;
* ``offload-all`` - ``save_on_cpu``-style: every saved activation written out and read
  back synchronously (on CPU ``save_on_cpu`` itself would copy within the same memory,
  so its CPU analogue is a synchronous disk store), no prefetch.
The GPU leg (``--device cuda``, ``benchmarks/_delta_gpu.py``: ``max_memory_allocated``, host tier,
``save_on_cpu(pin_memory=True)`` as offload-all) writes ``delta.gpu.json``.

Equal-batch budget: DELTA's budget counts saved activations only, while the target is on
all activation memory (saved tensors, the transients of the step and the allocator's
slack). It is ``--delta-budget-fraction`` (default 0.25) of ``none``'s peak of saved
bytes: 60% less of everything needs the saved bytes well under 40%.

Max-batch leg: the fixed budget is ``none``'s activation peak at the base batch. DELTA's
budget covers saved activations only, so it gets that budget minus the non-saved
transient memory (activation gradients, logits) measured per sample in the ``none`` run.

DELTA's warm-up steps use a quarter of the batch, and the plan is scaled to the full batch
(the spec's "profile with a smaller batch" path), so its peak includes its warm-up honestly.

Goals (:func:`goal_figures`, each the worst ``delta`` row of every leg it covers: both equal-batch legs and
every width of the sweep; :func:`benchmarks.goals.worst_case`): activation RSS and allocator peak at most 40% of
``none``'s, step time at most 1.10x ``none``'s, max batch at least 2x ``none``'s. The equal-batch budget is part
of the workload and every definition names it. A full run is written with :func:`benchmarks.goals.write_run` (a
spread over the full runs; it took 19 minutes on 2 shared cores); ``--quick`` writes ``results/delta.quick.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ContextManager

from benchmarks._rank_heap import KEPT_HEAP_ENV
from benchmarks.goals import Goal, print_goals, worst_case, write_run
from benchmarks.report import default_out, out_help, print_table

CONFIGS = ("none", "checkpoint", "offload-all", "delta", "delta-paper-rule")
QUICK_CONFIGS = ("none", "checkpoint", "offload-all", "delta")
ALLOCATORS: dict[str, dict[str, str]] = {
    "glibc-default": {},
    # the heap serves every allocation under 32 MiB and is never trimmed automatically:
    # freed pages stay resident and are reused without page faults, as in a caching allocator
    "glibc-no-trim": KEPT_HEAP_ENV,
}
MIB = 2**20
SWEEP_HIDDEN = (128, 256, 512)
"""Hidden sizes of the full run's sweep: the swap's copies grow with hidden, the blocks' compute with its square."""
ISSUE = 49
"""The issue that made each target a worst-case goal; the targets come from DeltaMemory's specification, which has
no issue number in this repository."""
EQUAL_BATCH_LEGS = ("equal batch, glibc-default", "equal batch, glibc-no-trim",
                    *(f"sweep hidden {hidden}" for hidden in SWEEP_HIDDEN))
"""Every leg of ``delta`` against ``none`` at the same batch: the equal-batch goals' figure is their worst."""
WORKLOAD = ("BenchGPT at batch 8, seq 128 (hidden 384, 8 layers; the sweep hidden 128, 256, 512 at 6 layers), one "
            "thread, each configuration in a fresh process, DELTA with the disk tier")


def budget_text(fraction: float) -> str:
    """The equal-batch legs' DELTA budget, part of their workload."""
    return f"budget: {fraction:g} x the no-swap run's peak of saved activation bytes"


def equal_batch_goals(fraction: float) -> tuple[Goal, Goal, Goal]:
    """The goals of the equal-batch legs, whose workload includes DELTA's budget (``fraction`` of ``none``'s)."""
    worst = (f"worst over the legs {' / '.join(EQUAL_BATCH_LEGS)}; {WORKLOAD}; medians of 3 repeats (1 in the "
             f"sweep); DELTA's {budget_text(fraction)} in the same leg")
    return (
        Goal("delta_activation_rss_vs_none_max", 0.4, "<=",
             f"delta's peak RSS above the pre-step RSS over none's (no management); {worst}",
             issue=ISSUE),
        Goal("delta_activation_allocated_vs_none_max", 0.4, "<=",
             f"delta's peak of glibc's bytes in use (mallinfo2) above the start over none's; {worst}", issue=ISSUE),
        Goal("delta_step_time_vs_none_max", 1.10, "<=",
             f"delta's median step time after warm-up over none's; {worst}", issue=ISSUE),
    )


MAX_BATCH = Goal(
    "delta_max_batch_vs_none_min", 2.0, ">=",
    f"largest power-of-two batch (8 to 64) delta trains within none's activation RSS peak at batch 8 (+2%), over "
    f"none's; DELTA's budget: that peak minus none's non-saved transients per sample; {WORKLOAD}", issue=ISSUE)


def goal_figures(rows: list[dict[str, Any]], fraction: float) -> list[dict[str, Any]]:
    """Every goal from a run's ``rows``: the equal-batch goals over every such leg the run has, the max-batch goal
    from its leg."""
    delta_rows = {row["leg"]: row for row in rows if row["config"] == "delta"}
    equal = {leg: row for leg, row in delta_rows.items() if leg in EQUAL_BATCH_LEGS}
    rss, allocated, step = equal_batch_goals(fraction)
    return [worst_case(rss, {leg: row["activation_vs_none"] for leg, row in equal.items()}),
            worst_case(allocated, {leg: row.get("allocated_vs_none") for leg, row in equal.items()}),
            worst_case(step, {leg: row["time_vs_none"] for leg, row in equal.items()}),
            worst_case(MAX_BATCH, {"max batch": delta_rows["max batch"]["batch_vs_none"]})]


# worker (runs in a fresh process) ----------------------------------------------------------


def _status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


class _AllocatedSampler:
    """Peak of glibc's bytes in use (``mallinfo2``), sampled by a thread; None without glibc 2.33+."""

    def __init__(self, interval_s: float = 0.0002) -> None:
        import ctypes
        import threading

        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                "keepcost",
            )]

        try:
            self._mallinfo2 = ctypes.CDLL(None).mallinfo2
        except AttributeError:
            self._mallinfo2 = None
            return
        self._mallinfo2.restype = MallInfo2
        self.interval_s = interval_s
        self.start_bytes = self.in_use()
        self.peak_bytes = self.start_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def available(self) -> bool:
        return self._mallinfo2 is not None

    def in_use(self) -> int:
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, self.in_use())

    def stop(self) -> Any:
        """Bytes in use at the peak above the start, or None where ``mallinfo2`` is missing."""
        if not self.available:
            return None
        self._stop.set()
        self._thread.join()
        return max(self.peak_bytes, self.in_use()) - self.start_bytes


def _sync_disk_offload(directory: str, excluded: set) -> Any:
    """``save_on_cpu``'s CPU analogue: write every saved tensor out now, read it back on use."""
    import torch

    counter = iter(range(10**12))

    def pack(tensor: torch.Tensor) -> Any:
        if ((str(tensor.device), tensor.untyped_storage().data_ptr()) in excluded
                or tensor.numel() * tensor.element_size() < 1024):
            return tensor
        path = os.path.join(directory, f"{next(counter)}.bin")
        contiguous = tensor.contiguous()
        with open(path, "wb") as f:
            f.write(contiguous.view(torch.uint8).flatten().numpy().data)
        return (path, tensor.dtype, tensor.shape)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        path, dtype, shape = packed
        data = torch.empty(shape, dtype=dtype)
        with open(path, "rb") as f:
            f.readinto(data.view(torch.uint8).flatten().numpy().data)
        os.remove(path)
        return data

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def train_step(model: Any, optimizer: Any, ids: Any, manager: Any, saved_tensors: ContextManager[Any]) -> None:
    """One step of a configuration: the forward under ``saved_tensors`` (an offloading hook, or a null context),
    with DELTA's ``manager`` (or None) told where the step, its forward and its backward end."""
    if manager is not None:
        manager.begin_step(tuple(ids.shape), ids.numel())
    with saved_tensors:
        loss = model(ids)
    if manager is not None:
        manager.end_forward()
    loss.backward()
    if manager is not None:
        manager.end_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.utils.checkpoint import checkpoint

    from lightning_merak.callbacks.delta.blocks import discover_blocks
    from lightning_merak.callbacks.delta.budget import parse_budget
    from lightning_merak.callbacks.delta.profiler import SavedTensorTracker, storage_key
    from lightning_merak.callbacks.delta.runtime import ManagerOptions, MemoryManager
    from lightning_merak.testing.delta_models import BenchGPT

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    config, batch, seq = spec["config"], spec["batch"], spec["seq"]
    model = BenchGPT(hidden=spec["hidden"], layers=spec["layers"], heads=4)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    warmup_batch = max(1, batch // 4)
    data = torch.randint(0, 128, (batch, seq), generator=generator)
    small = data[:warmup_batch].clone()
    model(small[:1, :8]).backward()  # allocate gradients before measuring
    optimizer.zero_grad(set_to_none=False)

    manager = None
    offload_dir = None
    if config == "checkpoint":
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    elif config.startswith("delta"):
        options = ManagerOptions(
            budget=parse_budget(int(spec["delta_budget"])), swap_tier="disk", swap_dir=spec["swap_dir"],
            warmup_steps=2, director="delta" if config == "delta-paper-rule" else "exposed",
        )
        manager = MemoryManager(discover_blocks(model), options, log=lambda message: None)
        manager.start(model, torch.device("cpu"))
    elif config == "offload-all":
        offload_dir = tempfile.mkdtemp(prefix="offload-all-", dir=spec["swap_dir"])
    excluded = {storage_key(p) for p in model.parameters()}

    warmup = 2
    steps = warmup + spec["steps"]
    rss_before = _status_bytes("VmRSS")
    _reset_peak()
    sampler = _AllocatedSampler() if spec.get("sample_allocated") else None
    times, cpu_times, thread_times = [], [], []
    for step in range(steps):
        ids = small if (manager is not None and step < warmup) else data
        start, start_cpu, start_thread = time.perf_counter(), time.process_time(), time.thread_time()
        offload = _sync_disk_offload(offload_dir, excluded) if offload_dir is not None else contextlib.nullcontext()
        train_step(model, optimizer, ids, manager, offload)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - start_cpu)
        thread_times.append(time.thread_time() - start_thread)
    peak = _status_bytes("VmHWM")
    allocated = sampler.stop() if sampler is not None else None
    result: dict[str, Any] = {
        "config": config,
        "batch": batch,
        "activation_peak_MiB": (peak - rss_before) / MIB,
        "peak_rss_MiB": peak / MIB,
        "step_s": statistics.median(times[warmup:]),
        "step_cpu_s": statistics.median(cpu_times[warmup:]),
        "step_thread_cpu_s": statistics.median(thread_times[warmup:]),
    }
    if allocated is not None:
        result["allocated_peak_MiB"] = allocated / MIB
    if manager is not None:
        plan = manager.plan
        result["saved_peak_MiB"] = manager.step_reports[-1].peak_saved_bytes / MIB
        result["saved_peak_first_managed_MiB"] = manager.step_reports[0].peak_saved_bytes / MIB
        result["budget_MiB"] = manager.budget_bytes / MIB
        result["plan"] = {d.name: d.action.value for d in plan.decisions}
        result["unmanaged_saved_MiB"] = plan.unmanaged_peak_bytes / MIB
        manager.close()
    if config == "none":
        from lightning_merak.callbacks.delta.ledger import ResidentLedger

        ledger = ResidentLedger()
        tracker = SavedTensorTracker(ledger)
        tracker.exclude_module_state(model)
        ledger.start_step()
        with tracker.hooks("all"):
            loss = model(data)
        loss.backward()
        result["saved_peak_MiB"] = ledger.peak_bytes / MIB
    return result


# orchestration -----------------------------------------------------------------------------


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    environment = dict(os.environ, **ALLOCATORS[spec.get("allocator", "glibc-default")])
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.delta", "--worker", json.dumps(spec)],
        capture_output=True, text=True, timeout=600, check=False, env=environment,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"worker {spec['config']} batch {spec['batch']} failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _median_run(spec: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Timed runs (median of ``repeats``) plus one run sampling the allocator's bytes in use."""
    runs = [_run(spec) for _ in range(repeats)]
    merged = dict(runs[0])
    for key in ("activation_peak_MiB", "peak_rss_MiB", "step_s", "step_cpu_s", "step_thread_cpu_s", "saved_peak_MiB"):
        if key in merged:
            merged[key] = statistics.median(r[key] for r in runs)
    merged["repeats"] = repeats
    merged["allocated_peak_MiB"] = _run(dict(spec, sample_allocated=True)).get("allocated_peak_MiB")
    return merged


def _equal_batch_leg(
    common: dict[str, Any], batch: int, configs: tuple[str, ...], allocator: str, args: argparse.Namespace,
    repeats: int, progress: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """Rows of ``configs`` at ``batch`` under ``allocator``, with ratios to that leg's ``none``."""
    leg = f"equal batch, {allocator}"
    none = _median_run(dict(common, config="none", batch=batch, delta_budget=0, allocator=allocator), repeats)
    delta_budget = int(args.delta_budget_fraction * none["saved_peak_MiB"] * MIB)
    rows = [dict(none, leg=leg)]
    for config in configs[1:]:
        progress(f"  {config}")
        spec = dict(common, config=config, batch=batch, delta_budget=delta_budget, allocator=allocator)
        rows.append(dict(_median_run(spec, repeats), leg=leg))
    for row in rows:
        row["activation_vs_none"] = row["activation_peak_MiB"] / none["activation_peak_MiB"]
        if row.get("allocated_peak_MiB") is not None and none.get("allocated_peak_MiB"):
            row["allocated_vs_none"] = row["allocated_peak_MiB"] / none["allocated_peak_MiB"]
        row["time_vs_none"] = row["step_s"] / none["step_s"]
        row["cpu_vs_none"] = row["step_cpu_s"] / none["step_cpu_s"]
        row["thread_cpu_vs_none"] = row["step_thread_cpu_s"] / none["step_thread_cpu_s"]
    return rows, none, delta_budget


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer repeats (under 3 minutes)")
    parser.add_argument("--out", type=Path, help=out_help("delta"))
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per worker (the CPU is shared)")
    parser.add_argument(
        "--delta-budget-fraction", type=float, default=0.25,
        help="DELTA's equal-batch budget as a fraction of none's peak of saved bytes",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the one-GPU leg (benchmarks/_delta_gpu.py) instead of the CPU run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    if not 0 < args.delta_budget_fraction < 1:
        parser.error(f"--delta-budget-fraction must lie in (0, 1), got {args.delta_budget_fraction}")
    if args.device == "cuda":
        from benchmarks._delta_gpu import gpu_main

        sys.exit(gpu_main(args.out or default_out("delta.gpu", args.quick), args.quick, args.delta_budget_fraction))

    started = time.perf_counter()
    load_average = os.getloadavg()
    repeats = args.repeats or (1 if args.quick else 3)
    # eight or ten timed steps even when quick: a median of three swings by 10-20% on a shared CPU
    shape = (dict(hidden=256, layers=6, seq=128, steps=8) if args.quick
             else dict(hidden=384, layers=8, seq=128, steps=10))
    base_batch = 8
    max_batch_factor = 4 if args.quick else 8
    with tempfile.TemporaryDirectory(prefix="delta-bench-") as swap_dir:
        common = dict(shape, threads=args.threads, swap_dir=swap_dir)

        def progress(message: str) -> None:
            print(f"[{time.perf_counter() - started:6.1f}s] {message}", flush=True)

        configs = QUICK_CONFIGS if args.quick else CONFIGS
        progress(f"equal batch {base_batch}: {', '.join(configs)} ({repeats} repeat(s) each)")
        rows, none, delta_budget = _equal_batch_leg(common, base_batch, configs, "glibc-default", args, repeats,
                                                    progress)
        if not args.quick:
            progress(f"equal batch {base_batch} with the allocator never trimming: none, delta")
            no_trim_rows, _, _ = _equal_batch_leg(common, base_batch, ("none", "delta"), "glibc-no-trim", args,
                                                  repeats, progress)
            rows += no_trim_rows
            progress(f"hidden-size sweep at batch {base_batch}: none, delta at hidden {SWEEP_HIDDEN}")
            for hidden in SWEEP_HIDDEN:
                sweep_common = dict(common, hidden=hidden, layers=6)
                sweep_rows, _, _ = _equal_batch_leg(sweep_common, base_batch, ("none", "delta"), "glibc-default", args,
                                                    1, progress)
                rows += [dict(row, leg=f"sweep hidden {hidden}", hidden=hidden) for row in sweep_rows]

        memory_budget = none["activation_peak_MiB"]
        transient_per_sample = (none["activation_peak_MiB"] - none["saved_peak_MiB"]) / base_batch
        progress(f"max batch within {memory_budget:.1f} MiB of activation memory (none's peak at batch {base_batch})")
        max_rows = []
        for config in CONFIGS if not args.quick else ("none", "checkpoint", "delta"):
            best, batch = None, base_batch
            while batch <= base_batch * max_batch_factor:
                saved_room = max(1.0, memory_budget - transient_per_sample * batch)
                budget = int(saved_room * MIB)
                # memory only: three timed steps are enough
                result = _run(dict(common, config=config, batch=batch, delta_budget=budget, steps=3))
                progress(f"  {config} batch {batch}: {result['activation_peak_MiB']:.1f} MiB")
                if result["activation_peak_MiB"] > memory_budget * 1.02 and batch > base_batch:
                    break
                best = result
                batch *= 2
            max_rows.append(dict(best, leg="max batch", memory_budget_MiB=memory_budget, batch_vs_none=None))
        none_max = max_rows[0]["batch"]
        for row in max_rows:
            row["batch_vs_none"] = row["batch"] / none_max

    columns = [
        "leg", "config", "batch", "activation_peak_MiB", "activation_vs_none", "allocated_peak_MiB",
        "allocated_vs_none", "step_s", "time_vs_none", "cpu_vs_none", "thread_cpu_vs_none", "saved_peak_MiB",
        "batch_vs_none",
    ]
    print_table(rows + max_rows, columns)
    goals = goal_figures(rows + max_rows, args.delta_budget_fraction)
    wall = time.perf_counter() - started
    print(f"load average before the run: {load_average}")
    print_goals(goals)
    gpu_leg = "run separately: python -m benchmarks.delta --device cuda (delta.gpu.json)"
    print(f"GPU leg: {gpu_leg}")
    path = write_run(
        "delta", rows + max_rows, "measured", goals, quick=args.quick, out=args.out, wall_s=wall,
        load_average_before=load_average, delta_budget_fraction=args.delta_budget_fraction,
        delta_budget=budget_text(args.delta_budget_fraction), delta_budget_equal_batch_MiB=delta_budget / MIB,
        allocators=ALLOCATORS, memory_budget_MiB=memory_budget, transient_per_sample_MiB=transient_per_sample,
        gpu_leg=gpu_leg,
    )
    print(f"wrote {path} in {wall:.0f}s")


if __name__ == "__main__":
    main()
