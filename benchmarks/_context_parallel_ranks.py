"""What one rank of ``python -m benchmarks.context_parallel`` runs: a list of jobs, one after another, in one process.

The driver starts every rank of a cluster with ``python -m benchmarks._context_parallel_ranks JOBS OUT_FILE``
(``JOBS`` a JSON file holding the :class:`Workload` and the :class:`Job` entries). Each rank runs the jobs in
order and appends one JSON line per job to ``OUT_FILE`` with ``-rank<r>`` before its suffix, as soon as it has
it, so a rank that fails or hangs loses only the jobs from there on.

Every job builds a fresh, randomly initialised transformers Llama from seed 0 (fp32, transformers' default
attention, ``sdpa``) and trains it on the same token batches (seed 1) with AdamW, one compute thread per rank:

* ``sdpa``: the baseline a user runs, the model as transformers builds it on one rank, no context parallelism.
  Rank 0 runs it alone while the other ranks wait, so it gets one rank's CPU share (one device) of the cluster.
* ``ring`` / ``all_to_all``: :func:`~lightning_merak.parallel.context.model.install_context_parallel` over every
  rank of the cluster; each rank is called with the whole sequence and runs on its load-balanced shard; after
  backward the gradients are averaged over the ranks in one flat all-reduce, as data parallelism does.
* ``torch``: torch's experimental ``torch.distributed.tensor.experimental.context_parallel`` around the same
  model (its SDPA calls become ring attention on a ``DeviceMesh`` of the ranks, the token, label and position
  buffers sharded with its head-tail load balancer); gradients summed over the ranks (each rank's loss is its
  share of the whole batch's). Where torch refuses this machine (``NotImplementedError``: on CPU its SDPA
  has no sharding rule), the job records the refusal instead of a result.
* ``ladder``: saved-activation bytes only, on a ladder in steps of a quarter of ``cap_sequence``, until a
  rung exceeds ``cap_slack`` times the ``sdpa`` job's bytes at ``cap_sequence`` in this run (or ``top``).
* ``plan`` / ``merak3d``: the planner leg, through ``pl.Trainer`` and ``Merak3DStrategy``
  (:mod:`benchmarks._context_parallel_planned`, which says what they run and return).

Every job first measures the bytes autograd saves for backward in one forward with labels
(:func:`benchmarks.report.saved_activation_bytes`), then (``steps`` > 0) trains, timing each step from the forward
to the optimizer step on every rank after a barrier.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.report import saved_activation_bytes

RANK_TIMEOUT_S = 1800.0
"""Collective timeout: ranks wait at a barrier while rank 0 trains the one-rank baseline alone."""
SDPA, RING, ALL_TO_ALL, TORCH, LADDER = "sdpa", "ring", "all_to_all", "torch", "ladder"
CONTEXT_METHODS = (RING, ALL_TO_ALL)
"""Ours: ``install_context_parallel``'s ``method``."""
PLAN, MERAK3D = "plan", "merak3d"
PLANNED = (PLAN, MERAK3D)
"""The planner leg's jobs, through merak3d's strategy (:mod:`benchmarks._context_parallel_planned`)."""
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Workload:
    """The Llama every job trains (fp32, batch ``batch`` of one sequence length per job)."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    vocab: int = 512
    intermediate: int = 128
    batch: int = 1
    lr: float = 1e-3
    max_positions: int = 65536

    def config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, max_position_embeddings=self.max_positions,
                           tie_word_embeddings=False)

    def describe(self) -> str:
        return (f"llama hidden {self.hidden}, {self.layers} layers, {self.heads} heads ({self.kv_heads} key/value), "
                f"intermediate {self.intermediate}, vocab {self.vocab}, batch {self.batch}, fp32, AdamW lr {self.lr:g}")


@dataclass(frozen=True)
class Job:
    """One measurement on every rank of a cluster (see the module docstring for ``method``)."""

    method: str
    seq: int
    steps: int = 0
    ladder_method: Optional[str] = None
    """``ladder`` jobs: the method whose bytes climb the ladder."""
    cap_sequence: int = 0
    cap_slack: float = 1.05
    top: int = 0
    batch: int = 1
    """``plan`` and ``merak3d`` jobs: the global batch (sequences per step, split over the batch replicas)."""
    context_parallel: int = 1
    """``merak3d`` jobs: the context degree the layout fixes, with ``context_attention`` (None at 1)."""
    context_attention: Optional[str] = None


# Model and data --------------------------------------------------------------------------


def build_model(workload: Workload, method: str, group: Optional[dist.ProcessGroup] = None) -> nn.Module:
    """The Llama of ``workload`` from seed 0 with transformers' default attention; context parallelism installed
    over ``group`` for ``ring`` and ``all_to_all`` only (``sdpa`` and ``torch`` get the model as built)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(workload.config())
    if method in CONTEXT_METHODS:
        from lightning_merak.parallel.context.model import install_context_parallel

        install_context_parallel(model, group if group is not None else dist.group.WORLD, method)
    return model


