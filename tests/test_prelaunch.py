"""Ranks started early by ``merak-train``: they wait at rank 0's gate, leave quietly when it closes, and a
failed rank fails rank 0's run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from lightning_merak.cli.prelaunch import GATE_VARIABLE, PrelaunchedRanks, launched_externally

WAITING_RANK = textwrap.dedent(
    """
    import sys
    from lightning_merak.cli.prelaunch import wait_at_gate
    wait_at_gate()
    print("past the gate", flush=True)
    sys.exit(int(sys.argv[1]))
    """
)


def _waiting_rank(exit_status: int = 0) -> tuple[subprocess.Popen[str], int]:
    """A process that waits at a gate as an early-started rank does; returns it and the gate's write end."""
    read_end, write_end = os.pipe()
    process = subprocess.Popen([sys.executable, "-c", WAITING_RANK, str(exit_status)], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(read_end,),
                               env={**os.environ, GATE_VARIABLE: str(read_end), "LOCAL_RANK": "1"})
    os.close(read_end)
    return process, write_end


def test_a_launcher_is_recognised_by_its_variables():
    assert not launched_externally({"PATH": "/bin"})
    for name in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "WORLD_SIZE"):
        assert launched_externally({name: "2"})


def test_without_a_gate_nothing_waits(monkeypatch):
    from lightning_merak.cli.prelaunch import wait_at_gate

    monkeypatch.delenv(GATE_VARIABLE, raising=False)
    started = time.monotonic()
    wait_at_gate()
    assert time.monotonic() - started < 1.0


@pytest.mark.distributed
def test_a_closed_gate_ends_the_rank_quietly_and_an_open_one_lets_it_run():
    closed, closed_gate = _waiting_rank(exit_status=3)
    opened, open_gate = _waiting_rank(exit_status=0)
    os.close(closed_gate)  # rank 0 ended before its checks passed
    assert closed.wait(120) == 0
    assert closed.stdout.read() == ""
    ranks = PrelaunchedRanks([opened], [open_gate])
    ranks.start()
    ranks.finish(timeout_s=120)
    assert opened.stdout.read() == "past the gate\n"


@pytest.mark.distributed
def test_a_failed_rank_fails_rank_0s_finish():
    failing, gate = _waiting_rank(exit_status=3)
    os.write(gate, b"1")
    os.close(gate)
    assert failing.wait(120) == 3
    with pytest.raises(RuntimeError, match="local rank 1 ended with status 3"):
        PrelaunchedRanks([failing], []).finish(timeout_s=10)


@pytest.mark.distributed
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="ranks start early only where each has a core")
def test_a_refused_run_ends_its_early_ranks_without_a_word(tmp_path):
    """A refusal made after the ranks started (the strategy's checks) ends rank 0; its ranks leave quietly."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_merak.cli.train", "trainer.devices=2", "strategy.data_parallel=3",
         f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("world size 2 is not divisible by the fixed degrees") == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]  # a refusal names the fix; no traceback
    assert "launcher" not in output, output[-3000:]
    deadline = time.monotonic() + 30
    while _processes_running_in(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _processes_running_in(tmp_path), "an early-started rank outlived the refused run"


def _processes_running_in(run_dir) -> list[int]:
    """Processes whose command line names ``run_dir`` (the early ranks get it as their Hydra run directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if str(run_dir).encode() in cmdline.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_ranks_started_here_share_the_cores(monkeypatch):
    import torch

    from lightning_merak.cli.prelaunch import share_cores

    threads = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "0")  # recorded, so the test's own setting is undone after it
        monkeypatch.delenv("OMP_NUM_THREADS")
        share_cores(len(os.sched_getaffinity(0)) * 2)  # more ranks than cores: one thread each
        assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        share_cores(2)  # the user's choice stands
        assert os.environ["OMP_NUM_THREADS"] == "3" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
