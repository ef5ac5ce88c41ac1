"""Start a run's other local ranks while rank 0 is still importing; they begin work only when rank 0 says so.

Why: Lightning's launcher starts ranks 1.. inside ``Trainer.fit``, after rank 0 has imported torch, Lightning
and transformers and built its model (7 s on two CPU cores); each rank then imports them again (6 s) while
rank 0 waits for it. Started first thing instead, the ranks import on the other cores at the same time as
rank 0 (measured: a 2-rank ``merak-train`` of the default model reached its first step in 8.1 s instead of
13.9 s; ``docs/design/machine.md``). They start as soon as Hydra has composed the configuration and the trainer
group is checked, before the rest is built (building it imports transformers' model registry: 2.5 s): the
same run's two steps then ended 8.2–10.3 s after the command started instead of 13.4 s (three runs each).

Nothing else changes: each started rank imports, then waits at a gate (a pipe from rank 0). Rank 0 opens the
gate where Lightning would have launched them, after every check a run makes before launch; a run refused
or failed before that ends the waiting ranks (:meth:`PrelaunchedRanks.abandon`) and rank 0, and a rank whose
rank 0 ended otherwise finds its gate closed and leaves; neither says a word. So a refused run still starts no
rank's work. The ranks get the environment Lightning's launcher gives them (``MASTER_ADDR``,
``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), which Lightning reads as processes created
outside it, and the same Hydra overrides (rank 0's run directory, no ``.hydra`` of their own). Rank 0
watches them: a rank that fails ends the others, and rank 0 ends with a non-zero status.

Only single-node runs of 2 to as many devices as this process has cores (more ranks than cores would only
slow rank 0's own import) that no launcher started (no ``LOCAL_RANK``, torchrun or SLURM variables) and a
single Hydra run (not ``--multirun``) are started early; others keep Lightning's launcher. Nothing here
imports torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from lightning_merak.util.console import quiet_dependency_noise
from lightning_merak.util.ports import free_rendezvous_port

__all__ = [
    "GATE_VARIABLE", "PrelaunchedRanks", "launched_externally", "prelaunch_local_ranks",
    "share_cores", "wait_at_gate",
]

GATE_VARIABLE = "MERAK_PRELAUNCH_GATE_FD"
"""Set in a rank started early: the file descriptor of the pipe rank 0 opens the gate through."""

_LAUNCHER_VARIABLES = (
    "LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
)
_POLL_S = 0.5
_FINISH_TIMEOUT_S = 120.0
_ABANDON_TIMEOUT_S = 10.0


def launched_externally(environ: dict[str, str] | os._Environ[str]) -> bool:
    """Whether a launcher (torchrun, SLURM, MPI, Lightning's own) already started this process as one rank."""
    return any(name in environ for name in _LAUNCHER_VARIABLES)


@dataclass
class PrelaunchedRanks:
    """Ranks 1..n-1 of this node, started and waiting at their gate until :meth:`start`."""

    processes: list[subprocess.Popen[bytes]]
    gates: list[int]
    _observer: threading.Thread | None = field(default=None, init=False)
    _refused: threading.Event = field(default_factory=threading.Event, init=False)

    def start(self) -> None:
        """Open every rank's gate (they begin the run) and watch them from here on."""
        for gate in self.gates:
            os.write(gate, b"1")
            os.close(gate)
        self.gates = []
        self._observer = threading.Thread(target=self._watch, name="merak-prelaunch-observer", daemon=True)
        self._observer.start()

    def finish(self, timeout_s: float = _FINISH_TIMEOUT_S) -> None:
        """Wait for the ranks to end after rank 0's run; raise if one failed or did not end in time."""
        deadline = time.monotonic() + timeout_s
        for local_rank, process in enumerate(self.processes, start=1):
            try:
                status = process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._end_all()
                raise RuntimeError(f"local rank {local_rank} had not ended {timeout_s:.0f} s after rank 0 finished; "
                                   "it was terminated") from None
            if status != 0:
                raise RuntimeError(f"local rank {local_rank} ended with status {status}")

    def abandon(self) -> None:
        """End the ranks before their gates open (rank 0 refused or failed the run): none has begun its work."""
        for gate in self.gates:
            os.close(gate)
        self.gates = []
        self._end_all()
        for process in self.processes:
            try:
                process.wait(_ABANDON_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def refused(self, timeout_s: float = _ABANDON_TIMEOUT_S) -> None:
        """Rank 0 refused the run after the gates opened (on data every rank reads alike, so each refuses it too):
        the ranks end on their own, those that have not within ``timeout_s`` are ended; rank 0 is left to end."""
        self._refused.set()
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
                process.wait()

    def _watch(self) -> None:
        """A rank that fails leaves the others waiting in a collective: end them all, rank 0 included."""
        while not self._refused.is_set():
            statuses = [process.poll() for process in self.processes]
            failed = [(rank, status) for rank, status in enumerate(statuses, start=1) if status not in (None, 0)]
            if failed and not self._refused.is_set():
                rank, status = failed[0]
                print(f"merak-train: local rank {rank} ended with status {status}; ending the other ranks",
                      file=sys.stderr, flush=True)
                self._end_all()
                os.kill(os.getpid(), signal.SIGTERM)
                return
            if all(status == 0 for status in statuses):
                return
            time.sleep(_POLL_S)

    def _end_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()


def _rank_command(run_dir: str, local_rank: int) -> list[str]:
    """This command again for ``local_rank``, writing into rank 0's run directory (as Lightning's launcher does)."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    command = [sys.executable, "-m", spec.name] if spec is not None else [sys.executable, os.path.abspath(sys.argv[0])]
    escaped = run_dir.replace("\\", "\\\\").replace('"', '\\"')
    return [*command, *sys.argv[1:], f'hydra.run.dir="{escaped}"', f"hydra.job.name=train_ddp_process_{local_rank}",
            "hydra.output_subdir=null"]


def prelaunch_local_ranks(devices: int, num_nodes: int) -> PrelaunchedRanks | None:
    """Start ranks 1..devices-1 of a single-node Hydra run now, waiting at their gates; None where Lightning's
    launcher keeps the job (one device, more devices than cores, several nodes, a launcher already ran, a
    multirun, no Hydra run). A single-node run of several devices gets its ``MASTER_PORT`` here either way, and a
    run of more devices than cores a printed note that it will be slow."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if devices < 2 or launched_externally(os.environ):
        return None
    cores = len(os.sched_getaffinity(0))
    if devices > cores:
        print(_oversubscription_notice(devices, cores), flush=True)
    if num_nodes != 1:
        return None
    # Lightning's launcher would take a port from the ephemeral range, which other jobs' connections can take
    # before rank 0 binds it (util/ports.py); this choice serves it and the ranks started here alike.
    os.environ.setdefault("MASTER_PORT", str(free_rendezvous_port()))
    if devices > cores:
        return None
    if not HydraConfig.initialized():
        return None
    hydra_config = HydraConfig.get()
    if hydra_config.mode != RunMode.RUN:
        return None
    from hydra.utils import get_original_cwd

    os.environ.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                      NODE_RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(devices))
    share_cores(devices)
    processes, gates = [], []
    for local_rank in range(1, devices):
        read_end, write_end = os.pipe()
        environment = {**os.environ, "LOCAL_RANK": str(local_rank), GATE_VARIABLE: str(read_end)}
        processes.append(subprocess.Popen(_rank_command(hydra_config.runtime.output_dir, local_rank),
                                          env=environment, cwd=get_original_cwd(), pass_fds=(read_end,)))
        os.close(read_end)
        gates.append(write_end)
    return PrelaunchedRanks(processes, gates)


def _oversubscription_notice(ranks: int, cores: int) -> str:
    """The note for more ranks on a node than it has cores: legitimate (emulating a larger world on a small
    machine), but each rank's share of a core makes every step slow, which the user should not have to guess."""
    return (f"merak-train: note: trainer.devices={ranks} starts {ranks} ranks on this machine's {cores} cores: "
            f"each rank gets about {cores / ranks:.2g} of a core, so the run will be slow (fine to emulate a "
            f"larger world; trainer.devices<={cores} runs at full speed)")


def share_cores(ranks: int) -> None:
    """Give each of this node's ``ranks`` its share of the cores for torch's threads, as Lightning's launcher
    does in every rank it starts (it does not run for ranks started here): ``OMP_NUM_THREADS`` for the ranks about to
    start, and this process's torch if it is already imported. A value the user set is kept.

    Left at torch's default every rank runs a thread per core: on two cores two ranks ran four threads, and
    the planner's profile for ``merak-train ... plan_only=true`` took 35-105 s instead of 22-25 s.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // ranks)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")  # probed, not imported: rank 0 starts the others before importing torch
    if torch is not None:
        torch.set_num_threads(threads)


def wait_at_gate() -> bool:
    """In a rank started early: import the heavy libraries, then wait for rank 0 to open the gate; leave quietly
    (status 0) when rank 0 ended without opening it. Nothing in any other process.

    Returns whether this process is such a rank past its open gate: its command line is the one rank 0 checked
    and normalised (``cli.overrides``), which it need not check again."""
    gate = os.environ.pop(GATE_VARIABLE, None)
    if gate is None:
        return False
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is rank 0's to handle here
    quiet_dependency_noise()  # before the imports below, which may warn
    # The imports this rank overlaps with rank 0's: the libraries, and what the run imports next (transformers'
    # model base and merak3d: 1 s more that rank 0 would otherwise wait for after opening the gate).
    import lightning.pytorch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import lightning_merak.strategies.merak3d.strategy  # lazy: torch, Lightning; imported at the gate  # noqa: F401

    go = os.read(int(gate), 1)
    os.close(int(gate))
    if go != b"1":
        os._exit(0)
    signal.signal(signal.SIGINT, interrupt)
    return True
