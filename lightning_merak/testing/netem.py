"""Emulated cluster network: N torch.distributed ranks on shaped links, on one host.

Each rank runs in its own Linux network namespace whose only interface, ``eth0``,
is one end of a veth pair. The other end sits in a separate "hub" namespace,
enslaved to a Linux bridge, so ranks talk through a switch-like hop. ``tc`` shapes
both directions of every link, as on a full-duplex NIC: egress of ``eth0`` inside
the rank's namespace (rank -> switch) and egress of the hub-side end (switch -> rank).

Kernel finding, measured on the development machine (kernel 6.18,
``CONFIG_NET_SCH_NETEM`` unset): ``tc qdisc add ... netem`` fails with "Specified
qdisc kind is unknown", while tbf, htb and pfifo, bridges and veths all work. Rate
is therefore shaped with tbf. Latency needs netem: where the kernel has it, netem
is put above tbf; where it does not, asking for ``latency_us > 0`` raises
:class:`QdiscUnavailable` instead of silently emulating a zero-latency link.

Everything lives in namespaces this module creates: addresses come from a private
/24 assigned only to interfaces inside them and there is no route out, so no packet
can reach any other address. Namespaces are named
``<prefix>-<owner pid>-<serial>-{hub,r<rank>}``, so concurrent runs never collide.
Leaving a cluster (normally, by exception, by Ctrl-C or SIGTERM) kills its ranks
and deletes its namespaces, which takes the veths and qdiscs with them; a process
killed outright leaves them behind for :func:`cleanup_stale`, which every new
cluster runs first. Needs root and iproute2's ``ip`` and ``tc``.
"""

from __future__ import annotations

import contextlib
import gzip
import ipaddress
import itertools
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any, TypeVar

from lightning_merak.testing.cpu_quota import CpuQuota, pid_alive
from lightning_merak.util.ports import free_rendezvous_port

DEFAULT_PREFIX = "merak-netem"
DEFAULT_SUBNET = ipaddress.IPv4Network("10.213.0.0/24")
RANK_INTERFACE = "eth0"
BRIDGE_INTERFACE = "br0"
# Each cluster has private namespaces, so a fixed rendezvous port cannot collide.
EMULATED_MASTER_PORT = 29500
# Lowest common CONFIG_HZ: when the real value is unknown it yields the larger, safe burst.
FALLBACK_KERNEL_HZ = 100
# veth hands tbf TCP super-packets of up to this size; a smaller burst forces tbf to split them.
LARGEST_GSO_PACKET_BYTES = 65536
# How long a packet may wait for tokens before tbf drops it: enough for TCP to keep the link busy.
QUEUE_DELAY_S = 0.02
# netem holds every delayed packet in its own queue, counted in packets.
NETEM_QUEUE_PACKETS = 100_000
NETWORK_COMMAND_TIMEOUT_S = 15.0
KILL_WAIT_S = 5.0
POLL_INTERVAL_S = 0.05
STDERR_TAIL_CHARS = 2000

_serials = itertools.count()
_LauncherT = TypeVar("_LauncherT", bound="_RankLauncher")


class EmulationUnavailable(RuntimeError):
    """This host cannot build an emulated cluster; the message names the fix."""


class QdiscUnavailable(EmulationUnavailable):
    """The kernel lacks a queueing discipline that the requested link needs."""


class NetworkSetupError(RuntimeError):
    """An ``ip``/``tc`` command failed for a reason other than a missing feature."""


class RankFailure(RuntimeError):
    """A rank exited non-zero; the other ranks were killed."""

    def __init__(self, rank: int, returncode: int, stderr_tail: str) -> None:
        super().__init__(f"rank {rank} exited with code {returncode}; stderr tail:\n{stderr_tail}")
        self.rank = rank
        self.returncode = returncode
        self.stderr_tail = stderr_tail


class RankTimeout(RuntimeError):
    """Ranks were still running at the deadline; all ranks were killed."""

    def __init__(self, timeout_s: float, stderr_tails: Mapping[int, str]) -> None:
        tails = "\n".join(f"--- rank {rank} stderr tail:\n{tail}" for rank, tail in stderr_tails.items())
        super().__init__(f"ranks {sorted(stderr_tails)} still running after {timeout_s:g} s; killed all\n{tails}")
        self.timeout_s = timeout_s
        self.pending_ranks = sorted(stderr_tails)


