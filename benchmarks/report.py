"""Shared benchmark output: a short aligned console table and a JSON file with machine context.

Numbers mean little without the machine they came from and how they were obtained,
so every JSON file carries both: ``machine`` (no hostname) and ``label``, which says
whether the figures are measured on real hardware, emulated or simulated.

Result files follow one naming rule (:func:`default_out`): ``results/NAME.json`` is a full
run, ``results/NAME.quick.json`` a ``--quick`` one. Importing this module does not import torch.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

if TYPE_CHECKING:
    import torch

Label = Literal["measured", "emulated", "simulated"]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = RESULTS_DIR.parents[1]
CODE_PATHS = ("benchmarks", "lightning_merak", ":(exclude)benchmarks/results")
"""What a figure's code is: uncommitted changes here make a run's revision ``dirty`` (results files do not)."""


def default_out(name: str, quick: bool) -> Path:
    """Where benchmark ``name`` writes unless ``--out`` says otherwise: ``NAME.json``, or ``NAME.quick.json``."""
    return RESULTS_DIR / (f"{name}.quick.json" if quick else f"{name}.json")


def out_help(name: str) -> str:
    """The ``--out`` help text that states the naming rule for benchmark ``name``."""
    return f"JSON output (default benchmarks/results/{name}.json, or {name}.quick.json with --quick)"


def machine_info() -> dict[str, object]:
    """What the figures depend on, and nothing that identifies the host."""
    import torch

    from lightning_merak.util.cpu_features import cpu_multiplies_bfloat16

    return {
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bfloat16": cpu_multiplies_bfloat16(),
    }


def code_revision() -> dict[str, object] | None:
    """The commit the figures were measured at, and whether :data:`CODE_PATHS` differed from it (``dirty``), so
    that runs of different code are told apart; None outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--", *CODE_PATHS)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(changed)}


def revision_text(revision: Mapping[str, object] | None) -> str:
    """A run's revision for a reader: the short commit, ``dirty`` where the code had uncommitted changes."""
    if revision is None:
        return "revision not recorded"
    return f"{str(revision['commit'])[:10]}" + (" dirty" if revision["dirty"] else "")


def _cell(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def print_table(rows: Sequence[Mapping[str, object]], columns: Sequence[str] | None = None) -> None:
    """Print ``rows`` under a header, one column per key (``columns`` or the first row's keys)."""
    if not rows:
        return
    keys = list(columns or rows[0].keys())
    cells = [keys] + [[_cell(row.get(key)) for key in keys] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(keys))]
    for line in cells:
        print("  ".join(text.rjust(width) for text, width in zip(line, widths)))


def write_json(path: Path, rows: Sequence[Mapping[str, object]], label: Label, **context: object) -> Path:
    """Write ``rows`` plus ``label``, machine info, the code's revision (:func:`code_revision`) and ``context`` to
    ``path``, creating parent dirs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"label": label, "machine": machine_info(), "revision": code_revision(), **context, "rows": list(rows)}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def cuda_device_name() -> str:
    """The GPU a ``--device cuda`` leg runs on; exits naming the CPU run where there is none."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (run without --device for the CPU run)")
    return torch.cuda.get_device_name()


def error_line(error: Exception) -> str:
    """The exception line of a rank's traceback (or the run's own message): what a failed row records."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def rank_failure_line(error: Exception) -> str:
    """The line of a failed cluster's error (a rank's stderr tail) that names the exception: its traceback's last
    line containing ``Error``, else its first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in reversed(lines) if "Error" in line), lines[0] if lines else type(error).__name__)


def proc_status_mb(key: str) -> float:
    """A ``/proc/self/status`` memory figure of this process (VmRSS, VmHWM, VmSize, VmPeak) in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            name, value = line.split(":", 1)
            if name == key:
                return int(value.split()[0]) / 1024
    raise KeyError(key)


def saved_activation_bytes(run: Callable[[], Any], parameters: Iterable[torch.Tensor]) -> int:
    """Bytes autograd saves for backward in ``run``'s forward (never differentiated), every storage once and
    ``parameters``' storages left out: the activation memory that forward holds. A saved DTensor (which has no
    storage of its own) counts by its local shard, the bytes this rank holds."""
    import torch
    from torch.distributed.tensor import DTensor

    def storage_of(tensor: torch.Tensor) -> Any:
        return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()

    excluded = {storage_of(param).data_ptr() for param in parameters}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = storage_of(tensor)
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(saved.values())
