"""``torchrun --nnodes 2`` across two emulated hosts trains DDP and merak3d pp=2 as one host does.

Each host is a network namespace whose only way out is a shaped veth link to a bridge
(:class:`~lightning_merak.testing.netem.EmulatedCluster`, as the benchmarks build it); each runs one
torchrun agent with one rank, the agents meeting at host 0's address. The losses must equal the
same run's on one host (two ranks on loopback). Needs root and iproute2; elsewhere the test skips
and says why. Every run is bounded in time and the namespaces are always deleted.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_merak.checkpoint.files import is_complete
from lightning_merak.testing import find_free_port, netem
from lightning_merak.testing.netem import EmulatedCluster, EmulationUnavailable, LinkSpec

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
RUN_TIMEOUT_S = 240
TINY_RUN = (
    "model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
    "data.vocab_size=64", "data.seq_len=16", "data.batch_size=4", "data.num_sequences=64",
    "trainer.max_steps=4", "trainer.val_check_interval=null", "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "optim.warmup_steps=2",
)
STRATEGIES = {"ddp": ("strategy=ddp",), "merak3d_pp2": ("strategy=merak3d", "strategy.pipeline_parallel=2")}
ENV = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _unavailable_reason() -> str | None:
    try:
        netem.check_prerequisites()
    except EmulationUnavailable as refusal:
        return str(refusal)
    return None


def _losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as metrics:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(metrics) if row.get("train/loss")}


def _train_command(run_dir: Path, strategy: str, *torchrun: str, nodes: int, devices: int) -> list[str]:
    return [TORCHRUN, *torchrun, "-m", "lightning_merak.cli.train", *TINY_RUN, *STRATEGIES[strategy],
            f"trainer.num_nodes={nodes}", f"trainer.devices={devices}", f"hydra.run.dir={run_dir}"]


def _one_host(run_dir: Path, strategy: str) -> dict[int, float]:
    command = _train_command(run_dir, strategy, "--nproc-per-node", "2", "--master-port", str(find_free_port()),
                             nodes=1, devices=2)
    completed = subprocess.run(command, cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True,
                               timeout=RUN_TIMEOUT_S)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return _losses(run_dir)


@pytest.mark.skipif(_unavailable_reason() is not None, reason=f"no emulated hosts here: {_unavailable_reason()}")
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_two_emulated_hosts_train_as_one_host_does(tmp_path: Path, strategy: str) -> None:
    run_dir = tmp_path / "two_hosts"  # one directory on the file system both hosts share, as a cluster's would be
    with EmulatedCluster(2, LinkSpec(rate_mbit=1000), name_prefix="merak-multinode") as cluster:
        hosts = [
            cluster.launch(node, _train_command(
                run_dir, strategy, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                "--master-addr", cluster.master_addr, "--master-port", str(cluster.master_port), nodes=2, devices=1),
                extra_env=ENV, cwd=REPO)
            for node in range(2)
        ]
        results = cluster.wait_all(hosts, timeout_s=RUN_TIMEOUT_S)
        namespaces = set(cluster.names.all_namespaces(2))
    assert "merak-train: done" in results[0].stdout
    assert is_complete(run_dir / "checkpoints" / "final.ckpt")
    assert not namespaces & set(netem.list_namespaces()), "the emulated hosts' namespaces were left behind"
    two_hosts = _losses(run_dir)
    one_host = _one_host(tmp_path / "one_host", strategy)
    assert sorted(two_hosts) == sorted(one_host) == list(range(4))
    assert [two_hosts[step] for step in range(4)] == pytest.approx([one_host[step] for step in range(4)], rel=1e-6)