@dataclass(frozen=True)
class LinkSpec:
    """The link between every rank and the switch, per direction.

    ``rate_mbit=None`` leaves the link unshaped. ``latency_us`` is the one-way
    rank-to-rank latency; half of it is added on each of the two hops.
    """

    rate_mbit: float | None
    latency_us: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive or None, got {self.rate_mbit}")
        if self.latency_us < 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us}")


@dataclass(frozen=True)
class ClusterNames:
    """Namespace names of one cluster; the owner pid in them lets stale ones be found."""

    prefix: str
    owner_pid: int
    serial: int

    @property
    def hub(self) -> str:
        return f"{self.prefix}-{self.owner_pid}-{self.serial}-hub"

    def rank_namespace(self, rank: int) -> str:
        return f"{self.prefix}-{self.owner_pid}-{self.serial}-r{rank}"

    def all_namespaces(self, world_size: int) -> list[str]:
        return [self.hub, *(self.rank_namespace(rank) for rank in range(world_size))]


def owner_pid_of(namespace: str, prefix: str) -> int | None:
    """The pid that created ``namespace``, or None when the name is not this prefix's."""
    match = re.fullmatch(rf"{re.escape(prefix)}-(\d+)-\d+-(?:hub|r\d+)", namespace)
    return int(match.group(1)) if match else None


def rank_address(subnet: ipaddress.IPv4Network, rank: int) -> ipaddress.IPv4Interface:
    """Rank ``rank``'s address on ``eth0``: host number rank + 1 of the subnet."""
    hosts = subnet.num_addresses - 2
    if not 0 <= rank < hosts:
        raise ValueError(f"{subnet} has room for {hosts} ranks, not rank {rank}")
    return ipaddress.IPv4Interface(f"{subnet[rank + 1]}/{subnet.prefixlen}")


def kernel_hz() -> int:
    """CONFIG_HZ of the running kernel, or FALLBACK_KERNEL_HZ when no config is readable."""
    candidates = [Path("/proc/config.gz"), Path(f"/boot/config-{os.uname().release}")]
    for path in candidates:
        try:
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt") as config:
                for line in config:
                    if line.startswith("CONFIG_HZ="):
                        return int(line.split("=", 1)[1])
        except OSError:
            continue
    return FALLBACK_KERNEL_HZ


def tbf_burst_bytes(rate_mbit: float, hz: int) -> int:
    """Token bucket size: at least one timer tick's worth of bytes (rate / HZ), as tc-tbf(8)
    requires for the rate to be reachable, and at least one GSO packet."""
    return max(math.ceil(rate_mbit * 1e6 / 8 / hz), LARGEST_GSO_PACKET_BYTES)


def tbf_limit_bytes(rate_mbit: float, burst_bytes: int) -> int:
    """Queue limit: the burst plus QUEUE_DELAY_S of traffic at the link rate."""
    return burst_bytes + math.ceil(rate_mbit * 1e6 / 8 * QUEUE_DELAY_S)


def link_qdisc_commands(namespace: str, device: str, link: LinkSpec, hz: int) -> list[list[str]]:
    """tc commands shaping the egress of one link end: netem (half the latency) above tbf."""
    tc = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
    commands: list[list[str]] = []
    tbf_parent = ["root"]
    if link.latency_us > 0:
        delay = f"{link.latency_us / 2:g}us"
        commands.append([*tc, "root", "handle", "1:", "netem", "delay", delay, "limit", str(NETEM_QUEUE_PACKETS)])
        tbf_parent = ["parent", "1:1"]
    if link.rate_mbit is not None:
        burst = tbf_burst_bytes(link.rate_mbit, hz)
        commands.append([
            *tc, *tbf_parent, "handle", "10:", "tbf",
            "rate", f"{link.rate_mbit:g}mbit",
            "burst", str(burst),
            "limit", str(tbf_limit_bytes(link.rate_mbit, burst)),
        ])
    return commands


