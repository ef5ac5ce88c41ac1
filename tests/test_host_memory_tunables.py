"""glibc heap tunables: merged into GLIBC_TUNABLES without overriding the user's, exported by merak3d's launcher
to the ranks it starts, and probed in a running process."""

import os
import subprocess
import sys

import pytest

from lightning_merak.distributed.host_memory import (
    HEAP_TUNABLES,
    export_heap_tunables,
    heap_tunables_applied,
    with_heap_tunables,
)

LINUX = sys.platform.startswith("linux")


def test_tunables_join_the_users_and_keep_their_values() -> None:
    assert with_heap_tunables({}) == "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"
    merged = with_heap_tunables({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7:glibc.malloc.arena_max=2"})
    assert dict(item.split("=") for item in merged.split(":")) == {
        "glibc.malloc.tcache_count": "7", "glibc.malloc.mxfast": "0", "glibc.malloc.arena_max": "2"}


@pytest.mark.skipif(not LINUX, reason="glibc")
def test_export_sets_the_environment_given() -> None:
    environ = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    export_heap_tunables(environ)
    assert environ["GLIBC_TUNABLES"].split(":")[-1] == "glibc.malloc.arena_max=2"
    assert all(f"{name}={value}" in environ["GLIBC_TUNABLES"] for name, value in HEAP_TUNABLES.items())


@pytest.mark.skipif(not LINUX, reason="glibc")
def test_merak3d_launcher_starts_ranks_with_the_tunables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks Lightning's script launcher starts inherit os.environ: it must hold the tunables by then."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_merak.strategies.merak3d import Merak3DStrategy

    monkeypatch.setenv("GLIBC_TUNABLES", "")  # restored after the test, so later subprocesses start as before
    strategy = Merak3DStrategy(data_parallel=2)
    strategy.cluster_environment = LightningEnvironment()
    assert not strategy.cluster_environment.creates_processes_externally
    strategy.parallel_devices = [None, None]
    strategy._configure_launcher()
    assert os.environ["GLIBC_TUNABLES"] == with_heap_tunables({})


@pytest.mark.distributed
@pytest.mark.skipif(heap_tunables_applied() is None, reason="glibc's mallinfo2")
def test_probe_tells_a_process_started_with_the_tunables() -> None:
    script = "from lightning_merak.distributed.host_memory import heap_tunables_applied as a; print(a())"
    seen = []
    for tunables in ("", with_heap_tunables({})):
        env = {**os.environ, "GLIBC_TUNABLES": tunables}
        seen.append(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                   check=True, timeout=60).stdout.split()[-1])
    assert seen == ["False", "True"]


@pytest.mark.distributed
@pytest.mark.skipif(heap_tunables_applied() is None, reason="glibc's mallinfo2")
def test_restart_runs_the_same_command_again_with_the_tunables() -> None:
    """merak-train's first rank is the process the user started: it restarts itself with the tunables once."""
    script = ("import sys; from lightning_merak.distributed.host_memory import heap_tunables_applied, "
              "restart_with_heap_tunables; print('started', sys.argv[1:], flush=True); restart_with_heap_tunables(); "
              "print(heap_tunables_applied())")
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    out = subprocess.run([sys.executable, "-c", script, "x=1"], env=env, capture_output=True, text=True, check=True,
                         timeout=60).stdout.splitlines()
    assert out == ["started ['x=1']", "started ['x=1']", "True"]


@pytest.mark.parametrize(("local_rank", "on_host", "level"), [
    (None, True, "WARNING"), ("0", True, "WARNING"), ("1", True, "INFO"), ("0", False, "INFO")])
def test_a_rank_without_the_tunables_warns_once_per_node_where_tensors_live_on_the_host(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, local_rank: str | None, on_host: bool,
        level: str) -> None:
    from lightning_merak.distributed import host_memory

    monkeypatch.setattr(host_memory, "heap_tunables_applied", lambda: False)
    monkeypatch.setattr(host_memory, "disable_fast_bins", lambda: None)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    with caplog.at_level("INFO", logger=host_memory.__name__):
        host_memory.prepare_heap(tensors_on_host=on_host)
    assert [record.levelname for record in caplog.records] == [level]
    assert "GLIBC_TUNABLES=glibc.malloc.tcache_count=0" in caplog.records[0].getMessage()
