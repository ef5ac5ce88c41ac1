"""Multi-node launches on real processes: a restart's ranks agree on one attempt whatever their restart counts, and
ranks started with other settings refuse before their first collective (tests/test_rendezvous.py: the rest)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_merak.testing import find_free_port

REPO = Path(__file__).resolve().parents[1]

_RANK = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from lightning_merak.cli.elastic import install_checked_rendezvous
time.sleep(float(sys.argv[2]))  # a rank that comes late
install_checked_rendezvous({"data.seed": int(sys.argv[1]), "trainer.max_steps": 6}, ranks_per_node=1)
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()} sum {total.item():g}", flush=True)
dist.destroy_process_group()
"""
"""One rank: the checked rendezvous with ``data.seed`` = argv[1] standing for its settings, then an all-reduce of
ones (2 on every rank, as a single process adding two ones gets)."""


def _ranks(launch: dict[str, str], seeds: tuple[str, str], delays: tuple[float, float] = (0.0, 0.0),
           counts: tuple[int, int] | None = None) -> list[tuple[int, str, str]]:
    """Start ranks 0 and 1 as a launcher would; each one's (status, stdout, stderr)."""
    processes = []
    for rank in range(2):
        env = {**launch, "PYTHONPATH": str(REPO), "RANK": str(rank), "WORLD_SIZE": "2"}
        if counts is not None:
            env["TORCHELASTIC_RESTART_COUNT"] = str(counts[rank])
        processes.append(subprocess.Popen([sys.executable, "-c", _RANK, seeds[rank], str(delays[rank])], cwd=REPO,
                                          env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [process.communicate(timeout=60) for process in processes]
    return [(process.returncode, out.strip(), err) for process, (out, err) in zip(processes, outputs)]


@pytest.mark.distributed
def test_ranks_restarted_with_different_restart_counts_meet_in_one_attempt() -> None:
    """torchrun raises TORCHELASTIC_RESTART_COUNT only on the node whose worker failed: a prefix made of it put the
    two nodes' ranks under different keys (one under the dead attempt's), and the restart hung."""
    # torchrun's agent store: one for the whole job
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    launch = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent_store.port),
              "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "rendezvous-test"}

    def attempt(counts: tuple[int, int], delays: tuple[float, float]) -> list[str]:
        outcomes = _ranks(launch, ("7", "7"), delays, counts)
        assert [status for status, _, _ in outcomes] == [0, 0], [err[-2000:] for _, _, err in outcomes]
        return [out for _, out, _ in outcomes]

    assert attempt((0, 0), (0.0, 0.0)) == ["rank 0 sum 2", "rank 1 sum 2"]
    # node 1's worker failed (its count rose), node 0 restarted for it (its count did not); node 0's rank comes late,
    # so rank 1 finds the dead attempt's addresses first if the attempts share keys
    assert attempt((0, 1), (3.0, 0.0)) == ["rank 0 sum 2", "rank 1 sum 2"]


@pytest.mark.distributed
def test_two_processes_started_with_other_seeds_both_refuse_before_training() -> None:
    """A node with another data.seed trained another generated language to the end with status 0."""
    launch = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}
    launch.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 hosts the store, as without a launcher
    for status, out, err in _ranks(launch, ("7", "99")):
        assert status != 0 and "sum" not in out
        assert "data.seed: 99 on rank 1 (host" in err and ", 7 on rank 0" in err, err[-2000:]