def setup_commands(
    names: ClusterNames, world_size: int, link: LinkSpec, subnet: ipaddress.IPv4Network, hz: int
) -> list[list[str]]:
    """Every ip/tc command that builds the cluster, in order.

    veths are created directly inside the namespaces, so nothing ever appears in the
    caller's namespace. Link-local IPv6 is not generated (``addrgenmode none``) so
    ``eth0`` carries a single address for gloo to pick.
    """
    hub_ip = ["ip", "-n", names.hub]
    commands = [
        ["ip", "netns", "add", names.hub],
        [*hub_ip, "link", "add", BRIDGE_INTERFACE, "type", "bridge"],
        [*hub_ip, "link", "set", BRIDGE_INTERFACE, "addrgenmode", "none", "up"],
    ]
    for rank in range(world_size):
        namespace = names.rank_namespace(rank)
        hub_end = f"r{rank}"
        rank_ip = ["ip", "-n", namespace]
        commands += [
            ["ip", "netns", "add", namespace],
            [*hub_ip, "link", "add", hub_end, "type", "veth", "peer", "name", RANK_INTERFACE, "netns", namespace],
            [*hub_ip, "link", "set", hub_end, "master", BRIDGE_INTERFACE, "addrgenmode", "none", "up"],
            [*rank_ip, "link", "set", RANK_INTERFACE, "addrgenmode", "none"],
            [*rank_ip, "addr", "add", str(rank_address(subnet, rank)), "dev", RANK_INTERFACE],
            [*rank_ip, "link", "set", RANK_INTERFACE, "up"],
            [*rank_ip, "link", "set", "lo", "up"],
            *link_qdisc_commands(namespace, RANK_INTERFACE, link, hz),
            *link_qdisc_commands(names.hub, hub_end, link, hz),
        ]
    return commands


_MISSING_QDISC_FIXES = {
    "netem": (
        "the kernel has no sch_netem (CONFIG_NET_SCH_NETEM), so link latency cannot be emulated: "
        "run `modprobe sch_netem`, use a kernel built with it, or ask for latency_us=0 "
        "(rate shaping uses tbf and does not need netem)"
    ),
    "tbf": (
        "the kernel has no sch_tbf (CONFIG_NET_SCH_TBF), needed to shape the link rate: "
        "run `modprobe sch_tbf`, use a kernel built with it, or ask for rate_mbit=None"
    ),
}


def command_failure(command: Sequence[str], stderr: str) -> Exception:
    """The exception for a failed ip/tc command, naming the fix when the cause is known."""
    shown = shlex.join(command)
    kind = next((kind for kind in _MISSING_QDISC_FIXES if kind in command), None)
    if kind is not None and "Specified qdisc kind is unknown" in stderr:
        return QdiscUnavailable(f"{_MISSING_QDISC_FIXES[kind]} (`{shown}`: {stderr.strip()})")
    if "Operation not permitted" in stderr:
        return EmulationUnavailable(
            f"`{shown}` was refused ({stderr.strip()}): network namespaces need CAP_SYS_ADMIN and "
            "CAP_NET_ADMIN; in a container, run it with --cap-add SYS_ADMIN --cap-add NET_ADMIN"
        )
    return NetworkSetupError(f"`{shown}` failed: {stderr.strip()}")


def check_prerequisites() -> None:
    """Refuse early, with the fix, where namespaces and qdiscs cannot be created."""
    if os.geteuid() != 0:
        raise EmulationUnavailable(
            "the emulated cluster needs root to create network namespaces and qdiscs; "
            "rerun as root, e.g. `sudo .venv/bin/python -m benchmarks.collectives`"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulationUnavailable(
            f"the emulated cluster needs {' and '.join(missing)} from iproute2; "
            "install it (e.g. `apt-get install iproute2`)"
        )


def emulation_available() -> bool:
    """Whether this host can emulate a cluster; when not, say why (with the fix) on stderr.

    Benchmarks exit with status 2 when it returns False.
    """
    try:
        check_prerequisites()
    except EmulationUnavailable as error:
        print(f"cannot emulate the cluster network: {error}", file=sys.stderr)
        return False
    return True


def _run_network_command(command: Sequence[str]) -> str:
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=NETWORK_COMMAND_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as error:
        raise NetworkSetupError(f"`{shlex.join(command)}` did not finish in {NETWORK_COMMAND_TIMEOUT_S:g} s") from error
    if completed.returncode != 0:
        raise command_failure(command, completed.stderr)
    return completed.stdout


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _run_network_command(["ip", "netns", "list"]).splitlines() if line.strip()]


