"""Issue #27 items 1 and 2: legal input never hangs (EmbRace), a hang or a lost rank is named on every rank."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.faults import FaultWatch
from lightning_merak.callbacks.sparse_comm.embrace import ShardedEmbedding, join_lookups, shard_embeddings
from lightning_merak.distributed import watchdog
from lightning_merak.distributed.point_to_point_waits import count_point_to_point_waits, open_point_to_point_waits
from lightning_merak.distributed.watchdog import (
    EXIT_CODE,
    POINT_TO_POINT,
    GroupProgress,
    PulseClock,
    StallClock,
    StuckCollective,
    Watchdog,
    absent_ranks,
    describe_lost,
    describe_stall,
    read_progress,
    waiting_in,
)
from lightning_merak.testing import find_free_port, run_distributed

VOCAB, DIM, FEATURES, TOKENS = 96, 8, 4, 12

# lookups of the table per (step, rank): rank 1 skips it in step 0, rank 0 reads it twice in step 1
LOOKUPS = [(1, 0), (2, 1), (1, 1)]
HEAD = [(True, False), (True, True), (False, True)]  # whether each rank's batch uses the (tied) head


class BranchLM(nn.Module):
    """A model whose batches take different branches: a table read 0..n times, a head used or not."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.dense = nn.Linear(FEATURES, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, features: torch.Tensor, lookups: int, use_head: bool) -> torch.Tensor:
        hidden = self.dense(features)
        for repeat in range(lookups):
            hidden = hidden + (repeat + 1) * self.embed(ids)
        hidden = torch.tanh(self.mix(hidden))
        if use_head:
            return F.cross_entropy(self.head(hidden), ids)
        return hidden.square().mean()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, VOCAB, (TOKENS + rank,), generator=generator)  # ranks differ in token count
    return ids, torch.randn(TOKENS + rank, FEATURES, generator=generator)


def _reference_gradients(tied: bool, step: int, world_size: int) -> dict[str, torch.Tensor]:
    """DDP's averaged gradients, computed in this one process from every rank's batch."""
    torch.manual_seed(0)
    model = BranchLM(tied)
    losses = [model(*_batch(step, r), LOOKUPS[step][r], HEAD[step][r]) for r in range(world_size)]
    (sum(losses) / world_size).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def branches_against_single_process(rank: int, world_size: int, tied: bool) -> float:
    """Largest |sharded DDP gradient - single-process reference| over three steps of differing branches."""
    torch.manual_seed(0)
    model = BranchLM(tied)
    table = shard_embeddings(model, ["embed"])["embed"]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["embed.shard"])
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    worst = 0.0
    for step in range(len(LOOKUPS)):
        model.zero_grad()
        loss = ddp(*_batch(step, rank), LOOKUPS[step][rank], HEAD[step][rank])
        join_lookups([table], loss)
        loss.backward()
        expected = _reference_gradients(tied, step, world_size)
        start, stop = table.bounds[rank]
        worst = max(worst, (table.shard.grad - expected["embed.weight"][:, start:stop]).abs().max().item())
        for name, parameter in model.named_parameters():
            if name != "embed.shard" and parameter.grad is not None:
                worst = max(worst, (parameter.grad - expected[name]).abs().max().item())
    assert isinstance(model.embed, ShardedEmbedding)
    return worst


@pytest.mark.distributed
@pytest.mark.parametrize("tied", [False, True])
def test_embrace_rank_that_skips_the_table_does_not_hang(tied: bool) -> None:
    results = run_distributed(branches_against_single_process, world_size=2, args=(tied,), timeout_s=60)
    assert max(results) <= 1e-6


# ------------------------------------------------------------------ watchdog: pure core

def test_stall_clock_fires_only_after_the_timeout_without_progress() -> None:
    clock = StallClock(timeout_s=10)
    busy = {"0": GroupProgress(5, 4), "1": GroupProgress(2, 2)}
    assert clock.observe(busy, now=0.0) == []
    assert clock.observe(busy, now=9.9) == []
    assert clock.observe(busy, now=10.0) == ["0"]
    moved = {"0": GroupProgress(5, 5), "1": GroupProgress(3, 2)}
    assert clock.observe(moved, now=11.0) == []  # a collective completed: the clock starts again
    assert clock.observe({"0": GroupProgress(5, 5)}, now=100.0) == []  # nothing in flight is no hang


