"""A sharded checkpoint is complete only with every shard its index lists, and the final one goes beside the others.

Nodes started by hand (``MASTER_ADDR``, ``NODE_RANK``; no launcher) with Hydra's default output directory name
theirs by the start time, a second apart: Lightning's periodic checkpoints went to rank 0's directory, but
merak-train saved ``final.ckpt`` under each node's own, so node 0's held only its shard, its index listed both, and
``resume=auto`` picked it as the newest complete checkpoint, whose load failed on the missing shard.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_merak.checkpoint.files import (
    NotSharedCheckpointError,
    is_complete,
    missing_shards,
    newest_complete,
    partial_path,
    publish_directory,
    refuse_unseen_shards,
)
from lightning_merak.testing import find_free_port, run_distributed

TINY_NODE = (
    "model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
    "data.vocab_size=64", "data.seq_len=16", "data.batch_size=4", "data.num_sequences=64",
    "trainer.max_steps=3", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false", "logger=[]", "trainer.num_nodes=2", "trainer.devices=1",
)


def _sharded_checkpoint(path: Path, written_at: float) -> Path:
    """A merak3d-like checkpoint directory: a DCP index over two shard files, and ``lightning.ckpt``."""
    dcp.save({"a": torch.arange(64.0), "b": torch.ones(8, 8)}, checkpoint_id=path)
    torch.save({"global_step": 2}, path / "lightning.ckpt")
    os.utime(path / "lightning.ckpt", (written_at, written_at))
    return path


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process, as asked
def test_a_directory_lacking_a_shard_its_index_lists_is_not_complete(tmp_path: Path) -> None:
    older = _sharded_checkpoint(tmp_path / "step=2.ckpt", 1000)
    newer = _sharded_checkpoint(tmp_path / "final.ckpt", 2000)
    shards = sorted(path.name for path in newer.glob("*.distcp"))
    assert shards and missing_shards(newer) == [] and is_complete(newer)
    assert newest_complete(tmp_path) == newer

    (newer / shards[0]).unlink()  # another node's shard, written where this host does not see it
    assert missing_shards(newer) == [shards[0]]
    assert not is_complete(newer)
    assert newest_complete(tmp_path) == older  # resume=auto never picks it

    whole = (older / shards[0]).read_bytes()
    (older / shards[0]).write_bytes(whole[: len(whole) // 2])  # a shard cut short
    assert missing_shards(older) == [shards[0]] and newest_complete(tmp_path) is None


def _publish_rank(rank: int, world_size: int, root: str, shared: bool) -> str:
    """Write a checkpoint whose ranks each hold a shard, each rank into its own node's directory unless ``shared``,
    then publish it as ``ShardedCheckpointer.save`` does."""
    node_dir = Path(root) / ("shared" if shared else f"node{rank}")
    path = node_dir / "final.ckpt"
    temporary = partial_path(path)
    dcp.save({f"rank{rank}": torch.full((16,), float(rank))}, checkpoint_id=temporary)
    try:
        refuse_unseen_shards(temporary, path, dist.get_rank())
    except NotSharedCheckpointError as error:
        return str(error)
    if rank == 0:
        torch.save({"global_step": 3}, temporary / "lightning.ckpt")
        publish_directory(temporary, path)
    dist.barrier()
    return "published" if is_complete(path) else "incomplete"


@pytest.mark.distributed
def test_rank_zero_refuses_to_publish_shards_it_does_not_see_on_every_rank(tmp_path: Path) -> None:
    apart = run_distributed(_publish_rank, 2, args=(str(tmp_path), False), timeout_s=60)
    assert all("__1_0.distcp" in message and "file system every node sees" in message for message in apart), apart
    assert not (tmp_path / "node0" / "final.ckpt").exists()  # nothing published

    shared = run_distributed(_publish_rank, 2, args=(str(tmp_path), True), timeout_s=60)
    assert shared == ["published", "published"]


@pytest.mark.distributed
def test_nodes_with_their_own_output_directories_save_the_final_checkpoint_whole_in_rank_zeros(tmp_path) -> None:
    port = str(find_free_port())
    nodes = []
    for node in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node)}
        command = [sys.executable, "-m", "lightning_merak.cli.train", *TINY_NODE,
                   f"hydra.run.dir={tmp_path / f'node{node}'}"]
        nodes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        logs = [process.communicate(timeout=240)[0] for process in nodes]
    finally:
        for process in nodes:
            process.kill()
            process.wait()
    assert [process.returncode for process in nodes] == [0, 0], "\n".join(logs)

    final = tmp_path / "node0" / "checkpoints" / "final.ckpt"
    assert sorted(path.name for path in final.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert missing_shards(final) == [] and is_complete(final)
    assert newest_complete(final.parent) == final
    assert not any((tmp_path / "node1").rglob("*.ckpt*")), "node 1 kept checkpoint files in its own directory"


def test_a_checkpoint_file_replaces_a_sharded_directory_of_its_name(tmp_path: Path) -> None:
    from lightning_merak.checkpoint.files import atomic_file

    final = tmp_path / "final.ckpt"
    (final / "sub").mkdir(parents=True)  # an earlier attempt's sharded final checkpoint
    (final / ".metadata").write_bytes(b"x")
    with atomic_file(final) as temporary:
        temporary.write_bytes(b"file")
    assert final.is_file() and final.read_bytes() == b"file"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["final.ckpt"]
