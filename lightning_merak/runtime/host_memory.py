"""Host (CPU) memory returned to the operating system as soon as tensors are freed, and how much is not.

glibc's allocator keeps freed blocks of its heap for reuse, and raises the size above which
an allocation gets its own mapping each time such a mapping is freed (by the time a rank builds its
model every tensor lands in the heap). A training step frees activations and gradient temporaries
between long-lived parameters, gradients and optimizer state of the same sizes, so the heap keeps
holes that later tensors cannot always reuse: resident memory climbs above the live tensors. Measured
on the scale benchmark's pp2×tp2 worst rank: live tensors are exactly parameters + gradients + AdamW's
moments (nothing is kept across steps), yet 169 MiB of the 564 MiB above the baseline is freed heap;
the thread arenas hold under 8 MiB, and mapping only allocations over 1 or 4 MiB recovers almost
nothing, as the holes are among the 0.5–1.5 MiB tensors. Mapping every allocation over 128 KiB brings
the peak to the live tensors' (1.44× → 1.18× the ideal share there) but costs page faults on each
activation, so a step takes longer (1.35–1.55× CPU time); this is a choice for runs near their memory
limit. :func:`heap_stats` tells the two apart in a running process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import NamedTuple, Optional

__all__ = ["HeapStats", "heap_stats", "release_freed_host_memory"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


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