def test_pulse_clock_and_absent_ranks() -> None:
    pulse = PulseClock(dead_after_s=5, start=0.0)
    assert pulse.observe({1: b"1", 2: None}, now=1.0) == []
    assert pulse.observe({1: b"2", 2: None}, now=5.0) == [2]  # never beat within 5 s
    assert pulse.observe({1: b"2", 2: b"1"}, now=9.9) == []
    assert pulse.observe({1: b"2", 2: b"1"}, now=10.1) == [1]
    slow_start = PulseClock(dead_after_s=5, start=0.0, first_beat_s=60)  # a peer still importing is not lost
    assert slow_start.observe({1: b"1", 2: None}, now=1.0) == []
    assert slow_start.observe({1: b"1", 2: None}, now=30.0) == [1]  # seen, then silent for 29 s
    assert slow_start.observe({1: b"2", 2: b"1", 3: None}, now=50.0) == []
    assert slow_start.observe({1: b"3", 2: b"1", 3: None}, now=56.0) == [2]  # seen: 5 s apply
    assert slow_start.observe({1: b"4", 2: b"2", 3: None}, now=60.0) == [3]  # never seen within 60 s
    reports = {0: {"1": GroupProgress(2, 1)}, 1: {"1": GroupProgress(1, 1), "0": GroupProgress(1, 0)}}
    assert absent_ranks("1", 2, [0, 1, 2], reports) == ([1], [2])
    message = describe_stall(0, 3.0, [StuckCollective("1", (0, 1, 2), 2, "gloo:all_gather", (1,), (2,),
                                                      {1: waiting_in(reports[1])})], "faults.collective_timeout_s")
    assert "gloo:all_gather (collective #2 of process group 1, ranks [0, 1, 2])" in message
    assert "rank 1 did not arrive (waits in collective #1 of group 0)" in message
    assert "rank 2 did not report" in message and "faults.collective_timeout_s" in message
    assert "ckpt/step=3.ckpt" in describe_lost(0, {2: "host h, pid 7"}, "ckpt/step=3.ckpt")


def test_read_progress_counts_a_wait_on_a_receive_until_it_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo's flight recorder has no point-to-point ops: a stage blocked on a receive from a stalled stage looked
    like a rank waiting in nothing, and no alarm came before gloo's own timeout (F15)."""
    collectives = {"0": {"last_enqueued_collective": "3", "last_completed_collective": "3"}}
    monkeypatch.setattr(watchdog, "_dump_json", lambda reader, include_collectives: {"pg_status": collectives})
    arrived = threading.Event()

    class Work:
        def wait(self) -> bool:
            return arrived.wait(30)

    def isend(tensor: torch.Tensor, dst: int | None = None, group: object = None, tag: int = 0,
              group_dst: int | None = None) -> Work:
        return Work()

    def irecv(tensor: torch.Tensor, src: int | None = None, group: object = None, tag: int = 0,
              group_src: int | None = None) -> Work:
        return Work()

    c10d, facade = SimpleNamespace(isend=isend, irecv=irecv), SimpleNamespace(isend=isend, irecv=irecv)
    restore = count_point_to_point_waits([c10d, facade])
    try:
        assert facade.irecv is c10d.irecv is not irecv
        posted = facade.irecv(torch.empty(2), 1)
        clock = StallClock(timeout_s=10)
        assert clock.observe(read_progress(), now=0.0) == []
        assert clock.observe(read_progress(), now=20.0) == []  # posted early, not waited on: computing is no hang
        waiter = threading.Thread(target=posted.wait)
        waiter.start()
        deadline = time.monotonic() + 10
        while not read_progress()[POINT_TO_POINT].waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert read_progress()["0"] == GroupProgress(3, 3)
        assert clock.observe(read_progress(), now=21.0) == []
        assert clock.observe(read_progress(), now=31.0) == [POINT_TO_POINT]
        assert [str(op) for op in open_point_to_point_waits()] == ["irecv from rank 1"]
        assert waiting_in(read_progress()) == "waits in a point-to-point send or receive"
        arrived.set()
        waiter.join()
        assert not read_progress()[POINT_TO_POINT].waiting
        assert clock.observe(read_progress(), now=32.0) == []
    finally:
        arrived.set()
        restore()
    assert facade.irecv is irecv and c10d.isend is isend
    stuck = StuckCollective(POINT_TO_POINT, (0, 1), 5, "irecv from rank 1", (1,), (), {1: "waits in no collective"})
    assert ("irecv from rank 1 (point-to-point, ranks [0, 1]): rank 1 did not arrive (waits in no collective)"
            in describe_stall(0, 15.0, [stuck], "FaultWatch(timeout_s=...)"))


