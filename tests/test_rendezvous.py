"""Multi-node launches: a rendezvous in a used store gives a fresh attempt, a missing rank and differing settings
are named at the rendezvous, and two hosts that share a hostname are told apart by the watchdog (the launches on
real processes: tests/test_rendezvous_ranks.py)."""

from __future__ import annotations

import importlib
import logging
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_merak.cli import elastic
from lightning_merak.cli.elastic import RendezvousFailed, install_checked_rendezvous, join_ranks
from lightning_merak.cli.same_config import SettingsDiffer, comparable_settings, setting_differences
from lightning_merak.distributed import watchdog
from lightning_merak.testing import find_free_port


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _join_in_threads(store: dist.TCPStore, settings: list[dict], timeout_s: float = 10.0) -> list[object]:
    """``join_ranks`` of ranks 0..n-1 in threads of this process: each one's token, or the error it raised."""
    results: list[object] = [None] * len(settings)

    def rank_main(rank: int) -> None:
        try:
            results[rank] = join_ranks(store, rank, len(settings), timeout_s, settings[rank], ranks_per_node=1)
        except (RendezvousFailed, SettingsDiffer) as error:
            results[rank] = error

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in reversed(range(len(settings)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


# ---------------------------------------------------------------------------------------------- restarts


def test_a_rendezvous_in_a_used_store_gives_every_rank_one_new_token() -> None:
    """torchrun's store keeps a failed attempt's keys: the next attempt's ranks must share a token of their own."""
    store = _store()
    first = _join_in_threads(store, [{}, {}])
    assert first[0] == first[1] and isinstance(first[0], str)
    second = _join_in_threads(store, [{}, {}, {}])
    assert second[0] == second[1] == second[2] and second[0] != first[0]


# ---------------------------------------------------------------------------------------------- missing ranks


def test_a_rank_that_never_comes_is_named_with_progress_while_waiting(monkeypatch, caplog) -> None:
    monkeypatch.setattr(elastic, "PROGRESS_EVERY_S", 0.3)
    caplog.set_level(logging.WARNING, logger=elastic.__name__)
    assert isinstance(_join_in_threads(_store(), [{}], timeout_s=1.0)[0], str)  # a world of one: at once
    store = _store()
    with pytest.raises(RendezvousFailed, match=r"1/2 ranks joined .* missing: rank 1 \(node 1\)\. Likely causes: .*"
                                           r"the same NODE_RANK"):
        join_ranks(store, 0, 2, 1.0, {}, ranks_per_node=1)
    assert "1/2 joined after 0 s; missing: rank 1 (node 1)" in caplog.text


def test_one_node_rank_given_twice_is_named_not_taken_for_a_full_world() -> None:
    """Two processes of rank 1 counted as two joined ranks: rank 0 went on without rank 2."""
    store, outcomes = _store(), {}

    def rank_main(name: str, rank: int) -> None:
        try:
            outcomes[name] = join_ranks(store, rank, 3, 3.0, {}, ranks_per_node=1)
        except RendezvousFailed as error:
            outcomes[name] = error

    threads = {name: threading.Thread(target=rank_main, args=(name, rank)) for name, rank in
               (("rank 0", 0), ("rank 1", 1), ("rank 1 again", 1))}
    for thread in threads.values():
        thread.start()
        time.sleep(0.5)  # rank 0 answers each in turn
    for thread in threads.values():
        thread.join(60)
    assert isinstance(outcomes["rank 0"], RendezvousFailed)
    assert "missing: rank 2 (node 2)" in str(outcomes["rank 0"])
    assert "rank 1 (node 1) came from two processes each" in str(outcomes["rank 0"])
    assert str(outcomes["rank 1"]) == str(outcomes["rank 1 again"]) == str(outcomes["rank 0"])


def test_init_process_group_names_the_missing_node_instead_of_torchs_client_count(monkeypatch) -> None:
    """Without the checked rendezvous torch said "Timed out after 3 seconds waiting for clients. 1/2 clients
    joined." after the whole timeout, naming no node and no fix."""
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    monkeypatch.setitem(handlers, "env", handlers["env"])  # put back as found
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    install_checked_rendezvous({}, ranks_per_node=1)
    with pytest.raises(RendezvousFailed, match=r"missing: rank 1 \(node 1\)"):
        dist.init_process_group("gloo", rank=0, world_size=2, timeout=timedelta(seconds=2))
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------- settings


def test_settings_compare_without_per_node_output_paths() -> None:
    node0 = comparable_settings({"output_dir": "/runs/a", "logger": {"csv": {"save_dir": "/runs/a"}},
                                 "data": {"seed": 7, "vocab_size": 128}, "callbacks": []})
    node1 = comparable_settings({"output_dir": "/runs/b", "logger": {"csv": {"save_dir": "/runs/b"}},
                                 "data": {"seed": 99, "vocab_size": 128}, "callbacks": []})
    assert "output_dir" not in node0 and node0["logger.csv.save_dir"] == "<output_dir>"
    assert setting_differences(node1, node0) == [["data.seed", 99, 7]]


def test_a_rank_with_other_settings_is_refused_on_every_rank_naming_the_key() -> None:
    outcomes = _join_in_threads(_store(), [{"data.seed": 7, "data.vocab_size": 128},
                                           {"data.seed": 7, "data.vocab_size": 128},
                                           {"data.seed": 99, "data.vocab_size": 128}])
    for outcome in outcomes:
        assert isinstance(outcome, SettingsDiffer), outcome
        assert "data.seed: 99 on rank 2" in str(outcome) and "7 on rank 0" in str(outcome)
        assert "vocab_size" not in str(outcome)


# ---------------------------------------------------------------------------------------------- host identity


def test_two_hosts_with_one_hostname_are_told_apart_by_boot_and_pid_namespace(monkeypatch) -> None:
    monkeypatch.setattr(watchdog, "_read_boot_id", lambda: "boot-a")
    monkeypatch.setattr(watchdog, "_read_pid_namespace", lambda: "pid:[4026531836]")
    here = watchdog.this_host_identity()
    monkeypatch.setattr(watchdog, "_read_pid_namespace", lambda: "pid:[4026532999]")  # a container's
    assert watchdog.this_host_identity() != here
    monkeypatch.setattr(watchdog, "_read_boot_id", lambda: None)  # no /proc: the hostname alone
    monkeypatch.setattr(watchdog, "_read_pid_namespace", lambda: None)
    assert watchdog.this_host_identity() == watchdog.host_identity(watchdog.socket.gethostname(), None, None)


def test_a_peer_of_the_same_hostname_in_another_pid_namespace_is_not_lost_by_its_pid() -> None:
    """The watchdog looked up a healthy peer's PID in its own PID namespace, found none, and ended the run."""
    dog = watchdog.Watchdog()
    dog.host, dog.identity = "node", watchdog.host_identity("node", "boot-a", "pid:[1]")
    unused_pid = 2**22 + 1  # above Linux's pid_max: no process here has it
    container = {"host": "node", "identity": watchdog.host_identity("node", "boot-a", "pid:[2]"), "pid": unused_pid}
    assert dog._find_lost([], {1: container}, set()) == {}
    same_namespace = {**container, "identity": dog.identity}
    assert dog._find_lost([], {1: same_namespace}, set()) == {1: f"host node, pid {unused_pid}"}


def test_the_watchdog_keeps_its_keys_under_the_attempts_prefix(monkeypatch) -> None:
    """A restarted attempt's watchdog read the dead attempt's peers and alarms from the store's unprefixed keys."""
    from torch.distributed import distributed_c10d as c10d

    agent_store = _store()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # as a launcher sets them
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    dist.init_process_group("gloo", store=dist.PrefixStore("merak_attempt_x", agent_store), rank=0, world_size=1)
    try:
        watchdog.Watchdog()._connect().set("merak_watchdog/peer/0", "{}")
        assert c10d._get_default_store().check(["merak_watchdog/peer/0"])  # where this attempt's ranks look
    finally:
        dist.destroy_process_group()
    assert not agent_store.check(["merak_watchdog/peer/0"])  # where any attempt's ranks would look
