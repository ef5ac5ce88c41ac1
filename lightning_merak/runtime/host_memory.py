"""Host (CPU) memory returned to the operating system as soon as tensors are freed.

glibc's allocator keeps freed blocks of its heap for reuse, and raises the size above which
an allocation gets its own mapping each time such a mapping is freed. A training step frees
activations between long-lived gradients and optimizer state, so the heap keeps holes that the
next step's differently sized tensors cannot always reuse: resident memory climbs above the live
tensors (measured on this project's CPU runs: 1.4–1.5× the ideal share, against 1.1–1.25× with
every allocation over 128 KiB mapped on its own). Mapping each such allocation costs page faults
on every allocation, so a step takes longer; this is a choice for runs near their memory limit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

__all__ = ["release_freed_host_memory"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def release_freed_host_memory(threshold_bytes: int = 128 * 1024) -> bool:
    """Give every allocation of at least ``threshold_bytes`` its own mapping (returned at free) and trim
    the heap above that much free space; a fixed threshold also stops glibc from raising it.

    Returns whether the allocator took the setting: ``False`` off Linux/glibc (a warning says so).
    """
    if threshold_bytes <= 0:
        raise ValueError(f"threshold_bytes={threshold_bytes} must be positive")
    libc_name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    try:
        libc = ctypes.CDLL(libc_name) if libc_name else None
        version = libc.gnu_get_libc_version if libc is not None else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        version = mallopt = None
    if version is None or mallopt is None:
        log.warning("compact host memory needs glibc's mallopt; this platform's allocator keeps its own policy")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold_bytes))