def _delete_namespace(namespace: str) -> None:
    """Kill whatever still runs inside (it would keep the namespace alive), then delete it."""
    for pid in _run_network_command(["ip", "netns", "pids", namespace]).split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    _run_network_command(["ip", "netns", "delete", namespace])


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces named with ``prefix`` whose owner process is dead; return their names.

    The veths and qdiscs of a cluster live only inside its namespaces, so they go too.
    A namespace that another process deletes meanwhile counts as removed.
    """
    stale = [ns for ns in list_namespaces() if (pid := owner_pid_of(ns, prefix)) is not None and not pid_alive(pid)]
    for namespace in stale:
        try:
            _delete_namespace(namespace)
        except NetworkSetupError:
            if namespace in list_namespaces():
                raise
    return stale


@dataclass(eq=False)
class RankProcess:
    """A launched rank; its output goes to temporary files so full pipes cannot block it."""

    rank: int
    popen: subprocess.Popen[bytes]
    stdout: IO[bytes]
    stderr: IO[bytes]

    def read(self, stream: IO[bytes]) -> str:
        stream.seek(0)
        return stream.read().decode(errors="replace")

    def stderr_tail(self) -> str:
        return self.read(self.stderr)[-STDERR_TAIL_CHARS:]

    def kill(self) -> None:
        """SIGKILL the rank's whole process group and reap the rank."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        try:
            self.popen.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            warnings.warn(f"rank {self.rank} (pid {self.popen.pid}) survived SIGKILL for {KILL_WAIT_S:g} s")

    def close(self) -> None:
        self.stdout.close()
        self.stderr.close()


@dataclass(frozen=True)
class RankResult:
    """Output of a rank that exited with code 0."""

    rank: int
    stdout: str
    stderr: str


