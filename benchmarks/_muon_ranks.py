"""What one rank of ``python -m benchmarks.muon`` runs: a list of jobs, one after another, in one process.

The driver starts every rank with ``python -m benchmarks._muon_ranks JOBS OUT_FILE``; each rank runs the jobs in
order and appends one JSON line per job to ``OUT_FILE`` with ``-rank<r>`` before its suffix.

Every job trains the same randomly initialised Llama (:class:`benchmarks._scale_ranks.Workload`, seed 0, fp32) on
the same token batches with merak3d at one layout, with ``CausalLMModule``'s optimizer at one constant learning
rate (1e-3; Muon's steps are scaled to AdamW's update size, so the two share it):

* ``adamw``: AdamW, the optimizer the user would otherwise run, at the same layout;
* ``muon``: ours, ``optim=muon`` (``MuonWithAdamW``: Muon on the hidden matrices, AdamW on the rest), which merak3d
  divides over the data-parallel ranks by itself (each matrix orthogonalised by one owner);
* ``muon_naive``: the common port: every data-parallel rank puts every matrix together and runs every
  Newton–Schulz iteration itself (under ZeRO-1 an all-to-all sends every rank's slices to every rank; without
  sharding every replica steps every matrix). The same arithmetic on the same matrices, so the same losses;
* ``muon_float32``: ours with its one non-default option, ``optim.newton_schulz_dtype=float32`` (the iteration in
  float32, for a CPU that multiplies bfloat16 without native support): a labelled row, in no goal.

Each step is timed from its batch's start to its end on every rank (Lightning's hooks); the slowest rank's step is
the step's time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM

from benchmarks._scale_ranks import Workload, _quiet, _TokenData
from lightning_merak.distributed.dtensors import local_tensor
from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.modules.config import OptimConfig, Schedule
from lightning_merak.modules.muon import MuonWithAdamW
from lightning_merak.parallel.data.whole_matrices import MatrixPieces, whole_matrix

RANK_TIMEOUT_S = 600.0
OPTIMIZERS = ("adamw", "muon", "muon_naive", "muon_float32")


@dataclass(frozen=True)
class Job:
    """One training run: ``optimizer`` (:data:`OPTIMIZERS`) at merak3d ``layout`` for ``steps`` steps."""

    name: str
    optimizer: str
    layout: dict[str, Any]
    steps: int


class EveryRankPieces(MatrixPieces):
    """The naive port under ZeRO-1: every rank receives every rank's slices of every matrix (one all-to-all),
    orthogonalises every matrix, and keeps its own slices of the results."""

    def map_whole(self, compute: Callable[[int, torch.Tensor], torch.Tensor], held: dict[int, torch.Tensor]
                  ) -> dict[int, torch.Tensor]:
        mine = [index for index in range(len(self.matrices)) if index in held]
        send = torch.cat([held[index].reshape(-1) for index in mine])
        splits = [sum(piece.stop - piece.start for pieces in self.pieces for piece in pieces if piece.rank == rank)
                  for rank in range(self.size)]
        receive = torch.empty(sum(splits), dtype=send.dtype)
        dist.all_to_all_single(receive, send.repeat(self.size), splits, [send.numel()] * self.size, group=self.group)
        wholes = [torch.empty_like(local_tensor(matrix), dtype=send.dtype) for matrix in self.matrices]
        offset = 0
        for rank in range(self.size):
            for index, pieces in enumerate(self.pieces):
                for piece in pieces:
                    if piece.rank == rank:
                        numel = piece.stop - piece.start
                        wholes[index].view(-1)[piece.start:piece.stop] = receive[offset:offset + numel]
                        offset += numel
        results = {}
        for index in mine:
            result = compute(index, whole_matrix(wholes[index], self.matrices[index]))
            local = local_tensor(result)
            piece = next(piece for piece in self.pieces[index] if piece.rank == self.rank)
            results[index] = local.reshape(-1)[piece.start:piece.stop].to(send.dtype)
        return results


class NaiveMuon(MuonWithAdamW):
    """:class:`MuonWithAdamW` as the common port runs it: no owners; every rank computes every matrix."""

    def spread_over(self, group: Any, replicated: Optional[set[int]] = None) -> None:
        return None  # every replica steps every matrix itself

    def assemble_pieces(self, plan: Callable[[list[nn.Parameter]], MatrixPieces]) -> None:
        def everyone(matrices: list[nn.Parameter]) -> MatrixPieces:
            planned = plan(matrices)
            return EveryRankPieces(planned.matrices, planned.pieces, planned.group)

        super().assemble_pieces(everyone)


class _Module(CausalLMModule):
    naive = False

    def configure_optimizers(self) -> dict[str, Any]:
        configured = super().configure_optimizers()
        if self.naive:  # the same optimizer, parts and groups, distributed the naive way
            configured["optimizer"].__class__ = NaiveMuon
        return configured


class _StepTimer(pl.Callback):
    """Each step's wall time, and the part of it after the backward (the optimizer's step and the collectives that
    follow it), and the global batch's loss."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.optimizer_s: list[float] = []
        self.losses: list[float] = []
        self._start = self._backward_done = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._backward_done = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        end = time.perf_counter()
        self.step_s.append(end - self._start)
        self.optimizer_s.append(end - self._backward_done)
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def run_job(job: Job, workload: Workload) -> dict[str, Any]:
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(workload.config())
    name = "adamw" if job.optimizer == "adamw" else "muon"
    # one learning rate for both: Muon's steps are scaled to AdamW's update size (match_rms_adamw)
    optim = OptimConfig(name=name, learning_rate=1e-3, lr_schedule=Schedule.constant, warmup_steps=0,
                        total_steps=job.steps,
                        newton_schulz_dtype="float32" if job.optimizer == "muon_float32" else "bfloat16")
    module = _Module(model, optim)
    module.naive = job.optimizer == "muon_naive"
    timer = _StepTimer()
    trainer = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), max_steps=job.steps, logger=False,
                         strategy=Merak3DStrategy(**job.layout, micro_batches=workload.micro_batches,
                                                  timeout_s=RANK_TIMEOUT_S),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[timer])
    trainer.fit(module, datamodule=_TokenData(workload, job.steps))
    partition = trainer.strategy.partition
    return {"step_s": timer.step_s, "optimizer_s": timer.optimizer_s, "losses": timer.losses,
            "boundaries": None if partition is None else list(partition.boundaries),
            "stage_optimizer_s": None if partition is None else partition.stage_optimizer_s}


def rank_file(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.stem}-rank{rank}{out.suffix}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jobs", type=Path, help="JSON: the workload and the jobs")
    parser.add_argument("out", type=Path, help="results, one JSON line per job, per rank")
    args = parser.parse_args(argv)
    spec = json.loads(args.jobs.read_text())
    workload = Workload(**spec["workload"])
    torch.set_num_threads(1)
    _quiet()
    os.environ["LOCAL_RANK"] = os.environ["RANK"]  # the launcher started every rank: Lightning joins them
    dist.init_process_group("gloo", timeout=timedelta(seconds=RANK_TIMEOUT_S))
    rank = dist.get_rank()
    out = rank_file(args.out, rank)
    for entry in spec["jobs"]:
        job = Job(**entry)
        print(f"rank {rank}: {job.name}", file=sys.stderr, flush=True)
        result = {"job": asdict(job), **run_job(job, workload)}
        with out.open("a") as handle:
            handle.write(json.dumps(result) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