def token_batches(workload: Workload, seq: int, steps: int) -> Tensor:
    """``(max(steps, 1), batch, seq)`` token ids, the same on every rank and for every method."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(workload.vocab, (max(steps, 1), workload.batch, seq), generator=generator)


def average_gradients(model: nn.Module, size: int, average: bool = True) -> None:
    """All-reduce every gradient over the ranks in one flat buffer; divided by ``size`` when ``average``."""
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat)
    if average:
        flat /= size
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def worst_over_ranks(value: int) -> int:
    """The largest ``value`` of any rank (a rank that did not measure passes 0); every rank gets it."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


# Jobs ------------------------------------------------------------------------------------


def _backward(loss: Tensor) -> Tensor:
    loss.backward()
    return loss


def _train(model: nn.Module, batches: Tensor, steps: int, lr: float, forward_backward: Callable[[Tensor], Tensor],
           after_backward: Callable[[], None], synchronise: bool,
           reported: Callable[[Tensor], float]) -> list[dict[str, float]]:
    """``steps`` AdamW steps, each timed from the forward to the optimizer step (after a barrier where ranks work
    together); per step wall time, the process's CPU time and the loss ``reported`` makes of the step's."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    records = []
    for step in range(steps):
        if synchronise:
            dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = forward_backward(batches[step])
        after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
        records.append({"step_s": step_s, "cpu_s": cpu_s, "loss": reported(loss)})
    return records


def run_ours(workload: Workload, job: Job) -> dict[str, Any]:
    """``sdpa`` (rank 0 alone), ``ring`` or ``all_to_all`` (every rank): saved bytes, then ``job.steps`` steps."""
    rank, size = dist.get_rank(), dist.get_world_size()
    batches = token_batches(workload, job.seq, job.steps)
    alone = job.method == SDPA
    result: dict[str, Any] = {"method": job.method, "seq": job.seq, "cp": 1 if alone else size}
    if alone and rank != 0:
        result.update(idle=True, saved_bytes=0, steps=[])
    else:
        model = build_model(workload, job.method)
        first = batches[0]
        result["saved_bytes"] = saved_activation_bytes(lambda: model(input_ids=first, labels=first),
                                                       model.parameters())
        result["steps"] = _train(
            model, batches, job.steps, workload.lr,
            lambda batch: _backward(model(input_ids=batch, labels=batch).loss),
            (lambda: None) if alone else (lambda: average_gradients(model, size)), synchronise=not alone,
            reported=lambda loss: float(loss.detach()))
    result["saved_bytes_worst"] = worst_over_ranks(result["saved_bytes"])  # also the idle ranks' barrier
    return result


def run_torch(workload: Workload, job: Job, mesh: Any) -> dict[str, Any]:
    """torch's experimental context parallelism on every rank, or its refusal of this machine."""
    from torch.distributed.tensor.experimental import context_parallel

    size = dist.get_world_size()
    result: dict[str, Any] = {"method": TORCH, "seq": job.seq, "cp": size}
    batches = token_batches(workload, job.seq, job.steps)
    model = build_model(workload, TORCH)

    def sharded_loss(batch: Tensor, body: Callable[[Callable[[], Tensor]], Any]) -> Any:
        """Run ``body(forward)`` inside torch's context: the buffers sharded, SDPA made ring attention."""
        shifted = torch.cat([batch[:, 1:], batch.new_full((batch.shape[0], 1), IGNORE_INDEX)], dim=1)
        targets = (shifted != IGNORE_INDEX).sum()
        inputs, labels = batch.clone(), shifted.clone()
        positions = torch.arange(job.seq)[None].expand(batch.shape[0], -1).clone()
        buffers = [inputs, labels, positions]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            return body(lambda: model(input_ids=inputs, position_ids=positions, labels=labels, shift_labels=labels,
                                      num_items_in_batch=targets).loss)

    def whole_batch(loss: Tensor) -> float:
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total)

    try:  # training first: where torch refuses this machine, its first forward says so
        result["steps"] = _train(model, batches, job.steps, workload.lr,
                                 lambda batch: sharded_loss(batch, lambda forward: _backward(forward())),
                                 lambda: average_gradients(model, size, average=False), synchronise=True,
                                 reported=whole_batch)
        result["saved_bytes"] = sharded_loss(batches[0],
                                             lambda forward: saved_activation_bytes(forward, model.parameters()))
    except NotImplementedError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return {**result, "refused": f"{type(error).__name__}: {first}"}
    result["saved_bytes_worst"] = worst_over_ranks(result["saved_bytes"])
    return result


