"""Tests for lightning_merak.testing.netem.

The pure parts (names, addresses, tc commands, refusals) run anywhere. The real
clusters need root and iproute2 and are skipped, with the reason, without them;
each uses its own name prefix so a failure points at the test that leaked.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_merak.testing import netem
from lightning_merak.testing.netem import (
    ClusterNames,
    EmulatedCluster,
    EmulationUnavailable,
    LinkSpec,
    LoopbackCluster,
    NetworkSetupError,
    QdiscUnavailable,
    RankFailure,
    RankTimeout,
)

MIB = 1024 * 1024
REPO_ROOT = Path(__file__).resolve().parents[1]
# Rank program: time all-reduces of a float32 message on the gloo group; rank 0 prints the fastest.
_TIMED_ALL_REDUCE = (
    "import json, sys, time\n"
    "import torch, torch.distributed as dist\n"
    "torch.set_num_threads(1)\n"
    "dist.init_process_group('gloo')\n"
    "message = torch.ones(int(sys.argv[1]) // 4)\n"
    "times = []\n"
    "for _ in range(4):\n"
    "    dist.barrier()\n"
    "    start = time.perf_counter()\n"
    "    dist.all_reduce(message)\n"
    "    times.append(time.perf_counter() - start)\n"
    "if dist.get_rank() == 0:\n"
    "    print(json.dumps(min(times[1:])), flush=True)\n"
    "dist.destroy_process_group()\n"
)


def _emulation_unavailable_reason() -> str | None:
    try:
        netem.check_prerequisites()
    except EmulationUnavailable as refusal:
        return str(refusal)
    return None


needs_emulation = pytest.mark.skipif(
    _emulation_unavailable_reason() is not None, reason=_emulation_unavailable_reason() or ""
)


def _leftovers(prefix: str) -> list[str]:
    """Namespaces, and links in this namespace, whose name carries ``prefix``."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return [ns for ns in netem.list_namespaces() if ns.startswith(prefix)] + [
        line for line in links.splitlines() if prefix in line
    ]


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_tbf_burst_holds_one_timer_tick_of_traffic() -> None:
    assert netem.tbf_burst_bytes(25_000, hz=250) == 12_500_000
    assert netem.tbf_burst_bytes(1_000, hz=250) == 500_000
    assert netem.tbf_burst_bytes(100, hz=1000) == netem.LARGEST_GSO_PACKET_BYTES


def test_tbf_limit_adds_queue_delay_worth_of_bytes() -> None:
    assert netem.tbf_limit_bytes(1_000, burst_bytes=500_000) == 500_000 + 2_500_000


def test_kernel_hz_is_a_plausible_tick_rate() -> None:
    assert netem.kernel_hz() in (100, 250, 300, 1000)


def test_link_spec_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        LinkSpec(rate_mbit=0)
    with pytest.raises(ValueError):
        LinkSpec(rate_mbit=100, latency_us=-1)


def test_namespace_names_carry_their_owner_pid() -> None:
    names = ClusterNames("merak-netem", owner_pid=4242, serial=7)
    assert names.all_namespaces(2) == ["merak-netem-4242-7-hub", "merak-netem-4242-7-r0", "merak-netem-4242-7-r1"]
    assert netem.owner_pid_of(names.rank_namespace(1), "merak-netem") == 4242
    assert netem.owner_pid_of(names.hub, "merak-net") is None
    assert netem.owner_pid_of("merak-netemtest-1-0-hub", "merak-netem") is None
    assert netem.owner_pid_of("merak-netem-1-0-eth0", "merak-netem") is None


def test_rank_addresses_stay_inside_the_subnet() -> None:
    subnet = ipaddress.IPv4Network("10.213.0.0/24")
    assert str(netem.rank_address(subnet, 0)) == "10.213.0.1/24"
    assert str(netem.rank_address(subnet, 253)) == "10.213.0.254/24"
    with pytest.raises(ValueError):
        netem.rank_address(subnet, 254)
    with pytest.raises(ValueError):
        EmulatedCluster(255, LinkSpec(100))
    with pytest.raises(ValueError):
        EmulatedCluster(2, LinkSpec(100), subnet=ipaddress.IPv4Network("8.8.8.0/24"))