def _raise_on_signal(signum: int, frame: FrameType | None) -> None:
    """Turn SIGINT/SIGTERM into exceptions so ``__exit__`` runs and cleans up."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


class _RankLauncher:
    """Launching, waiting and reaping ranks; subclasses say where each rank runs."""

    master_addr: str
    master_port: int
    socket_interface: str

    def __init__(self, world_size: int, cpu_quota: CpuQuota | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if cpu_quota is not None and cpu_quota.ranks != world_size:
            raise ValueError(f"cpu_quota is for {cpu_quota.ranks} ranks, the cluster has {world_size}")
        self.world_size = world_size
        self.cpu_quota = cpu_quota  # each rank's fixed CPU share, set up and removed with the cluster
        self._live: list[RankProcess] = []
        self._previous_handlers: dict[int, Any] = {}

    def rank_command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` as ``rank``."""
        return list(argv)

    def rank_env(self, rank: int, extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The caller's environment plus torch.distributed's rendezvous variables for ``rank``."""
        return {
            **os.environ,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "GLOO_SOCKET_IFNAME": self.socket_interface,
            **(extra_env or {}),
        }

    def launch(
        self, rank: int, argv: Sequence[str], extra_env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> RankProcess:
        """Start ``argv`` as ``rank`` in its own process group, so it can be killed whole."""
        stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        try:
            command = self.rank_command(rank, argv)
            if self.cpu_quota is not None:  # outermost: `ip netns exec` mounts a /sys without the cgroup tree
                command = self.cpu_quota.command_in_group(rank, command)
            popen = subprocess.Popen(
                command,
                env=self.rank_env(rank, extra_env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        except BaseException:
            stdout.close()
            stderr.close()
            raise
        process = RankProcess(rank, popen, stdout, stderr)
        self._live.append(process)
        return process

    def wait_all(self, processes: Sequence[RankProcess], timeout_s: float) -> list[RankResult]:
        """Wait until every rank exits 0; on a failure or at the deadline kill all and raise.

        Every process is reaped before this returns or raises.
        """
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                for process in processes:
                    returncode = process.popen.poll()
                    if returncode not in (None, 0):
                        raise RankFailure(process.rank, returncode, process.stderr_tail())
                pending = [process for process in processes if process.popen.returncode is None]
                if not pending:
                    return [RankResult(p.rank, p.read(p.stdout), p.read(p.stderr)) for p in processes]
                if time.monotonic() >= deadline:
                    raise RankTimeout(timeout_s, {process.rank: process.stderr_tail() for process in pending})
                time.sleep(POLL_INTERVAL_S)
        finally:
            self._reap(processes)

    def run(
        self,
        argv: Sequence[str],
        timeout_s: float,
        extra_env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> list[RankResult]:
        """Run ``argv`` as every rank and wait for all of them (see :meth:`wait_all`)."""
        processes: list[RankProcess] = []
        try:
            for rank in range(self.world_size):
                processes.append(self.launch(rank, argv, extra_env, cwd))
        except BaseException:
            self._reap(processes)
            raise
        return self.wait_all(processes, timeout_s)

    def _reap(self, processes: Sequence[RankProcess]) -> None:
        for process in processes:
            process.kill()
            process.close()
            if process in self._live:
                self._live.remove(process)

    def __enter__(self: _LauncherT) -> _LauncherT:
        self._install_signal_handlers()
        try:
            self._build()
            if self.cpu_quota is not None:
                self.cpu_quota.__enter__()
        except BaseException:
            self._shut_down()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._shut_down()

    def _build(self) -> None:
        """Create what the ranks need; undone by :meth:`_tear_down`."""

    def _tear_down(self) -> None:
        """Undo :meth:`_build`, best effort."""

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[signum] = signal.signal(signum, _raise_on_signal)

    def _shut_down(self) -> None:
        """Kill leftover ranks and tear down, ignoring further Ctrl-C/SIGTERM until done."""
        for signum in self._previous_handlers:
            signal.signal(signum, signal.SIG_IGN)
        try:
            self._reap(list(self._live))
            if self.cpu_quota is not None:
                self.cpu_quota.__exit__(None, None, None)
            self._tear_down()
        finally:
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
            self._previous_handlers.clear()


class LoopbackCluster(_RankLauncher):
    """The same ranks on 127.0.0.1, without namespaces or shaping: the baseline; no root needed."""

    master_addr = "127.0.0.1"
    socket_interface = "lo"

    def __init__(self, world_size: int, cpu_quota: CpuQuota | None = None) -> None:
        super().__init__(world_size, cpu_quota)
        self.master_port = free_rendezvous_port()


class EmulatedCluster(_RankLauncher):
    """``world_size`` ranks, each in its own namespace, on ``link``-shaped veths to a bridge.

    Use as a context manager: entering builds the network, leaving kills the ranks
    and deletes it.
    """

    socket_interface = RANK_INTERFACE
    master_port = EMULATED_MASTER_PORT

    def __init__(
        self,
        world_size: int,
        link: LinkSpec,
        name_prefix: str = DEFAULT_PREFIX,
        subnet: ipaddress.IPv4Network = DEFAULT_SUBNET,
        cpu_quota: CpuQuota | None = None,
    ) -> None:
        super().__init__(world_size, cpu_quota)
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]*", name_prefix):
            raise ValueError(f"name_prefix must be letters, digits, '_', '.', '-': {name_prefix!r}")
        if not subnet.is_private:
            raise ValueError(f"subnet must be private, got {subnet}")
        rank_address(subnet, world_size - 1)
        self.link = link
        self.subnet = subnet
        self.names = ClusterNames(name_prefix, os.getpid(), next(_serials))
        self.master_addr = str(rank_address(subnet, 0).ip)
        self._network_touched = False

    def rank_command(self, rank: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names.rank_namespace(rank), *argv]

    def _build(self) -> None:
        check_prerequisites()
        self._network_touched = True
        cleanup_stale(self.names.prefix)
        for command in setup_commands(self.names, self.world_size, self.link, self.subnet, kernel_hz()):
            _run_network_command(command)

    def _tear_down(self) -> None:
        if not self._network_touched:
            return
        ours = set(self.names.all_namespaces(self.world_size))
        for namespace in list_namespaces():
            if namespace in ours:
                try:
                    _delete_namespace(namespace)
                except (NetworkSetupError, EmulationUnavailable) as error:
                    warnings.warn(f"could not delete namespace {namespace}: {error}")
