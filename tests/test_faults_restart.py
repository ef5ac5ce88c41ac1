"""Atomic checkpoints, elastic restart with ``resume=auto``, and refusing checkpoints that would run code.

The restart test kills merak-train's saving rank inside a checkpoint save (made deterministic by the
``LIGHTNING_MERAK_TEST_STALL_SAVE`` hook of :mod:`lightning_merak.checkpoint.files`) under
``torchrun --max-restarts 1``; the restarted ranks resume by themselves from the newest complete
checkpoint and their losses equal an uninterrupted run's from there on.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_merak.checkpoint.checkpoint_io import SafeCheckpointIO
from lightning_merak.checkpoint.files import (
    STALL_ENV,
    atomic_file,
    is_complete,
    newest_complete,
    partial_path,
    publish_directory,
)
from lightning_merak.checkpoint.resume import resume_path
from lightning_merak.checkpoint.safe_load import SafeFileSystemReader, UnsafeCheckpointError, load_torch_file
from lightning_merak.testing import find_free_port

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TINY_RUN = (
    "model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
    "data.vocab_size=64", "data.seq_len=16", "data.batch_size=4", "data.num_sequences=64",
    "trainer.max_steps=6", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "optim.warmup_steps=2",
)
STRATEGIES = {"ddp": ("strategy=ddp",), "merak3d_pp2": ("strategy=merak3d", "strategy.pipeline_parallel=2")}


# Atomic files and the newest complete checkpoint -------------------------------------------------------------


def _ckpt(path: Path, step: int, written_at: float) -> Path:
    torch.save({"global_step": step, "weight": torch.full((4,), float(step))}, path)
    os.utime(path, (written_at, written_at))
    return path


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = _ckpt(tmp_path / "step=2.ckpt", 2, 1000)
    with pytest.raises(RuntimeError, match="disk full"), atomic_file(path) as temporary:
        temporary.write_bytes(b"PK\x03\x04 half a checkpoint")
        raise RuntimeError("disk full")
    assert load_torch_file(path)["global_step"] == 2
    assert not partial_path(path).exists()


def test_newest_complete_skips_partial_and_truncated_checkpoints(tmp_path: Path) -> None:
    _ckpt(tmp_path / "step=2.ckpt", 2, 1000)
    _ckpt(tmp_path / "step=4.ckpt", 4, 2000)
    assert newest_complete(tmp_path) == tmp_path / "step=4.ckpt"
    # written without atomic renames and cut short: the zip's central directory (at its end) is missing
    whole = (tmp_path / "step=4.ckpt").read_bytes()
    (tmp_path / "step=6.ckpt").write_bytes(whole[: len(whole) // 2])
    os.utime(tmp_path / "step=6.ckpt", (3000, 3000))
    _ckpt(partial_path(tmp_path / "step=8.ckpt"), 8, 4000)  # a save killed before its rename
    (tmp_path / "last.ckpt").symlink_to("step=2.ckpt")
    os.utime(tmp_path / "last.ckpt", (5000, 5000), follow_symlinks=False)
    # a merak3d directory killed before rank 0 wrote its state
    (tmp_path / "step=10.ckpt").mkdir()
    (tmp_path / "step=10.ckpt" / ".metadata").write_bytes(b"")
    assert not is_complete(tmp_path / "step=6.ckpt")
    assert newest_complete(tmp_path) == tmp_path / "step=4.ckpt"
    assert resume_path("auto", tmp_path) == tmp_path / "step=4.ckpt"
    assert resume_path(str(tmp_path), tmp_path / "elsewhere") == tmp_path / "step=4.ckpt"
    assert resume_path("auto", tmp_path / "none yet") is None
    with pytest.raises(ValueError, match="cut short"):
        resume_path(str(tmp_path / "step=6.ckpt"), tmp_path)
    with pytest.raises(ValueError, match="resume=auto"):
        resume_path(str(tmp_path / "missing.ckpt"), tmp_path)


def test_a_published_directory_replaces_an_older_one_whole(tmp_path: Path) -> None:
    final = tmp_path / "final.ckpt"
    for step in (1, 2):
        temporary = partial_path(final)
        temporary.mkdir()
        (temporary / ".metadata").write_bytes(b"index")
        _ckpt(temporary / "lightning.ckpt", step, 1000 + step)
        publish_directory(temporary, final)
    assert load_torch_file(final / "lightning.ckpt")["global_step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final.ckpt"]


def test_checkpoint_io_saves_atomically_and_loads_weights_only(tmp_path: Path) -> None:
    io = SafeCheckpointIO()
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.ones(2)}}, tmp_path / "a" / "step=3.ckpt")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step=3.ckpt"]
    assert io.load_checkpoint(tmp_path / "a" / "step=3.ckpt")["global_step"] == 3


# Nothing unpickled -------------------------------------------------------------------------------------------


class _Payload:
    """Unpickling this creates ``marker``: what a malicious checkpoint would do (run code) made visible."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def _malicious_checkpoint(path: Path, marker: Path) -> Path:
    torch.save({"global_step": 1, "state_dict": {"model.w": torch.ones(2)}, "hf_model": _Payload(marker)}, path)
    return path