def ladder_step(cap_sequence: int) -> int:
    """The ladder's spacing: a quarter of its first rung, fine enough to resolve a ratio of 3.5 (a doubling ladder
    reads only 2 or 4)."""
    return cap_sequence // 4


def run_ladder(workload: Workload, job: Job, worst: dict[tuple[str, int], int]) -> dict[str, Any]:
    """Saved bytes of ``job.ladder_method`` on rungs ``cap_sequence + k x step`` up to ``job.top`` while they stay
    within the cap (a rung this run trained is not measured again); ``worst``: this run's bytes per (method, seq)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    method = job.ladder_method
    assert method is not None
    cap = job.cap_slack * worst[(SDPA, job.cap_sequence)]
    alone = method == SDPA
    result: dict[str, Any] = {"method": LADDER, "ladder_method": method, "cp": 1 if alone else size,
                              "cap_bytes": cap, "rungs": []}
    model = build_model(workload, method) if not alone or rank == 0 else None
    seq, step = job.cap_sequence, ladder_step(job.cap_sequence)
    while seq <= job.top:
        if (method, seq) in worst:
            rung_worst = worst[(method, seq)]
        else:
            saved = 0
            if model is not None:
                tokens = token_batches(workload, seq, 0)[0]
                saved = saved_activation_bytes(lambda: model(input_ids=tokens, labels=tokens), model.parameters())
            rung_worst = worst_over_ranks(saved)
            result["rungs"].append({"seq": seq, "saved_bytes_worst": rung_worst})
        if rung_worst > cap:
            break
        seq += step
    return result


def run_planned(workload: Workload, job: Job, plans: list[dict[str, Any]]) -> dict[str, Any]:
    """A planner leg job; ``plans``: this rank's plans so far (a ``merak3d`` job reads the refusals of the last one,
    of its sequence and batch). Lightning is imported only here."""
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # the launcher started every rank: Lightning joins them
    from benchmarks._context_parallel_planned import run_merak3d, run_plan

    if job.method == PLAN:
        plans.append(run_plan(workload, job))
        return plans[-1]
    last = plans[-1] if plans and (plans[-1]["seq"], plans[-1]["batch"]) == (job.seq, job.batch) else None
    return run_merak3d(workload, job, None if last is None else last["rejected"])


def rank_main(workload: Workload, jobs: list[Job], out: Path) -> None:
    """Run ``jobs`` in order on this rank, appending each result to this rank's results file."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=RANK_TIMEOUT_S))
    mesh = None
    worst: dict[tuple[str, int], int] = {}
    plans: list[dict[str, Any]] = []
    path = rank_file(out, rank)
    try:
        for index, job in enumerate(jobs):
            if job.method == TORCH:
                if mesh is None:
                    from torch.distributed.device_mesh import init_device_mesh

                    mesh = init_device_mesh("cpu", (size,))
                result = run_torch(workload, job, mesh)
            elif job.method == LADDER:
                result = run_ladder(workload, job, worst)
            elif job.method in PLANNED:
                result = run_planned(workload, job, plans)
            else:
                result = run_ours(workload, job)
                worst[(job.method, job.seq)] = result["saved_bytes_worst"]
            with path.open("a") as file:
                file.write(json.dumps({"index": index, "rank": rank, **result}) + "\n")
    finally:
        dist.destroy_process_group()


def rank_file(out: Path, rank: int) -> Path:
    """Where ``rank`` appends its results: ``out`` with ``-rank<r>`` before the suffix."""
    return out.with_name(f"{out.stem}-rank{rank}{out.suffix}")


def write_jobs(path: Path, workload: Workload, jobs: list[Job]) -> Path:
    path.write_text(json.dumps({"workload": asdict(workload), "jobs": [asdict(job) for job in jobs]}))
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jobs", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    spec = json.loads(args.jobs.read_text())
    rank_main(Workload(**spec["workload"]), [Job(**job) for job in spec["jobs"]], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
