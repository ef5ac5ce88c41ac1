"""A watchdog of collectives and peers: a hang or a dead rank ends every rank with a message naming it.

Why: a collective that one rank skips or issues in another order makes its peers wait for the
process group's timeout (gloo: 30 minutes for ``new_group``'s groups, 10 for some launchers),
silently; a rank that dies makes its direct peers fail with gloo's "Connection closed by peer",
which names neither the rank nor what to do next.

What torch gives on gloo (torch 2.13, measured): ``ProcessGroupGloo.abort()`` does not wake a
rank blocked in a collective; ``dist.monitored_barrier`` names missing ranks, but only at a
barrier every rank reaches; ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks every collective with
extra collectives. The flight recorder, however, keeps per process group the number of
collectives enqueued and completed and the recent collectives' names and sizes, readable from
any thread in about 10 µs (``_dump_fr_trace_json(includeCollectives=False)``). The watchdog
reads those counts once per ``poll_s``; nothing is added to a collective. Point-to-point sends and receives
(between pipeline stages, ring attention's) are not in gloo's recorder at all: while the watchdog runs, this
rank's waits for them are counted (:mod:`~lightning_merak.distributed.point_to_point_waits`) under
:data:`POINT_TO_POINT`, a wait that has not returned being in flight like an incomplete collective.

How: the pure core (:class:`StallClock`, :class:`PulseClock`, :func:`absent_ranks`, the
``describe_*`` functions) decides from numbers; :class:`Watchdog` is the thin integration, a
daemon thread per rank that

- beats a heartbeat in the rendezvous store (its own client, with a short timeout): a rank
  whose beat stops for ``dead_after_s`` (or, on this host and PID namespace, whose process is gone) is lost;
- raises the alarm when a collective of this rank has waited ``timeout_s`` with no collective
  completing: every rank then posts its counts to the store, so the alarming rank names the
  ranks that did not arrive at that collective and where they wait instead;
- ends the process (the main thread sits in C++ and cannot be made to raise) after writing the
  message to stderr, when a hang was found or a lost peer did not already end the main thread.

Cost when on: one store write and one read per ``poll_s`` per rank, and a 10 µs count read.

On NCCL torch has a watchdog of its own (:mod:`~lightning_merak.distributed.nccl_environment` sets it up): it
aborts a collective past the process group's timeout, writes its flight recorder to a file per rank and tears
the process down. This watchdog then defers to it: it reads NCCL's flight recorder, leaves hangs to torch's
watchdog where the group's timeout comes first (:func:`defers_stalls_to_torch`), and before it ends a rank
itself it writes that rank's flight recorder where torch would; its own messages (which ranks, which
collective, what to change) and the lost-peer watch stay as on gloo.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from lightning_merak.distributed.nccl_environment import flight_recorder_dump_prefix
from lightning_merak.distributed.point_to_point_waits import (
    count_point_to_point_waits,
    open_point_to_point_waits,
    point_to_point_waits,
)
from lightning_merak.util.values import is_finite_number

__all__ = [
    "DEFAULT_DEAD_AFTER_S",
    "DEFAULT_TIMEOUT_S",
    "EXIT_CODE",
    "POINT_TO_POINT",
    "GroupProgress",
    "PulseClock",
    "StallClock",
    "StuckCollective",
    "Watchdog",
    "absent_ranks",
    "defers_stalls_to_torch",
    "describe_lost",
    "describe_stall",
    "flight_recorder_reader", "host_identity", "this_host_identity",
    "working_alone",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
"""Well under gloo's 10-30 minutes; above any wait of a healthy run for a slow peer (a checkpoint write)."""
DEFAULT_DEAD_AFTER_S = 15.0
"""A heartbeat silent this long means a lost rank (the thread beats every second, even while the main thread waits)."""
EXIT_CODE = 70
"""The exit status of a rank the watchdog ends (``EX_SOFTWARE``); torchrun restarts on any non-zero status."""

_WORKING_ALONE: list[str] = []
"""What this process works on without its peers, innermost last (:func:`working_alone`); read by the watch thread."""