def test_a_checkpoint_carrying_a_pickle_payload_is_refused_naming_the_fix(tmp_path: Path) -> None:
    from lightning_merak.hf.export import export_checkpoint

    marker = tmp_path / "payload ran"
    path = _malicious_checkpoint(tmp_path / "evil.ckpt", marker)
    for load in (lambda: SafeCheckpointIO().load_checkpoint(path), lambda: export_checkpoint(path, tmp_path / "out")):
        with pytest.raises(UnsafeCheckpointError, match="add_safe_globals"):
            load()
    assert not marker.exists()


def test_a_merak3d_directory_with_a_payload_in_its_index_or_state_is_refused(tmp_path: Path) -> None:
    import pickle

    from lightning_merak.hf.export import export_checkpoint

    marker = tmp_path / "payload ran"
    directory = tmp_path / "step=2.ckpt"
    directory.mkdir()
    (directory / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    torch.save({"global_step": 2}, directory / "lightning.ckpt")
    with pytest.raises(UnsafeCheckpointError, match="pathlib.Path.touch|pathlib.PosixPath.touch"):
        SafeFileSystemReader(directory).read_metadata()
    with pytest.raises(UnsafeCheckpointError, match="add_safe_globals"):
        export_checkpoint(directory, tmp_path / "out")
    _malicious_checkpoint(directory / "lightning.ckpt", marker)
    with pytest.raises(UnsafeCheckpointError, match="add_safe_globals"):
        export_checkpoint(directory, tmp_path / "out")
    assert not marker.exists()


# Elastic restart ---------------------------------------------------------------------------------------------

_RESTARTED_RANKS = """
import os, signal, time
import torch, torch.distributed as dist
from lightning_merak.cli.elastic import install_checked_rendezvous
install_checked_rendezvous()
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 1 and rank == 0:
    time.sleep(3)  # rank 1 of the new attempt looks for rank 0 before rank 0 has published its address
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"attempt {attempt} rank {rank} sum {total.item():g}", flush=True)
if attempt == 0 and rank == 0:
    os.kill(os.getpid(), signal.SIGKILL)
dist.destroy_process_group()
"""


@pytest.mark.distributed
def test_restarted_ranks_do_not_find_the_failed_attempts_addresses(tmp_path: Path) -> None:
    """torchrun keeps one store across restarts; without the per-attempt prefix rank 1 read dead rank 0's
    address and gloo failed with "Connection refused"."""
    script = tmp_path / "ranks.py"
    script.write_text(_RESTARTED_RANKS)
    completed = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "1", "--master-port", str(find_free_port()),
         str(script)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "attempt 1 rank 0 sum 2" in completed.stdout and "attempt 1 rank 1 sum 2" in completed.stdout



def _losses(run_dir: Path) -> dict[int, float]:
    """``step → train/loss`` from the run's CSV log; a restarted run's later rows win."""
    losses = {}
    with open(run_dir / "csv" / "metrics.csv") as metrics:
        for row in csv.DictReader(metrics):
            if row.get("train/loss"):
                losses[int(row["step"])] = float(row["train/loss"])
    return losses


def _torchrun(run_dir: Path, strategy: tuple[str, ...], env: dict[str, str], log: Path) -> subprocess.Popen:
    command = [TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "1", "--master-port", str(find_free_port()),
               "-m", "lightning_merak.cli.train", *TINY_RUN,
               *strategy, "resume=auto", f"hydra.run.dir={run_dir}"]
    with open(log, "w") as output:
        return subprocess.Popen(command, cwd=REPO, env={"PYTHONPATH": str(REPO), **os.environ, **env},
                                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(process: subprocess.Popen, log: Path, timeout_s: float) -> str:
    try:
        process.wait(timeout=timeout_s)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    output = log.read_text()
    assert process.returncode == 0, output[-4000:]
    return output


_SAVE_STEP_4 = """
import sys, torch
from lightning_merak.checkpoint.checkpoint_io import SafeCheckpointIO
SafeCheckpointIO().save_checkpoint({"global_step": 4, "w": torch.ones(1000)}, sys.argv[1])
"""


@pytest.mark.distributed
def test_a_process_killed_inside_a_file_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """The single-file path (DDP's checkpoints): SIGKILL between writing and renaming."""
    _ckpt(tmp_path / "step=2.ckpt", 2, 1000)
    saver = subprocess.Popen([sys.executable, "-c", _SAVE_STEP_4, str(tmp_path / "step=4.ckpt")], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO), STALL_ENV: "step=4.ckpt"})
    try:
        marker = tmp_path / "step=4.ckpt.stalled"
        deadline = time.monotonic() + 60
        while not marker.exists() or not marker.read_text():
            assert saver.poll() is None and time.monotonic() < deadline, "the save did not reach its stall"
            time.sleep(0.1)
        saver.kill()
    finally:
        saver.kill()
        saver.wait()
    assert partial_path(tmp_path / "step=4.ckpt").exists() and not (tmp_path / "step=4.ckpt").exists()
    assert resume_path("auto", tmp_path) == tmp_path / "step=2.ckpt"
    assert SafeCheckpointIO().load_checkpoint(tmp_path / "step=2.ckpt")["global_step"] == 2


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["merak3d_pp2"])  # ddp's file path: the test above; each run costs ~3 launches
def test_a_rank_killed_inside_a_save_restarts_and_resumes_the_loss_trajectory(tmp_path: Path, strategy: str) -> None:
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    straight = _torchrun(tmp_path / "straight", STRATEGIES[strategy], env, tmp_path / "straight.log")
    _finish(straight, tmp_path / "straight.log", 240)

    run_dir = tmp_path / "killed"
    checkpoints = run_dir / "checkpoints"
    process = _torchrun(run_dir, STRATEGIES[strategy], {**env, STALL_ENV: "step=4.ckpt"}, tmp_path / "killed.log")
    try:
        marker = checkpoints / "step=4.ckpt.stalled"
        deadline = time.monotonic() + 180
        while not marker.exists() or not marker.read_text():
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()[-4000:]
            time.sleep(0.2)
        assert partial_path(checkpoints / "step=4.ckpt").exists() and not (checkpoints / "step=4.ckpt").exists()
        assert is_complete(checkpoints / "step=2.ckpt")
        os.kill(int(marker.read_text()), signal.SIGKILL)  # the saving rank, between writing and renaming
    finally:
        output = _finish(process, tmp_path / "killed.log", 240)
    assert f"merak-train: resuming from {checkpoints / 'step=2.ckpt'}" in output
    assert newest_complete(checkpoints) == checkpoints / "final.ckpt"
    expected, resumed = _losses(tmp_path / "straight"), _losses(run_dir)
    after = sorted(step for step in expected if step >= 2)
    assert [resumed[step] for step in after] == pytest.approx([expected[step] for step in after], rel=1e-6)
