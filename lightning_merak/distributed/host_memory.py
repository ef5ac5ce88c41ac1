"""Host (CPU) memory: freed tensor storage kept reusable, or returned to the system at once, and how much is not.

glibc's allocator keeps freed blocks of its heap for reuse, and raises the size above which
an allocation gets its own mapping each time such a mapping is freed (by the time a rank builds its
model every tensor lands in the heap). With glibc's defaults resident memory climbs well above the
live tensors: on the scale benchmark's pp2×tp2 worst rank live tensors are exactly parameters +
gradients + AdamW's moments (nothing is kept across steps), yet ~160 MiB of the ~570 MiB above the
baseline is freed heap (1.44–1.51× the ideal share); thread arenas hold under 8 MiB. The step's own
tensors do not cause that: replaying one step's recorded allocations (torch's profiler, that rank)
through an ideal coalescing best-fit heap needs 76 MiB for their peak of 64 MiB. What keeps the holes
apart is consistent with glibc's per-thread cache and fast bins: a small freed chunk (tensor
metadata, Python objects) parked there still counts as in use, so the freed storage around it cannot
merge into a hole the next large request fits. Starting a process with both off (:data:`HEAP_TUNABLES`
through ``GLIBC_TUNABLES``) brings that rank to 1.27–1.28× (tp2 1.37–1.41 → 1.19–1.21) at the same CPU
time per step, within this shared machine's noise (tp2 1.37–1.44 s → 1.38–1.49 s, pp2×tp2 1.02–1.07 s →
0.89–1.09 s), and flat from the second step; either alone does little (fast bins 1.45, cache 1.37).

glibc reads tunables only when a process starts: merak3d's launcher exports them to the ranks it starts
(:func:`export_heap_tunables`), each rank turns the fast bins off at setup and, when it started with the cache on
(:func:`heap_tunables_applied` probes it), warns with the variable to start it with (:func:`prepare_heap`).
``merak-train`` restarts itself with them before anything else (:func:`restart_with_heap_tunables`), so its rank 0
has them too, and so do its ranks under torchrun or SLURM; the first rank of a script the user starts, and ranks
another launcher starts from such a script, need them in their environment. A strategy does not restart such a
rank itself: by the time it runs, the script has done work (files, downloads, trackers, CUDA) a restart would
repeat, and ``sys.orig_argv`` need not re-run it (``python -c``, notebooks, stdin). Measured without them
(``python -m benchmarks.scale``, ``peak_over_ideal_without_launcher_env``; ``--quick``, contended machine):
pp2×tp2's worst rank 1.73× → 2.03× at 24 layers, 4.57× → 4.95× at 2 layers.
Alternatives measured and not kept: eager optimizer state, gradients in one flat buffer and those long-lived tensors
in their own mappings (1.39–1.41: what stays in the heap still fragments), fixed mmap thresholds of 1–4 MiB (little).
Mapping every allocation over 128 KiB (:func:`release_freed_host_memory`, ``compact_host_memory``) brings the peak to
the live tensors' (1.18–1.27×) but faults in each activation's pages, so a step takes 1.35–1.55× the CPU time; a
choice for runs near their limit. :func:`heap_stats` tells freed heap from live allocations in a running process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import NamedTuple, Optional

__all__ = ["HEAP_TUNABLES", "HeapStats", "disable_fast_bins", "export_heap_tunables", "heap_stats",
           "heap_tunables_applied", "prepare_heap", "release_freed_host_memory", "restart_with_heap_tunables",
           "skip_final_collection", "with_heap_tunables"]

log = logging.getLogger(__name__)

_M_MXFAST = 1
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

HEAP_TUNABLES: dict[str, str] = {"glibc.malloc.tcache_count": "0", "glibc.malloc.mxfast": "0"}
"""glibc tunables that keep small freed chunks out of the per-thread cache and fast bins, where they would
keep the freed tensor storage around them from merging (the heap then grows instead of reusing it)."""


class HeapStats(NamedTuple):
    """glibc's account of this process's allocations, in bytes (``mallinfo2``, every arena)."""

    in_use: int
    """Allocated and not yet freed from the heap (live tensors below the mmap threshold, Python objects)."""
    free: int
    """Freed but kept in the heap for reuse: resident wherever it was touched, and counted in peak RSS."""
    mapped: int
    """Allocations with their own mapping (those over the mmap threshold), returned to the system at free."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc() -> Optional[ctypes.CDLL]:
    libc_name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    try:
        libc = ctypes.CDLL(libc_name) if libc_name else None
        return libc if libc is not None and hasattr(libc, "gnu_get_libc_version") else None
    except OSError:
        return None


def heap_stats() -> Optional[HeapStats]:
    """How much of the heap is live and how much freed-but-kept, to tell fragmentation from live tensors
    when resident memory exceeds what a process holds; ``None`` off glibc (or before glibc 2.33's ``mallinfo2``)."""
    libc = _glibc()
    mallinfo2 = getattr(libc, "mallinfo2", None) if libc is not None else None
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return HeapStats(in_use=info.uordblks, free=info.fordblks, mapped=info.hblkhd)