@contextmanager
def working_alone(what: str) -> Iterator[None]:
    """This rank computes ``what`` on its own, for as long as that takes: no stall alarm is raised meanwhile.

    Why: a rank that computes for minutes after a collective (a layout planner profiling long sequences) is no
    hang, but gloo does not always record the completion of its last collective in the flight recorder (measured
    on torch 2.13: the source of a ``broadcast_object_list`` still counted it in flight seconds later, at random),
    so the stall clock would run out and end every rank. The lost-peer watch goes on; a wait for the peers inside
    the block should have a deadline of its own (:func:`~lightning_merak.distributed.store_gather.
    gather_through_store`). The stall clock starts afresh when the block ends.
    """
    _WORKING_ALONE.append(what)
    try:
        yield
    finally:
        _WORKING_ALONE.pop()


# ---------------------------------------------------------------------------------------------- pure core


@dataclass(frozen=True)
class GroupProgress:
    """One rank's collectives on one process group: how many it has issued, how many completed."""

    enqueued: int
    completed: int

    @property
    def waiting(self) -> bool:
        return self.enqueued > self.completed


Progress = Mapping[str, GroupProgress]
"""A rank's progress per process group, by the group's name (the same name on every rank), and its
point-to-point waits under :data:`POINT_TO_POINT`."""

POINT_TO_POINT = "point-to-point"
"""The progress key of this rank's waits for sends and receives (counts of waits, which differ between ranks)."""


