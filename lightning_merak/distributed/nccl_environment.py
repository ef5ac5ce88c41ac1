"""What torch's NCCL watchdog and flight recorder do for a merak run, set before the first NCCL group exists.

On NCCL, torch runs its own watchdog thread per process group: a collective past the group's timeout (or an
NCCL error) is caught there, the flight recorder's ring of recent collectives is written to a file per rank,
and the process is torn down, where on gloo a hung rank waits forever (our
:class:`~lightning_merak.distributed.watchdog.Watchdog` ends it). The variables, as torch 2.13 reads them
(an older alias in parentheses counts as set too):

========================================  ===========  ==========================================================
variable                                  merak sets   why
========================================  ===========  ==========================================================
``TORCH_NCCL_ASYNC_ERROR_HANDLING``       ``3``        tear the process down on a timeout or NCCL error without
(``NCCL_ASYNC_ERROR_HANDLING``)                        ``ncclCommAbort`` (which can hang); torchrun restarts it
``TORCH_NCCL_TRACE_BUFFER_SIZE``          ``2000``     entries of the flight recorder, which the watchdog reads
(``TORCH_FR_BUFFER_SIZE``)                             (torch's C++ default; its torchcomms path defaults to 0)
``TORCH_NCCL_DUMP_ON_TIMEOUT``            ``1``        write the flight recorder when a collective times out
``TORCH_NCCL_ENABLE_MONITORING``          ``1``        the monitor thread the dump on timeout needs
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``       see below    where the dump goes: this prefix plus the global rank
(``TORCH_FR_DUMP_TEMP_FILE``)
``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``      (not set)    torch's 480 s: how long the monitor lets torch's own
                                                       watchdog thread hang in a CUDA/NCCL call before ending it
========================================  ===========  ==========================================================

The dump prefix is ``<temporary directory>/lightning_merak_nccl_trace_rank_``. A variable the user has set
(under either name) is left as it is.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, MutableMapping
from typing import Optional

__all__ = ["NCCL_DEFAULTS", "apply_nccl_defaults", "flight_recorder_dump_prefix", "missing_nccl_defaults"]

_DUMP_FILE = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")

NCCL_DEFAULTS: dict[tuple[str, ...], str] = {
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"): "3",
    ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"): "2000",
    ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
    ("TORCH_NCCL_ENABLE_MONITORING",): "1",
}
"""Each setting under its torch 2.13 names (the first is the one merak writes) and merak's value."""


def _default_dump_prefix() -> str:
    return os.path.join(tempfile.gettempdir(), "lightning_merak_nccl_trace_rank_")


def missing_nccl_defaults(environ: Mapping[str, str], dump_prefix: Optional[str] = None) -> dict[str, str]:
    """The variables merak would set in ``environ``: each of :data:`NCCL_DEFAULTS` and the dump prefix
    (``dump_prefix``, default in the temporary directory) that is not set under any of its names."""
    wanted = {**NCCL_DEFAULTS, _DUMP_FILE: dump_prefix or _default_dump_prefix()}
    return {names[0]: value for names, value in wanted.items() if not any(name in environ for name in names)}


def apply_nccl_defaults(environ: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """Set :func:`missing_nccl_defaults` in ``environ`` (the process's by default; before any NCCL group is
    created, which reads them); returns what it set."""
    environ = os.environ if environ is None else environ
    added = missing_nccl_defaults(environ)
    environ.update(added)
    return added


def flight_recorder_dump_prefix(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where torch writes a rank's flight recorder on an NCCL timeout: this prefix plus the global rank."""
    environ = os.environ if environ is None else environ
    for name in _DUMP_FILE:
        if name in environ:
            return environ[name]
    return "/tmp/nccl_trace_rank_"  # torch's own default
