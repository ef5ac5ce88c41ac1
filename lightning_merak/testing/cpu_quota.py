"""One device per rank on a shared CPU: each rank gets a fixed CPU quota that an idle rank cannot lend.

A GPU rank never lends its compute to another rank. Ranks sharing fewer cores do: when one waits, the
scheduler gives its core to a busy one, so a load imbalance (an overloaded expert, a slow stage) costs far
less than on devices, and a replica "on another device" runs on the same cores. A benchmark whose figure
depends on per-rank compute at more ranks than cores must remove that lending (``docs/design/machine.md``).

:class:`CpuQuota` gives every rank its own cgroup (v1 ``cpu`` controller, or cgroup v2's ``cpu.max``) with
``cores / ranks`` of a core per period; a rank's unused quota is lost, as a device's idle time is. Ranks enter
their group before they run any work (every thread they later create inherits the group) and the groups are removed
on exit, on failure and by :func:`cleanup_stale` for owners that died. :meth:`CpuQuota.check` measures that a
lone spinning process runs at its quota, not at a full core. Needs root; :func:`quota_available` says whether
it can work here. Every step then runs about ``ranks / cores`` slower: compare ratios only.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuQuota", "QUOTA_PERIOD_US", "QuotaUnavailable", "cleanup_stale", "device_per_rank_quota",
           "emulation_record", "enter_group", "pid_alive", "quota_available"]

QUOTA_PERIOD_US = 2_000
"""The period each rank's quota is counted over. Short: with the kernel's default 100 ms a rank that was idle runs
a whole core for tens of milliseconds before its quota runs out, as long as a layer call, so an idle rank still
lends its core to the next call (measured: a lone rank ran 2.2–3.3× a sharing one's rate at 100 ms, 1.4–1.7× at
2 ms). The kernel's smallest quota is 1 ms, so the period grows where the share would need less."""
MIN_QUOTA_US = 1_000
DEFAULT_PREFIX = "merak-quota"
_V1_ROOT = Path("/sys/fs/cgroup/cpu")
_V2_ROOT = Path("/sys/fs/cgroup")
_V2_UNIFIED = Path("/sys/fs/cgroup/unified")


class QuotaUnavailable(RuntimeError):
    """CPU quotas cannot be set here (not root, or no cgroup ``cpu`` controller)."""


def _hierarchy() -> tuple[Path, str] | None:
    """Where rank groups are created and which cgroup version it is, or None where there is none."""
    if (_V1_ROOT / "cpu.cfs_quota_us").exists():
        return _V1_ROOT, "v1"
    for root in (_V2_ROOT, _V2_UNIFIED):
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            return root, "v2"
    return None


def quota_available() -> bool:
    """Whether :class:`CpuQuota` can create groups here (root and a writable ``cpu`` controller)."""
    found = _hierarchy()
    return found is not None and os.geteuid() == 0 and os.access(found[0], os.W_OK)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_group(group: Path, parent: Path) -> None:
    """Move what is left in ``group`` back to ``parent`` and remove it (best effort)."""
    for child in sorted(p for p in group.iterdir() if p.is_dir()):
        _remove_group(child, group)
    procs = group / "cgroup.procs"
    if procs.exists():
        for pid in procs.read_text().split():
            try:
                (parent / "cgroup.procs").write_text(pid)
            except OSError:  # the process ended meanwhile
                continue
    try:
        group.rmdir()
    except OSError:
        pass


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove rank groups whose owning process is gone (a benchmark killed outright); returns their names."""
    found = _hierarchy()
    if found is None or not os.access(found[0], os.W_OK):
        return []
    removed = []
    for group in found[0].glob(f"{prefix}-*"):
        owner = group.name.removeprefix(f"{prefix}-").split("-")[0]
        if owner.isdigit() and not pid_alive(int(owner)):
            _remove_group(group, found[0])
            removed.append(group.name)
    return removed


@dataclass(frozen=True)
class QuotaCheck:
    """CPU time over wall time of a process in a rank group: over a long spin, and within short bursts of work after
    an idle gap (what a rank does between waits). Both read the quota's share when the quota holds."""

    long_share: float
    burst_share: float
    quota_share: float

    @property
    def holds(self) -> bool:
        """Neither reading above the share (+10%): below it means a busy machine, above it lending."""
        return max(self.long_share, self.burst_share) <= 1.1 * self.quota_share + 0.02


def _spin_for(cpu_seconds: float) -> None:
    start = time.process_time()
    while time.process_time() - start < cpu_seconds:
        pass


def _measure_shares(report: int, seconds: float, bursts: int, burst_cpu_s: float, gap_s: float) -> None:
    """In the child: a long spin's share, then the mean share of ``bursts`` short bursts after idle gaps."""
    wall, cpu = time.monotonic(), time.process_time()
    _spin_for_wall(seconds)
    long_share = (time.process_time() - cpu) / (time.monotonic() - wall)
    shares = []
    for _ in range(bursts):
        time.sleep(gap_s)
        wall = time.monotonic()
        _spin_for(burst_cpu_s)
        shares.append(burst_cpu_s / (time.monotonic() - wall))
    os.write(report, f"{long_share} {sum(shares) / len(shares)}".encode())