def release_freed_host_memory(threshold_bytes: int = 128 * 1024) -> bool:
    """Give every allocation of at least ``threshold_bytes`` its own mapping (returned at free) and trim
    the heap above that much free space; a fixed threshold also stops glibc from raising it.

    Returns whether the allocator took the setting: ``False`` off Linux/glibc (a warning says so).
    """
    if threshold_bytes <= 0:
        raise ValueError(f"threshold_bytes={threshold_bytes} must be positive")
    libc = _glibc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        log.warning("compact host memory needs glibc's mallopt; this platform's allocator keeps its own policy")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold_bytes))


def _parse_tunables(value: str) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in value.split(":") if item)
    return {name: setting for name, setting in (pair if len(pair) == 2 else (pair[0], "") for pair in pairs)}


def with_heap_tunables(environ: Mapping[str, str]) -> str:
    """The ``GLIBC_TUNABLES`` value to start a rank with: ``environ``'s own plus :data:`HEAP_TUNABLES`
    (a tunable the caller already set keeps the caller's value, so setting one is the way to opt out)."""
    tunables = _parse_tunables(environ.get("GLIBC_TUNABLES", ""))
    merged = {**HEAP_TUNABLES, **tunables}
    return ":".join(f"{name}={setting}" for name, setting in merged.items())


def heap_tunables_applied() -> Optional[bool]:
    """Whether this process's heap runs without the per-thread cache (glibc reads ``GLIBC_TUNABLES`` only at
    start, so the environment now may differ from the one it started with); ``None`` off Linux/glibc.

    Probed, not read: seven freed 1000-byte chunks stay counted as in use while the cache holds them.
    """
    libc = _glibc()
    mallinfo2 = getattr(libc, "mallinfo2", None) if libc is not None else None
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(1000) for _ in range(7)]  # takes whatever the cache held of this size first
    in_use = mallinfo2().uordblks
    for chunk in chunks:
        libc.free(chunk)
    return in_use - mallinfo2().uordblks >= 7 * 1000


def disable_fast_bins() -> bool:
    """Turn glibc's fast bins off in this process (the half of :data:`HEAP_TUNABLES` that can change after
    start); ``False`` off glibc."""
    libc = _glibc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MXFAST, 0))


def export_heap_tunables(environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Set ``GLIBC_TUNABLES`` in ``environ`` (default ``os.environ``, which the processes started from now on
    inherit) to :func:`with_heap_tunables`' value; nothing off Linux."""
    if sys.platform.startswith("linux"):
        environ = os.environ if environ is None else environ
        environ["GLIBC_TUNABLES"] = with_heap_tunables(environ)


def restart_with_heap_tunables() -> None:
    """Re-run this command in place (``os.execve``) with :data:`HEAP_TUNABLES` in ``GLIBC_TUNABLES`` when its
    environment lacks them, so a launching process — rank 0 of the ranks it starts — gets the heap the others
    get; call it first thing, before any work. Nothing off Linux, or when every tunable is already set (a value
    the user set counts, which is how to opt out)."""
    if not sys.platform.startswith("linux") or _glibc() is None:
        return
    wanted = with_heap_tunables(os.environ)
    if os.environ.get("GLIBC_TUNABLES") == wanted:
        return
    os.environ["GLIBC_TUNABLES"] = wanted
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, os.environ)


def skip_final_collection() -> None:
    """Freeze every object now, so the collection the interpreter runs as it exits has nothing to walk.

    Call it when a command's work is done. That last collection walks every object the imports made (torch,
    Lightning, transformers) to find little to free: about 1.3 s per process here, and a launching rank waits
    for the ranks it started to exit. Frozen objects are still freed by reference counting; only the
    cycle search at exit is skipped."""
    gc.freeze()


def prepare_heap(compact: bool = False, tensors_on_host: bool = True) -> None:
    """Fast bins off now (and, ``compact``, :func:`release_freed_host_memory`); a warning naming the fix when this
    process started with glibc's per-thread cache on.

    A warning, not an info line, because Python's default level hides info and a rank torchrun or SLURM starts from
    a user's shell has no other sign of it; once per node (local rank 0, or a process no launcher numbered), info on
    the node's other ranks, which share its environment, and info where the model's tensors are not in host memory
    (``tensors_on_host=False``: a GPU run), where the held memory is small.
    """
    if compact:
        release_freed_host_memory()
    disable_fast_bins()
    if heap_tunables_applied() is False:
        first_on_node = os.environ.get("LOCAL_RANK", "0") == "0"
        level = logging.WARNING if first_on_node and tensors_on_host else logging.INFO
        log.log(level, "this process's heap keeps glibc's per-thread cache, which holds freed host memory in holes "
                "(peak resident memory up to ~1.5x the live tensors on CPU); start it (torchrun, srun, python) "
                "with GLIBC_TUNABLES=%s in its environment", with_heap_tunables({}))
