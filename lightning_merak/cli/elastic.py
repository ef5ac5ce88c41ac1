"""Restarted ``torchrun`` attempts that find each other, not the ranks of the attempt that failed.

torchrun's agents keep one TCPStore for the whole job (torch 2.13, with the static and the c10d
rendezvous alike), and the workers' default process group exchanges its peers' addresses through
it under the same keys in every attempt. After a restart a rank can read the address a dead rank
of the previous attempt published and fail with gloo's "Connection refused" (reproduced with a
ten-line script: kill rank 0 in attempt 0, delay its restart by 3 s). torch offers no per-attempt
prefix for those keys and Lightning creates the process group itself, so
:func:`isolate_restart_attempts` wraps torch's ``env://`` rendezvous to put the restart count in
front of every key the process group writes or reads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

__all__ = ["isolate_restart_attempts"]

log = logging.getLogger(__name__)

_MARK = "_merak_attempt_prefix"


def isolate_restart_attempts() -> bool:
    """Under torchrun's shared agent store, prefix the process group's keys with the attempt; True if applied.

    Call before the process group is created (``merak-train`` does); a no-op outside torchrun.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return False
    import importlib

    from torch.distributed import PrefixStore

    rendezvous_module = importlib.import_module("torch.distributed.rendezvous")  # the package exports a function
    handlers = getattr(rendezvous_module, "_rendezvous_handlers", None)  # private: checked, not assumed
    if not isinstance(handlers, dict) or "env" not in handlers:
        log.warning("this torch keeps no env:// rendezvous handler table; a restarted attempt may read a failed "
                    "attempt's addresses (gloo: 'Connection refused'), so restarts may need a fresh job")
        return False
    original = handlers["env"]
    if getattr(original, _MARK, False):
        return True

    def handler(url: str, timeout: timedelta = rendezvous_module.default_pg_timeout,
                **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        for store, rank, world_size in original(url, timeout=timeout, **kwargs):
            yield PrefixStore(f"merak_attempt_{attempt}", store), rank, world_size

    setattr(handler, _MARK, True)
    handlers["env"] = handler
    return True