def _check_seconds(name: str, value: object, meaning: str) -> None:
    """Refuse a duration that is not a finite number of seconds above 0: with NaN every comparison is false, so
    a NaN poll interval spins the watch thread and a NaN timeout never fires."""
    if not is_finite_number(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0 ({meaning})")


class StallClock:
    """Says which groups a rank has waited on for ``timeout_s`` while none of its collectives completed."""

    def __init__(self, timeout_s: float) -> None:
        _check_seconds("timeout_s", timeout_s, "how long a collective may wait")
        self.timeout_s = timeout_s
        self._last: dict[str, GroupProgress] | None = None
        self._since = 0.0

    def observe(self, progress: Progress, now: float) -> list[str]:
        """The groups with a collective in flight once nothing has moved for ``timeout_s`` (else none)."""
        if progress != self._last:
            self._last, self._since = dict(progress), now
        waiting = sorted(name for name, group in progress.items() if group.waiting)
        return waiting if waiting and now - self._since >= self.timeout_s else []

    def waited(self, now: float) -> float:
        return now - self._since


class PulseClock:
    """Says which peers' heartbeats have not changed for ``dead_after_s``.

    A peer never seen has ``first_beat_s`` (at least ``dead_after_s``) from ``start`` to publish its first beat:
    ranks reach the point where their watchdog starts at different times (imports and setup on a host with more
    ranks than cores take tens of seconds), and a slow start is not a loss. A peer that dies before it beats
    leaves its collectives unanswered, which the stall alarm names within the collective timeout.
    """

    def __init__(self, dead_after_s: float, start: float, first_beat_s: float = 0.0) -> None:
        _check_seconds("dead_after_s", dead_after_s, "how long a peer's heartbeat may be silent")
        self.dead_after_s = dead_after_s
        self.first_beat_s = max(first_beat_s, dead_after_s)
        self._start = start
        self._beats: dict[int, tuple[object, float]] = {}

    def observe(self, beats: Mapping[int, object], now: float) -> list[int]:
        """Ranks whose beat (``None``: not published) has stood still for ``dead_after_s`` (never published:
        ``first_beat_s``)."""
        silent = []
        for rank, beat in beats.items():
            previous = self._beats.get(rank)
            if beat is not None and (previous is None or previous[0] != beat):
                self._beats[rank] = (beat, now)
            seen = self._beats.get(rank)
            waited = now - (seen[1] if seen is not None else self._start)
            if waited >= (self.dead_after_s if seen is not None else self.first_beat_s):
                silent.append(rank)
        return sorted(silent)


@dataclass(frozen=True)
class StuckCollective:
    """A collective this rank waits in, and who did not come to it."""

    group: str
    members: tuple[int, ...]
    sequence: int
    operation: str
    behind: tuple[int, ...]
    silent: tuple[int, ...]
    elsewhere: Mapping[int, str]


def absent_ranks(group: str, sequence: int, members: Sequence[int], reports: Mapping[int, Progress]) -> tuple[
    list[int], list[int]
]:
    """(ranks of ``group`` that have not issued its collective number ``sequence``, ranks that sent no report)."""
    behind = [
        rank for rank in members
        if rank in reports and reports[rank].get(group, GroupProgress(0, 0)).enqueued < sequence
    ]
    return behind, [rank for rank in members if rank not in reports]


def waiting_in(progress: Progress) -> str:
    """Where a rank waits, from its report: ``collective #n of group g``, a point-to-point op, or none."""
    waiting = [f"#{p.completed + 1} of group {name}" for name, p in sorted(progress.items())
               if p.waiting and name != POINT_TO_POINT]
    places = [f"collective {', '.join(waiting)}"] if waiting else []
    if progress.get(POINT_TO_POINT, GroupProgress(0, 0)).waiting:
        places.append("a point-to-point send or receive")
    return f"waits in {' and '.join(places)}" if places else "waits in no collective"


def describe_stall(rank: int, waited_s: float, stuck: Sequence[StuckCollective], timeout_option: str) -> str:
    """The message every rank prints when ``rank`` found a hang."""
    lines = [f"lightning_merak watchdog: rank {rank} waited {waited_s:.0f} s with no collective completing:"]
    for collective in stuck:
        where = (f"collective #{collective.sequence} of process group {collective.group}"
                 if collective.group != POINT_TO_POINT else POINT_TO_POINT)
        line = f"  {collective.operation} ({where}, ranks {list(collective.members)})"
        absent = [
            f"rank {other} did not arrive ({collective.elsewhere[other]})" if other in collective.elsewhere
            else f"rank {other} did not arrive" for other in collective.behind
        ]
        absent += [f"rank {other} did not report (dead or busy)" for other in collective.silent]
        lines.append(line + ": " + ("; ".join(absent) if absent else "every rank arrived (the group itself is stuck)"))
    lines.append(
        "Every rank stops. Ranks must issue the same collectives in the same order, whatever their batch; "
        f"if a rank legitimately works longer while the others wait, raise {timeout_option}."
    )
    return "\n".join(lines)


def describe_lost(rank: int, lost: Mapping[int, str], checkpoint: str | None) -> str:
    """The message a survivor prints: which ranks (on which hosts) are gone, and where to resume from."""
    names = ", ".join(f"rank {other} ({where})" for other, where in sorted(lost.items()))
    resume = (
        f"resume from the newest complete checkpoint: {checkpoint}" if checkpoint
        else "no checkpoint was written yet: restart from the beginning"
    )
    return (
        f"lightning_merak: rank {rank} stops: lost {names}. Restart the run "
        f"(torchrun --max-restarts restarts it by itself; merak-train resume=auto); {resume}"
    )


def flight_recorder_reader(backend: str, available: Collection[str]) -> str:
    """The dump (a function of ``torch._C._distributed_c10d``) whose counts follow this process's collectives on
    ``backend``: NCCL's own recorder on NCCL where the build has it, the generic one (gloo's) elsewhere."""
    if "nccl" in backend.lower() and "_dump_nccl_trace_json" in available:
        return "_dump_nccl_trace_json"
    return "_dump_fr_trace_json"


def defers_stalls_to_torch(backend: str, timeout_s: float, group_timeout_s: float | None) -> bool:
    """Whether torch's NCCL watchdog ends a hung collective no later than this one would (NCCL, with a process
    group timeout of at most ``timeout_s``): its abort and flight-recorder dump then say what hung, and an alarm
    of ours would only race it."""
    return "nccl" in backend.lower() and group_timeout_s is not None and group_timeout_s <= timeout_s


def flight_recorder_note(rank: int, dump_prefix: str) -> str:
    """The line an NCCL run's messages end with: where this rank's flight recorder is written."""
    return (f"torch's flight recorder of rank {rank} (NCCL): {dump_prefix}{rank} "
            "(read it with torch.distributed.flight_recorder's fr_trace)")


# ---------------------------------------------------------------------------------------------- integration

_PREFIX = "merak_watchdog"


def _dump_json(reader: str, include_collectives: bool) -> dict:
    import torch._C._distributed_c10d as c10d

    return json.loads(getattr(c10d, reader)(includeCollectives=include_collectives))


def read_progress(reader: str = "_dump_fr_trace_json") -> dict[str, GroupProgress]:
    """This process's collectives per process group, from torch's flight recorder (:func:`flight_recorder_reader`),
    and its point-to-point waits (:data:`POINT_TO_POINT`, counted while :func:`count_point_to_point_waits` holds)."""
    status = _dump_json(reader, include_collectives=False).get("pg_status", {})
    progress = {  # numbers start at 1; a group that completed none says -1
        name: GroupProgress(int(group["last_enqueued_collective"]), max(0, int(group["last_completed_collective"])))
        for name, group in status.items()
    }
    progress[POINT_TO_POINT] = GroupProgress(*point_to_point_waits())
    return progress


def _operation(group: str, sequence: int, reader: str) -> str:
    """The name and input sizes of collective ``sequence`` of ``group``, from the flight recorder's entries."""
    entries = _dump_json(reader, include_collectives=True).get("entries", [])
    for entry in reversed(entries):
        if str(entry.get("process_group", ("",))[0]) == group and entry.get("collective_seq_id") == sequence:
            return f"{entry.get('profiling_name', 'collective')} of input sizes {entry.get('input_sizes')}"
    return "a collective"


def _group_members() -> dict[str, list[int]]:
    """Global ranks of every process group this process knows, by group name."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return {name: dist.get_process_group_ranks(group) for group, name in c10d._world.pg_names.items()}


def host_identity(hostname: str, boot_id: str | None, pid_namespace: str | None) -> str:
    """What tells this process's host and PID namespace apart from others': two containers may share a hostname
    (``--hostname``) yet not their PIDs, so a peer's PID is checked here only where all three agree."""
    return f"{hostname}/{boot_id or '-'}/{pid_namespace or '-'}"


def _read_boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return boot.read().strip()
    except OSError:
        return None


def _read_pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def this_host_identity() -> str:
    """:func:`host_identity` of this process (the boot id and PID namespace where ``/proc`` has them)."""
    return host_identity(socket.gethostname(), _read_boot_id(), _read_pid_namespace())


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host and PID namespace has ended (a zombie has ended too)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


class Watchdog:
    """The per-rank thread described in the module docstring. ``start`` after the process group is up."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        dead_after_s: float = DEFAULT_DEAD_AFTER_S,
        poll_s: float = 1.0,
        checkpoint: Callable[[], str | None] = lambda: None,
        timeout_option: str = "the watchdog's timeout_s",
        group_timeout_s: float | None = None,
    ) -> None:
        """``group_timeout_s`` is the process groups' own timeout (torch's NCCL watchdog acts on it)."""
        StallClock(timeout_s)
        PulseClock(dead_after_s, 0.0)
        _check_seconds("poll_s", poll_s, "how often the watchdog reads the collective counts and beats")
        if poll_s >= dead_after_s:  # a peer beats once per poll_s: every silence would outlast dead_after_s
            raise ValueError(f"poll_s={poll_s} must be below dead_after_s={dead_after_s}, or a live peer that beats "
                             "once per poll_s is taken for lost; poll more often or wait longer")
        self.timeout_s, self.dead_after_s, self.poll_s = timeout_s, dead_after_s, poll_s
        self.checkpoint = checkpoint
        self.timeout_option = timeout_option
        self.group_timeout_s = group_timeout_s
        self.on_nccl = False
        self.grace_s = 5.0
        """How long a lost peer may go unhandled by the main thread before this thread ends the process."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._uncount_point_to_point: Callable[[], None] = lambda: None
        self._lost: dict[int, str] = {}
        self.handled = False
        """Set by whoever reported a lost peer in the main thread; the thread then leaves the exit to it."""

    def start(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("Watchdog.start() needs the default process group; call it after init_process_group")
        import torch._C._distributed_c10d as c10d
        from torch.distributed import distributed_c10d as c10d_python

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.backend = str(dist.get_backend())
        self.on_nccl = "nccl" in self.backend.lower()
        self.reader = flight_recorder_reader(self.backend, set(dir(c10d)))
        self.raises_stall_alarms = not defers_stalls_to_torch(self.backend, self.timeout_s, self.group_timeout_s)
        self.host, self.identity = socket.gethostname(), this_host_identity()
        self._store = self._connect()
        self._store.set(f"{_PREFIX}/peer/{self.rank}",
                        json.dumps({"host": self.host, "identity": self.identity, "pid": os.getpid()}))
        if self.raises_stall_alarms:
            self._uncount_point_to_point = count_point_to_point_waits([c10d_python, dist])
        self._thread = threading.Thread(target=self._run, name="merak-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch on a normal exit; peers do not count this rank as lost."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._uncount_point_to_point()
        try:
            self._store.set(f"{_PREFIX}/done/{self.rank}", "1")
        except RuntimeError:
            pass

    def lost_ranks(self, wait_s: float = 0.0) -> dict[int, str]:
        """The peers found lost (rank -> where it ran), waiting up to ``wait_s`` for a verdict."""
        deadline = time.monotonic() + wait_s
        while not self._lost and time.monotonic() < deadline and self._thread is not None:
            time.sleep(0.2)
        return dict(self._lost)

    def describe_lost(self, lost: Mapping[int, str]) -> str:
        return describe_lost(self.rank, lost, self.checkpoint())

    def _connect(self) -> object:
        """A client of its own to the rendezvous store, failing fast when the store is gone; a clone of the default
        group's store where it has one, so that its keys stay under this attempt's prefix (a restart must not read a
        dead attempt's peers: :mod:`lightning_merak.cli.elastic`)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        default = c10d._get_default_store()
        if hasattr(default, "clone"):
            store = default.clone()
            store.set_timeout(timedelta(seconds=5))
            self.store_address = f"{address}:{port}" if address and port else "the default process group's store"
            return store
        if address and port:
            store = dist.TCPStore(address, int(port), is_master=False, timeout=timedelta(seconds=5))
            self.store_address = f"{address}:{port}"
            return store
        self.store_address = "the default process group's store"
        return c10d._get_default_store()

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as error:  # the watch must never take a healthy run down with it
            log.warning("lightning_merak watchdog stopped watching: %s", error)

    def _watch(self) -> None:
        stall = StallClock(self.timeout_s)
        start = time.monotonic()
        pulse = PulseClock(self.dead_after_s, start, first_beat_s=self.timeout_s)
        peers: dict[int, dict[str, object]] = {}
        beat, lost_since, alarmed = 0, None, False
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            beat += 1
            try:
                self._store.set(f"{_PREFIX}/beat/{self.rank}", str(beat))
                beats, done = self._beats(peers)
                self._lost = self._find_lost(pulse.observe(beats, now), peers, done)
                if _WORKING_ALONE:  # the clock starts afresh when the work ends
                    stall = StallClock(self.timeout_s)
                if not self._lost:
                    stuck = (stall.observe(read_progress(self.reader), now)
                             if self.raises_stall_alarms and not _WORKING_ALONE else [])
                    if stuck:
                        self._alarm(stuck, stall.waited(now))
                    elif alarmed or self._store.check([f"{_PREFIX}/alarm"]):
                        alarmed = True
                        self._answer_alarm()
            except RuntimeError:  # the store's errors: its host is gone
                self._lost = {0: f"the rendezvous store at {self.store_address} is unreachable: its host or process "
                                 f"(rank 0's, or torchrun's agent) is gone"}
            if self._lost:
                lost_since = now if lost_since is None else lost_since
                if now - lost_since >= self.grace_s and not self.handled:
                    self._end(self.describe_lost(self._lost))

    def _beats(self, peers: dict[int, dict[str, object]]) -> tuple[dict[int, object], set[int]]:
        """Every peer's heartbeat (None where not yet published) and the peers that ended normally."""
        beats: dict[int, object] = {}
        done = set()
        for other in range(self.world_size):
            if other == self.rank:
                continue
            if other not in peers and self._store.check([f"{_PREFIX}/peer/{other}"]):
                peers[other] = json.loads(self._store.get(f"{_PREFIX}/peer/{other}"))
            key = f"{_PREFIX}/beat/{other}"
            beats[other] = self._store.get(key) if self._store.check([key]) else None
            if self._store.check([f"{_PREFIX}/done/{other}"]):
                done.add(other)
        return beats, done

    def _find_lost(self, silent: list[int], peers: Mapping[int, Mapping[str, object]], done: set[int]) -> dict[
        int, str
    ]:
        lost = {}
        for other, peer in peers.items():
            if other in done:
                continue
            on_this_host = peer.get("identity") == self.identity
            if other in silent or (on_this_host and _process_gone(int(peer["pid"]))):  # type: ignore[call-overload]
                lost[other] = f"host {peer['host']}, pid {peer['pid']}"
        for other in silent:
            if other not in peers and other not in done:
                lost[other] = "never reported to the watchdog"
        return lost

    def _alarm(self, stuck_groups: list[str], waited_s: float) -> None:
        """Post this rank's counts, collect the others' and end every rank with the names of who did not come."""
        store = self._store
        progress = read_progress(self.reader)
        self._post(progress)
        store.add(f"{_PREFIX}/alarm", 1)
        members = _group_members()
        open_ops = open_point_to_point_waits()
        peers = sorted({peer for op in open_ops if (peer := op.global_peer()) is not None} - {self.rank})
        members[POINT_TO_POINT] = sorted({self.rank, *peers})
        wanted = sorted({rank for name in stuck_groups for rank in members.get(name, [])} | {self.rank})
        reports = self._collect(wanted, deadline=time.monotonic() + max(3 * self.poll_s, 5.0))
        stuck = []
        for name in stuck_groups:
            sequence = progress[name].completed + 1
            group_ranks = members.get(name, list(range(self.world_size)))
            if name == POINT_TO_POINT:  # the peers' counts do not match this rank's: name the peers waited for
                behind, silent = [p for p in peers if p in reports], [p for p in peers if p not in reports]
                operation = ", ".join(dict.fromkeys(str(op) for op in open_ops)) or "a send or receive"
            else:
                behind, silent = absent_ranks(name, sequence, group_ranks, reports)
                operation = _operation(name, sequence, self.reader)
            elsewhere = {other: waiting_in(reports[other]) for other in behind}
            stuck.append(StuckCollective(name, tuple(group_ranks), sequence, operation, tuple(behind), tuple(silent),
                                         elsewhere))
        message = describe_stall(self.rank, waited_s, stuck, self.timeout_option)
        if self.on_nccl:
            message += "\n" + flight_recorder_note(self.rank, flight_recorder_dump_prefix())
        # written now: once a peer ends, this rank's own blocked collective may fail and end it first
        os.write(2, (message + "\n").encode())
        store.set(f"{_PREFIX}/message/{self.rank}", message)
        time.sleep(2 * self.poll_s + 1.0)  # the store may live in this process: let the peers read the message
        self._end("")

    def _post(self, progress: Progress) -> None:
        report = {name: [group.enqueued, group.completed] for name, group in progress.items()}
        self._store.set(f"{_PREFIX}/report/{self.rank}", json.dumps(report))

    def _collect(self, ranks: Sequence[int], deadline: float) -> dict[int, dict[str, GroupProgress]]:
        reports: dict[int, dict[str, GroupProgress]] = {}
        while True:
            for other in ranks:
                key = f"{_PREFIX}/report/{other}"
                if other not in reports and self._store.check([key]):
                    raw = json.loads(self._store.get(key))
                    reports[other] = {name: GroupProgress(*counts) for name, counts in raw.items()}
            if len(reports) == len(ranks) or time.monotonic() >= deadline:
                return reports
            time.sleep(0.1)

    def _answer_alarm(self) -> None:
        """Another rank found a hang: report this rank's counts, and stop with its message once it is out."""
        self._post(read_progress(self.reader))
        for other in range(self.world_size):
            key = f"{_PREFIX}/message/{other}"
            if self._store.check([key]):
                self._end(f"lightning_merak: rank {self.rank} stops; rank {other} found a hang.\n"
                          + self._store.get(key).decode())

    def _end(self, message: str) -> None:
        """Write ``message`` (if any) and end this process (the main thread may be blocked inside a collective)."""
        if message:
            os.write(2, (message + "\n").encode())
        if self.on_nccl:
            self._write_flight_recorder()
        os._exit(EXIT_CODE)

    def _write_flight_recorder(self) -> None:
        """This rank's NCCL flight recorder, where torch's watchdog writes it on a timeout (CUDA builds)."""
        import torch._C._distributed_c10d as c10d

        dump = getattr(c10d, "_dump_nccl_trace", None)
        if dump is None:
            return
        try:
            with open(f"{flight_recorder_dump_prefix()}{self.rank}", "wb") as file:
                file.write(dump())
        except (OSError, RuntimeError) as error:
            os.write(2, f"lightning_merak watchdog: flight recorder not written: {error}\n".encode())
