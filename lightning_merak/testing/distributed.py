"""Run a function on N real processes joined by a gloo process group, with a deadline.

Distributed tests must fail fast and leave nothing behind: a rank that raises fails the
run with that rank's traceback, a rank that hangs fails it when the deadline passes, and
in both cases every process is terminated and reaped before the error is raised.

    def check(rank: int, world_size: int, scale: float) -> float:
        t = torch.full((2,), float(rank) * scale)
        dist.all_reduce(t)
        return t.sum().item()

    results = run_distributed(check, world_size=2, args=(1.0,))

``fn`` must be importable (defined at module level): ranks are forked from a
``forkserver`` that imported torch, Lightning, transformers and merak3d once and never ran an
operation (so it has no thread to lose in a fork). A rank then starts in well under a
second instead of importing those libraries again, as ``spawn`` does (measured: five
2-rank merak3d training tests took 17 s instead of 46 s). Each rank gets the caller's
environment as it is at the call, as ``spawn`` would give it, plus ``env``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from lightning_merak.distributed.process_groups import init_process_group
from lightning_merak.testing.cpu_quota import CpuQuota, enter_group
from lightning_merak.util.ports import free_rendezvous_port

__all__ = ["DistributedRunError", "find_free_port", "run_distributed"]

_REAP_GRACE_S = 5.0


class DistributedRunError(RuntimeError):
    """A rank raised, died or missed the deadline; the message names which and why."""


@dataclass
class _RankOutcome:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""


_PRELOADED = (
    "torch", "torch.distributed", "lightning.pytorch", "transformers", "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.mixtral.modeling_mixtral", "lightning_merak.modules.causal_lm",
    "lightning_merak.strategies.merak3d.strategy",
)
"""Imported once by the forkserver the ranks are forked from (imports only: no thread has started).

Besides the libraries, the test models' transformers modules and merak3d with what it imports: a
rank importing them itself spent 1.3 s of CPU before its first step (measured: 1.75 s → 0.47 s
per rank of a 2-stage Llama run). A module that fails to import here is imported by the rank."""


find_free_port = free_rendezvous_port
"""A free TCP port on the loopback interface, below the ephemeral range (one helper for launches and tests)."""


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    timeout_s: float,
    threads_per_rank: int,
    env: dict[str, str],
    outcomes: mp.Queue,
    backend: str,
    cpu_group_procs: str | None,
) -> None:
    import torch.distributed as dist

    if cpu_group_procs is not None:  # into its quota before any work
        enter_group(cpu_group_procs)

    os.environ.clear()  # the forkserver's environment is the one of its start: take the caller's
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads_per_rank)
    try:
        init_process_group(backend, device=torch.device("cuda", rank) if backend == "nccl" else None, rank=rank,
                           world_size=world_size, timeout=timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensor data; torch's multiprocessing pickler would share
        # it through file descriptors that vanish when this process exits.
        outcomes.put(_RankOutcome(rank, True, pickle.dumps(value)))
    except BaseException:
        outcomes.put(_RankOutcome(rank, False, error=traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _reap(processes: list[mp.Process]) -> None:
    """End every started rank; one that failed to start (its arguments did not pickle) has nothing to end."""
    started = [proc for proc in processes if proc.pid is not None]
    for proc in started:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _REAP_GRACE_S
    for proc in started:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
    threads_per_rank: int = 1,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    cpu_quota: CpuQuota | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks (gloo; ``backend="nccl"`` puts
    rank ``r`` on GPU ``r``, for benchmarks' GPU legs).

    ``cpu_quota`` (entered here, removed on return) gives each rank its own fixed CPU share, so a timing
    benchmark with more ranks than cores emulates one device per rank.

    Returns the values the ranks returned, ordered by rank. Raises
    :class:`DistributedRunError` as soon as a rank fails, or when ``timeout_s`` passes
    before every rank has finished; all ranks are reaped before it is raised.
    Collectives inside ``fn`` time out after ``timeout_s`` too, so a peer that died
    cannot block the survivors.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOADED))
    outcomes: mp.Queue = ctx.Queue()
    port = find_free_port()
    with contextlib.nullcontext() if cpu_quota is None else cpu_quota:
        processes = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, port, tuple(args), dict(kwargs or {}), timeout_s,
                      threads_per_rank, {**os.environ, **(env or {})}, outcomes, backend,
                      None if cpu_quota is None else str(cpu_quota.procs_file(rank))),
                name=f"merak-rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        return _run_ranks(processes, outcomes, timeout_s)


def _run_ranks(processes: list[Any], outcomes: Any, timeout_s: float) -> list[Any]:
    """Start the ranks, collect their outcomes until all reported or one failed, and reap them."""
    world_size = len(processes)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for proc in processes:
            proc.start()
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise DistributedRunError(
                    f"ranks {missing} did not finish within {timeout_s:.0f}s (hang or deadlock); "
                    "all ranks were terminated"
                )
            try:
                outcome: _RankOutcome = outcomes.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [
                    rank for rank, proc in enumerate(processes)
                    if rank not in results and not proc.is_alive() and proc.exitcode is not None
                ]
                if dead and outcomes.empty():
                    codes = {rank: processes[rank].exitcode for rank in dead}
                    raise DistributedRunError(
                        f"ranks exited without reporting a result (exit codes {codes})"
                    ) from None
                continue
            if not outcome.ok:
                raise DistributedRunError(f"rank {outcome.rank} failed:\n{outcome.error}")
            results[outcome.rank] = pickle.loads(outcome.value)
    finally:
        _reap(processes)
        outcomes.close()
        outcomes.join_thread()
    return [results[rank] for rank in range(world_size)]