def test_setup_commands_only_touch_the_clusters_namespaces() -> None:
    names = ClusterNames("p", owner_pid=1, serial=0)
    commands = netem.setup_commands(names, 2, LinkSpec(1_000), netem.DEFAULT_SUBNET, hz=250)
    ours = set(names.all_namespaces(2))
    for command in commands:
        target = command[3] if command[:3] == ["ip", "netns", "add"] else command[command.index("-n") + 1]
        assert target in ours, command
    shaped = [(c[2], c[c.index("dev") + 1]) for c in commands if "tbf" in c]
    assert sorted(shaped) == [("p-1-0-hub", "r0"), ("p-1-0-hub", "r1"), ("p-1-0-r0", "eth0"), ("p-1-0-r1", "eth0")]
    addresses = [c[c.index("add") + 1] for c in commands if "addr" in c]
    assert addresses == ["10.213.0.1/24", "10.213.0.2/24"]


def test_unshaped_link_has_no_qdisc_and_latency_uses_netem_above_tbf() -> None:
    assert netem.link_qdisc_commands("ns", "eth0", LinkSpec(None), hz=250) == []
    netem_cmd, tbf_cmd = netem.link_qdisc_commands("ns", "eth0", LinkSpec(500, latency_us=100), hz=250)
    assert netem_cmd[netem_cmd.index("root") :][:5] == ["root", "handle", "1:", "netem", "delay"]
    assert netem_cmd[netem_cmd.index("delay") + 1] == "50us"
    assert tbf_cmd[tbf_cmd.index("parent") + 1] == "1:1"
    assert tbf_cmd[tbf_cmd.index("rate") + 1] == "500mbit"


def test_command_failures_name_the_fix() -> None:
    netem_command = ["tc", "-n", "ns", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "1us"]
    missing = netem.command_failure(netem_command, "Error: Specified qdisc kind is unknown.\n")
    assert isinstance(missing, QdiscUnavailable) and "sch_netem" in str(missing) and "latency_us=0" in str(missing)
    refused = netem.command_failure(["ip", "netns", "add", "x"], "mount --make-shared: Operation not permitted")
    assert isinstance(refused, EmulationUnavailable) and "CAP_SYS_ADMIN" in str(refused)
    assert isinstance(netem.command_failure(["ip", "link"], "weird"), NetworkSetupError)


def test_rank_command_and_environment() -> None:
    cluster = EmulatedCluster(2, LinkSpec(100))
    namespace = cluster.names.rank_namespace(1)
    assert cluster.rank_command(1, ["python", "-V"]) == ["ip", "netns", "exec", namespace, "python", "-V"]
    env = cluster.rank_env(1, {"EXTRA": "yes"})
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"], env["WORLD_SIZE"]) == ("10.213.0.1", "29500", "1", "2")
    assert (env["GLOO_SOCKET_IFNAME"], env["EXTRA"]) == ("eth0", "yes")
    assert EmulatedCluster(2, LinkSpec(100)).names.serial != cluster.names.serial


def test_refuses_without_root_and_restores_signal_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(EmulationUnavailable, match="needs root"):
        with EmulatedCluster(2, LinkSpec(100)):
            pass
    assert signal.getsignal(signal.SIGTERM) is before


def test_refuses_without_iproute2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netem.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netem.shutil, "which", lambda tool: None)
    with pytest.raises(EmulationUnavailable, match="ip and tc from iproute2"):
        with EmulatedCluster(2, LinkSpec(100)):
            pass


@pytest.mark.distributed
def test_loopback_ranks_get_rendezvous_env_and_failures_name_the_rank() -> None:
    with LoopbackCluster(2) as cluster:
        results = cluster.run(_python("import os; print(os.environ['RANK'], os.environ['MASTER_ADDR'])"), timeout_s=30)
        assert [r.stdout.split() for r in results] == [["0", "127.0.0.1"], ["1", "127.0.0.1"]]
        fail_rank_1 = "import os, sys; sys.exit('boom' if os.environ['RANK'] == '1' else 0)"
        with pytest.raises(RankFailure, match="rank 1 exited with code 1") as failure:
            cluster.run(_python(fail_rank_1), timeout_s=30)
    assert failure.value.rank == 1 and "boom" in failure.value.stderr_tail