# ------------------------------------------------------------------ watchdog and lost ranks: real processes

def _skip_a_collective(rank: int, world_size: int, port: int, directory: str) -> None:
    """Rank 1 skips an all-gather on a subgroup that rank 0 issues: both would wait for gloo's timeout."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)))
    Watchdog(timeout_s=3, dead_after_s=30, poll_s=0.5, timeout_option="faults.collective_timeout_s").start()
    tensor = torch.ones(4)
    dist.all_reduce(tensor, group=group)
    if rank == 0:
        dist.all_gather_into_tensor(torch.empty(4 * world_size), tensor, group=group)
    dist.all_reduce(tensor)
    time.sleep(120)


def _stall_between_stages(rank: int, world_size: int, port: int, directory: str) -> None:
    """Two pipeline-like stages: both compute past the timeout with a receive posted (no hang), then rank 1
    stalls while rank 0 waits on a receive from it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    Watchdog(timeout_s=3, dead_after_s=30, poll_s=0.5).start()
    tensor, peer = torch.ones(4), 1 - rank
    early = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer), dist.P2POp(dist.irecv, torch.empty(4), peer)])
    time.sleep(6)
    for work in early:
        work.wait()
    Path(directory, f"waits{rank}").write_text(str(time.time()))
    if rank == 0:
        dist.recv(tensor, 1)
    time.sleep(120)


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.trainer.global_rank == 2 and batch_idx == 3:
            Path(self.trainer.default_root_dir, "killed_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        features, target = batch
        return F.mse_loss(self.layer(features), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _kill_a_rank(rank: int, world_size: int, port: int, directory: str) -> None:
    """Lightning DDP over ``world_size`` single-process "nodes"; rank 2 is killed at its fourth step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(rank), LOCAL_RANK="0",
                      WORLD_SIZE=str(world_size))
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    callbacks = [ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=1, save_top_k=-1),
                 FaultWatch(timeout_s=30, dead_after_s=10, poll_s=0.5)]
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=world_size, strategy="ddp", max_steps=40,
                         default_root_dir=directory, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    trainer.fit(_Regression(), DataLoader(data, batch_size=4))


def _rank_entry(scenario: Callable[..., None], rank: int, world_size: int, port: int, directory: str) -> None:
    """One rank, its stderr (where the watchdog writes before it ends the process) kept in a file."""
    with open(Path(directory) / f"rank{rank}.err", "wb") as err:
        os.dup2(err.fileno(), 2)
    scenario(rank, world_size, port, directory)


def _launch(scenario: Callable[..., None], world_size: int, directory: Path) -> list[tuple[int, str, float]]:
    """(exit status, stderr, time.time() by which it had exited) of each rank of ``scenario``.

    The ranks are forked from the forkserver ``run_distributed`` preloads (torch, Lightning): they start
    in well under a second. The harness itself cannot be used: it fails a run as soon as a rank dies.
    """
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "lightning.pytorch", __name__])
    port = find_free_port()
    processes = [context.Process(target=_rank_entry, args=(scenario, rank, world_size, port, str(directory)),
                                 daemon=True) for rank in range(world_size)]
    for process in processes:
        process.start()
    ended: dict[int, float] = {}
    start = time.monotonic()
    try:
        while len(ended) < world_size and time.monotonic() - start < 120:
            ended.update({i: time.time() for i, p in enumerate(processes) if i not in ended and p.exitcode is not None})
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()
    return [(p.exitcode, (directory / f"rank{i}.err").read_text(errors="replace"), ended.get(i, float("inf")))
            for i, p in enumerate(processes)]


@pytest.mark.distributed
def test_watchdog_names_the_collective_the_group_and_the_rank_that_did_not_arrive(tmp_path: Path) -> None:
    (code0, err0, _), (code1, err1, _) = _launch(_skip_a_collective, 2, tmp_path)
    # the first rank to finish its report exits with EXIT_CODE; its peer, once it has written its own, may be
    # ended first by its blocked collective failing as that connection closes
    assert EXIT_CODE in (code0, code1) and code0 not in (0, None) and code1 not in (0, None), (err0[-2000:],
                                                                                               err1[-2000:])
    assert "gloo:all_gather" in err0 and "collective #2 of process group 1, ranks [0, 1]" in err0, err0[-2000:]
    assert "rank 1 did not arrive (waits in collective #1 of group 0)" in err0, err0[-2000:]
    assert "did not arrive" in err1 and "faults.collective_timeout_s" in err1, err1[-2000:]


@pytest.mark.distributed
def test_watchdog_names_a_receive_a_stalled_pipeline_stage_never_answers(tmp_path: Path) -> None:
    (code0, err0, end0), (code1, err1, _) = _launch(_stall_between_stages, 2, tmp_path)
    assert EXIT_CODE in (code0, code1) and code0 not in (0, None) and code1 not in (0, None), (err0[-2000:],
                                                                                               err1[-2000:])
    waited = end0 - float((tmp_path / "waits0").read_text())
    assert 3 <= waited < 3 + 10, (waited, err0[-2000:])  # the timeout, the peers' reports and the exit
    assert ("irecv from rank 1 (point-to-point, ranks [0, 1]): rank 1 did not arrive (waits in no collective)"
            in err0), err0[-2000:]
    assert "rank 0 found a hang" in err1, err1[-2000:]


@pytest.mark.distributed
def test_survivors_of_a_killed_rank_name_it_and_the_newest_checkpoint(tmp_path: Path) -> None:
    results = _launch(_kill_a_rank, 3, tmp_path)
    assert results[2][0] == -signal.SIGKILL
    killed_at = float((tmp_path / "killed_at").read_text())
    for code, err, ended_by in results[:2]:
        assert code != 0 and ended_by - killed_at < 60, (code, ended_by - killed_at)
        assert "RankLostError" in err and "lost rank 2 (host" in err, err[-3000:]
        newest = re.search(r"checkpoint: (\S+\.ckpt)", err)
        assert newest is not None and Path(newest.group(1)).name.startswith("step="), err[-3000:]


# ------------------------------------------------------------------ EmbRace under Lightning DDP

LM_VOCAB, LM_DIM = 128, 8


class _SkippingLM(pl.LightningModule):
    """Next-token model; rank 1's second batch takes a branch without the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(LM_VOCAB, LM_DIM)
        self.start = nn.Parameter(torch.zeros(LM_DIM))
        self.mix = nn.Linear(LM_DIM, LM_DIM)
        self.head = nn.Linear(LM_DIM, LM_VOCAB)
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        inputs = tokens[:, :-1]
        if self.global_rank == 1 and batch_idx == 1:
            hidden = self.start.expand(*inputs.shape, LM_DIM)
        else:
            hidden = self.embed(inputs) + self.start
        loss = F.cross_entropy(self.head(torch.tanh(self.mix(hidden))).flatten(0, 1), tokens[:, 1:].flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def lightning_skip_run(rank: int, world_size: int, method: str) -> dict[str, object]:
    from lightning_merak.callbacks.sparse_comm import SparseCommunication

    pl.seed_everything(0, verbose=False)
    model = _SkippingLM()
    tokens = torch.randint(0, LM_VOCAB, (4 * 2 * 4, 9), generator=torch.Generator().manual_seed(1))
    callbacks: list[pl.Callback] = []
    if method == "embrace":
        sparse = SparseCommunication("embrace", min_table_rows=LM_VOCAB)
        callbacks = [sparse]
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy="ddp_find_unused_parameters_true",
                         max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=4))
    return {"losses": model.losses, "mix": model.mix.weight.detach().clone()}


@pytest.mark.distributed
def test_embrace_under_lightning_ddp_trains_like_dense_when_a_rank_skips_the_table() -> None:
    dense = run_distributed(lightning_skip_run, world_size=2, args=("dense",), timeout_s=90)
    embrace = run_distributed(lightning_skip_run, world_size=2, args=("embrace",), timeout_s=90)
    for expected, actual in zip(dense, embrace):
        assert actual["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        torch.testing.assert_close(actual["mix"], expected["mix"], rtol=1e-5, atol=1e-6)
