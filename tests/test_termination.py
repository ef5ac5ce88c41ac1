"""SIGTERM and SIGINT end every rank promptly: ``merak-train``'s two ranks, a rank blocked in a gloo
collective, a launched rank whose parent died, and forwarding only to launched ranks."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_merak.distributed import termination
from lightning_merak.testing import find_free_port

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def _live_members(group: int) -> list[int]:
    """Processes of process group ``group`` that have not exited (zombies do not count)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] != b"Z":
            members.append(int(entry))
    return members


def _wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s:.0f}s: {what}")
        time.sleep(0.2)


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    """The next stdout line of ``process`` (a pipe in text mode), failing after ``timeout_s``."""
    if not select.select([process.stdout], [], [], timeout_s)[0]:
        raise AssertionError(f"no line within {timeout_s:.0f}s")
    line = process.stdout.readline()
    if not line:
        raise AssertionError(f"the process exited with {process.wait()} before printing a line")
    return line.strip()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_merak_train_ends_both_ranks(tmp_path, signum):
    """Only rank 0 is signalled, as SLURM signals the task it started; rank 1 is its child."""
    command = [
        sys.executable, "-m", "lightning_merak.cli.train", "trainer.max_steps=100000", "data.num_sequences=128",
        "trainer.enable_progress_bar=false", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
        f"hydra.run.dir={tmp_path}",
    ]
    with open(tmp_path / "output.log", "w") as log:
        # SIGINT at its default, as from a terminal: a shell running this suite in the background
        # starts it with SIGINT ignored, which every child inherits (and Python then keeps)
        process = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=_default_sigint)
    try:
        # a checkpoint of step 2 means both ranks trained two steps (its save is collective)
        _wait_until(lambda: any((tmp_path / "checkpoints").glob("*.ckpt")) or process.poll() is not None,
                    180, "no checkpoint of step 2 yet")
        assert process.poll() is None, (tmp_path / "output.log").read_text()[-4000:]
        assert len(_live_members(process.pid)) >= 2, "rank 1 should be running next to rank 0"
        process.send_signal(signum)
        _wait_until(lambda: process.poll() is not None and not _live_members(process.pid), 60,
                    f"merak-train processes still running after {signum.name} (this process's SIGINT handler: "
                    f"{signal.getsignal(signal.SIGINT)}); output:\n" + (tmp_path / "output.log").read_text()[-2000:])
        output = (tmp_path / "output.log").read_text()
        # a stopped run does not pass for a finished one (Lightning's SIGTERM stop alone exits with status 0)
        assert process.returncode != 0 and "merak-train: done" not in output, output[-2000:]
        if signum == signal.SIGTERM:
            # every rank stops at the step they agreed on (AgreedSigtermStop) and merak-train names it and the
            # checkpoint; the termination watcher's ending (after Lightning's in-handler broadcast met another
            # collective on the peer: 2 of 4 runs by hand before the agreed stop) does not pass
            assert process.returncode == 128 + signal.SIGTERM, output[-2000:]
            assert "merak-train: stopped by SIGTERM at step" in output and "resume from " in output, output[-2000:]
            assert "lightning_merak: SIGTERM ended rank" not in output, output[-2000:]
    finally:
        _kill_group(process.pid)
        process.wait()


BLOCKED_RANK = textwrap.dedent(
    """
    import datetime, signal, sys, time
    import torch.distributed as dist
    from lightning_merak.distributed.termination import install_termination_handler

    rank = int(sys.argv[1])
    received = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))  # like Lightning's: a flag
    install_termination_handler(grace_s=1.0)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    print("joined", flush=True)
    if rank == 0:
        time.sleep(60)  # never joins the barrier
    else:
        dist.barrier()
    """
)


def test_rank_blocked_in_a_collective_ends_on_sigterm(tmp_path):
    """The Python handler (a flag, like Lightning's) cannot run while the main thread waits in gloo."""
    script = tmp_path / "blocked_rank.py"
    script.write_text(BLOCKED_RANK)
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(rank)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
        for rank in range(2)
    ]
    try:
        for process in ranks:
            assert _read_line(process, 60) == "joined"
        time.sleep(1.0)  # rank 1 is inside dist.barrier() by now
        ranks[1].send_signal(signal.SIGTERM)
        _, errors = ranks[1].communicate(timeout=15)
        assert ranks[1].returncode == 128 + signal.SIGTERM, errors
        assert "SIGTERM ended rank 1" in errors
    finally:
        for process in ranks:
            _kill_group(process.pid)
            process.wait()


PARENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, "LOCAL_RANK": "1"})
    print(child.pid, flush=True)
    time.sleep(60)
    """
)
CHILD = textwrap.dedent(
    """
    import signal, threading
    from lightning_merak.distributed.termination import install_termination_handler
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # only the deadline can end it
    install_termination_handler(grace_s=1.0)
    threading.Event().wait()
    """
)


def test_launched_rank_ends_when_its_parent_dies():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], env=ENV, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        child = int(_read_line(parent, 30))
        time.sleep(3.0)  # the child has installed its handler
        parent.kill()
        parent.wait()
        _wait_until(lambda: child not in _live_members(parent.pid), 10,
                    f"the launched rank (pid {child}) outlived its parent")
    finally:
        _kill_group(parent.pid)
        parent.wait()


def test_signals_are_forwarded_only_to_launched_ranks(monkeypatch):
    """A child with another LOCAL_RANK is a launched rank; one with none (a DataLoader worker) is not."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    rank = subprocess.Popen(sleeper, env={**os.environ, "LOCAL_RANK": "1"})
    worker = subprocess.Popen(sleeper, env={k: v for k, v in os.environ.items() if k != "LOCAL_RANK"})
    try:
        _wait_until(lambda: {rank.pid, worker.pid} <= set(termination._children()), 10, "the children are not listed")
        termination._forward(signal.SIGTERM)
        assert rank.wait(timeout=10) == -signal.SIGTERM
        assert worker.poll() is None
    finally:
        for process in (rank, worker):
            process.kill()
            process.wait()