@needs_emulation
def test_shaped_all_reduce_is_held_to_the_set_rate_and_leaves_nothing() -> None:
    # Behaviour, not speed: the link is shaped, so even the fastest all-reduce cannot beat the set rate by
    # more than the token bucket (~100 kB of 4 MiB here). A loaded machine only makes it slower, so this
    # cannot flake. How close to the rate the link gets is a figure: benchmarks.collectives prints it
    # (vs_set_rate).
    prefix, rate_mbit, message_bytes = "merak-netemtest-rate", 200.0, 4 * MIB
    with EmulatedCluster(2, LinkSpec(rate_mbit), name_prefix=prefix) as cluster:
        results = cluster.run(_python(_TIMED_ALL_REDUCE) + [str(message_bytes)], timeout_s=120)
        assert len(_leftovers(prefix)) == 3
    fastest_s = json.loads(results[0].stdout.splitlines()[-1])
    bus_mbit = message_bytes * 8 / fastest_s / 1e6  # 2 ranks: each sends the whole message once
    assert bus_mbit <= 1.15 * rate_mbit, f"{bus_mbit:.1f} Mbit/s measured on a {rate_mbit:g} Mbit/s link"
    assert _leftovers(prefix) == []


@needs_emulation
def test_failing_rank_is_named_and_cluster_removed() -> None:
    prefix = "merak-netemtest-fail"
    with pytest.raises(RankFailure) as failure:
        with EmulatedCluster(2, LinkSpec(200), name_prefix=prefix) as cluster:
            cluster.run(_python("import os; assert os.environ['RANK'] != '1', 'rank one fails'"), timeout_s=30)
    assert failure.value.rank == 1 and "rank one fails" in failure.value.stderr_tail
    assert _leftovers(prefix) == []


@needs_emulation
def test_hanging_rank_is_killed_at_the_timeout_and_reaped() -> None:
    prefix = "merak-netemtest-hang"
    hang_rank_1 = "import os, time; time.sleep(60 if os.environ['RANK'] == '1' else 0)"
    with EmulatedCluster(2, LinkSpec(200), name_prefix=prefix) as cluster:
        processes = [cluster.launch(rank, _python(hang_rank_1)) for rank in range(2)]
        started = time.monotonic()
        with pytest.raises(RankTimeout) as timeout:
            cluster.wait_all(processes, timeout_s=2)
        # Liveness bound, not a speed figure: killed at the deadline, not left to sleep its 60 s out;
        # half of that leaves a loaded machine ample room past the 2 s deadline.
        assert time.monotonic() - started < 30
    assert timeout.value.pending_ranks == [1]
    for process in processes:
        assert process.popen.returncode is not None
        with pytest.raises(ProcessLookupError):
            os.kill(process.popen.pid, 0)
    assert _leftovers(prefix) == []


@needs_emulation
def test_latency_is_emulated_or_refused_naming_netem() -> None:
    prefix = "merak-netemtest-latency"
    try:
        with EmulatedCluster(2, LinkSpec(200, latency_us=500), name_prefix=prefix) as cluster:
            qdiscs = subprocess.run(
                ["tc", "-n", cluster.names.hub, "qdisc", "show"], capture_output=True, text=True, check=True
            ).stdout
            assert "netem" in qdiscs and "tbf" in qdiscs
    except QdiscUnavailable as refusal:
        assert "sch_netem" in str(refusal)
    assert _leftovers(prefix) == []


@pytest.mark.distributed
@needs_emulation
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_tears_the_cluster_down(signum: int) -> None:
    prefix = f"merak-netemtest-sig{signum}"
    hold_cluster = (
        "import time; from lightning_merak.testing.netem import EmulatedCluster, LinkSpec\n"
        f"with EmulatedCluster(2, LinkSpec(100), name_prefix={prefix!r}):\n"
        "    print('up', flush=True); time.sleep(30)\n"
    )
    holder = subprocess.Popen(_python(hold_cluster), cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "up\n"
        assert len(_leftovers(prefix)) == 3
        holder.send_signal(signum)
        holder.wait(timeout=15)
    finally:
        holder.kill()
        holder.wait()
    assert holder.returncode != 0
    assert _leftovers(prefix) == []


@needs_emulation
def test_cleanup_stale_removes_only_namespaces_of_dead_owners() -> None:
    prefix = "merak-netemtest-stale"
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead_owned, live_owned = f"{prefix}-{finished.pid}-0-hub", f"{prefix}-{os.getpid()}-99-hub"
    for namespace in (dead_owned, live_owned):
        subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        assert netem.cleanup_stale(prefix) == [dead_owned]
        assert _leftovers(prefix) == [live_owned]
    finally:
        subprocess.run(["ip", "netns", "delete", live_owned], check=False)
    assert _leftovers(prefix) == []
