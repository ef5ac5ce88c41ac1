"""A multi-node launch whose ranks could never all join is refused before launch instead of hanging.

Lightning's launcher (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; no torchrun) with ``NODE_RANK`` >=
``trainer.num_nodes``: that node's ranks died in gloo's ``rank < size`` after launch and node 0 waited forever;
``trainer.num_nodes=2`` with no launcher and no ``MASTER_ADDR`` waited on 127.0.0.1 for a node that cannot come.
"""

from __future__ import annotations

import pytest

from lightning_merak.cli.checks import check_node_launch
from lightning_merak.cli.overrides import ConfigError

from .test_train import refused

ADDRESS = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("num_nodes", "environ", "message"),
    [
        (2, {**ADDRESS, "NODE_RANK": "2"}, "NODE_RANK=2 but trainer.num_nodes=2: nodes are numbered 0..1"),
        (1, {"NODE_RANK": "1"}, "NODE_RANK=1 but trainer.num_nodes=1"),
        (2, {**ADDRESS, "GROUP_RANK": "-1"}, "GROUP_RANK=-1 but trainer.num_nodes=2"),
        (2, {**ADDRESS, "NODE_RANK": "one"}, "NODE_RANK='one' is not a whole number"),
        (2, {"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "RANK=4 but WORLD_SIZE=4: ranks are numbered 0..3"),
        (2, {}, "MASTER_ADDR, MASTER_PORT, NODE_RANK are not set"),
        (2, {"MASTER_ADDR": "10.0.0.1", "NODE_RANK": "1"}, "MASTER_PORT is not set"),
        (3, {**ADDRESS}, "set on each node NODE_RANK (0..2), MASTER_ADDR (node 0's address) and the same MASTER_PORT"),
    ],
)
def test_a_launch_that_would_hang_is_refused(num_nodes, environ, message):
    with pytest.raises(ConfigError, match="docs/guides/multi-node.md|whole number|ranks are numbered") as refusal:
        check_node_launch(num_nodes, environ)
    assert message in str(refusal.value)


@pytest.mark.parametrize(
    ("num_nodes", "environ"),
    [
        (1, {}),  # one node: Lightning's launcher or merak-train's own starts the ranks
        (1, {"NODE_RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}),  # a rank started
        (2, {**ADDRESS, "NODE_RANK": "1"}),
        (2, {"LOCAL_RANK": "0", "NODE_RANK": "1"}),  # processes started by hand: their own address settings
        (2, {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "GROUP_RANK": "1", "LOCAL_RANK": "1"}),
        (4, {"SLURM_NTASKS": "8", "NODE_RANK": "7"}),  # SLURM numbers the nodes itself; NODE_RANK is not read
    ],
)
def test_a_launch_every_rank_can_join_is_accepted(num_nodes, environ):
    check_node_launch(num_nodes, environ)


def test_merak_train_refuses_a_node_rank_past_the_nodes_before_launch(tmp_path, monkeypatch, capsys):
    for name, value in {**ADDRESS, "NODE_RANK": "2"}.items():
        monkeypatch.setenv(name, value)
    code, output = refused(["strategy=ddp", "trainer.num_nodes=2", "trainer.devices=1"], tmp_path, monkeypatch,
                           capsys)
    assert code == 2, output.out + output.err
    assert "merak-train: error: NODE_RANK=2 but trainer.num_nodes=2" in output.err, output.err