def _spin_for_wall(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


class CpuQuota:
    """Per-rank CPU quotas of ``cores / ranks`` of a core each; a context manager that removes its groups.

    ``cores`` defaults to the cores this process may use. ``join(rank, pid)`` moves a started rank in.
    """

    def __init__(self, ranks: int, cores: float | None = None, prefix: str = DEFAULT_PREFIX) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.ranks = ranks
        self.cores = float(cores if cores is not None else len(os.sched_getaffinity(0)))
        if self.cores <= 0:
            raise ValueError(f"cores must be > 0, got {cores}")
        self.share = self.cores / ranks
        self.prefix = prefix
        self._root: Path | None = None
        self._version = ""
        self._group: Path | None = None

    @property
    def period_us(self) -> int:
        return max(QUOTA_PERIOD_US, math.ceil(MIN_QUOTA_US / self.share))

    @property
    def quota_us(self) -> int:
        return round(self.period_us * self.share)

    def describe(self) -> dict[str, object]:
        """What a benchmark records in its JSON about the emulation."""
        return {"emulation": "one device per rank: a fixed CPU quota per rank (cgroup cpu controller)",
                "ranks": self.ranks, "cores": self.cores, "core_share_per_rank": round(self.share, 4),
                "period_us": self.period_us, "quota_us": self.quota_us}

    def __enter__(self) -> CpuQuota:
        found = _hierarchy()
        if found is None or not quota_available():
            raise QuotaUnavailable("CPU quotas need root and a cgroup cpu controller (/sys/fs/cgroup/cpu or "
                                   "cgroup v2 with cpu enabled); run the benchmark as root, or report its "
                                   "per-rank figures as not emulating one device per rank")
        self._root, self._version = found
        cleanup_stale(self.prefix)
        self._group = self._root / f"{self.prefix}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            self._group.mkdir()
            for rank in range(self.ranks):
                self._make_rank_group(self._group / f"rank{rank}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make_rank_group(self, group: Path) -> None:
        group.mkdir()
        if self._version == "v1":
            (group / "cpu.cfs_period_us").write_text(str(self.period_us))
            (group / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        else:
            (group / "cpu.max").write_text(f"{self.quota_us} {self.period_us}")
        burst = group / ("cpu.cfs_burst_us" if self._version == "v1" else "cpu.max.burst")
        if burst.exists():  # no quota saved up while idle: that would be lending by another name
            burst.write_text("0")

    def __exit__(self, *exc_info: object) -> None:
        if self._group is not None and self._group.exists() and self._root is not None:
            _remove_group(self._group, self._root)
        self._group = None

    def group_of(self, rank: int) -> Path:
        if self._group is None:
            raise RuntimeError("CpuQuota is not entered: use it as a context manager")
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} outside 0..{self.ranks - 1}")
        return self._group / f"rank{rank}"

    def procs_file(self, rank: int) -> Path:
        """The file a process writes its pid to in order to enter ``rank``'s group."""
        return self.group_of(rank) / "cgroup.procs"

    def command_in_group(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped so that its process enters ``rank``'s group before it execs: no instruction of the
        rank runs outside its quota (moving it in after it started races with what it does first)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.procs_file(rank)), *argv]

    def check(self, seconds: float = 0.5, bursts: int = 5, burst_cpu_s: float = 0.01,
              gap_s: float = 0.05) -> QuotaCheck:
        """Run a child alone in rank 0's group: its share of a core over a long spin and within short bursts of
        work after idle gaps (``burst_cpu_s`` of CPU each, as long as a layer call)."""
        procs_file = str(self.procs_file(0))
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child enters the group, measures, reports and leaves
            os.close(read)
            try:
                enter_group(procs_file)
                _measure_shares(write, seconds, bursts, burst_cpu_s, gap_s)
            finally:
                os._exit(0)
        os.close(write)
        try:
            with os.fdopen(read) as result:
                long_share, burst_share = (float(value) for value in result.read().split())
        finally:
            os.waitpid(pid, 0)
        return QuotaCheck(long_share, burst_share, min(self.share, 1.0))


def enter_group(procs_file: str) -> None:
    """Move the calling process into the group whose ``cgroup.procs`` is ``procs_file`` (a rank started by a
    forkserver does this first, before any work)."""
    Path(procs_file).write_text(str(os.getpid()))


def device_per_rank_quota(world_size: int) -> CpuQuota | None:
    """The quota a timing benchmark gives its ``world_size`` ranks, or None where none is needed or possible.

    Ranks up to the usable core count with one compute thread each cannot lend a core they do not use, so no
    quota is needed; more ranks than cores need one. None where quotas are unavailable: record
    :func:`emulation_record` so the figure says its ranks could lend cores.
    """
    if world_size <= len(os.sched_getaffinity(0)) or not quota_available():
        return None
    return CpuQuota(world_size)


def emulation_record(quota: CpuQuota | None, world_size: int) -> dict[str, object]:
    """What a benchmark's JSON says about how its ranks shared the CPU."""
    if quota is not None:
        return quota.describe()
    cores = len(os.sched_getaffinity(0))
    if world_size <= cores:
        return {"emulation": "one core or more per rank (one compute thread each): no quota needed",
                "ranks": world_size, "cores": cores}
    return {"emulation": "NONE: more ranks than cores and no CPU quota available, so an idle rank's core ran busy "
                         "ones; per-rank compute figures are optimistic", "ranks": world_size, "cores": cores}
