"""A rendezvous port that nothing else on the host is handed between its choice and its bind.

A port asked of the kernel with ``bind(0)`` (Lightning's and torchrun's way) comes from the ephemeral
range, the same range the kernel hands every outgoing connection and every other ``bind(0)``: between
the choice and the moment rank 0's store binds it (seconds later, after the ranks import torch), another
job's gloo pairs or store clients can take it, and that run fails with "address already in use". A port
below the ephemeral range is only ever taken by an explicit bind, so choosing one at random there, and
checking that it binds now, leaves only the explicit binds of other jobs to collide with: one chance in
the range's size.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["EPHEMERAL_RANGE_FILE", "free_rendezvous_port", "ports_below_ephemeral"]

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000
"""Below this sit registered services (databases, web servers, X11 at 6000+) a host may run."""
_DEFAULT_EPHEMERAL_START = 32768
"""Linux's default start of the ephemeral range, used where the range cannot be read."""
_ATTEMPTS = 64


def ports_below_ephemeral(range_file: Path = EPHEMERAL_RANGE_FILE) -> range:
    """The ports from :data:`LOWEST_PORT` up to the start of the kernel's ephemeral range (empty if the
    range starts lower)."""
    try:
        start = int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = _DEFAULT_EPHEMERAL_START
    return range(LOWEST_PORT, start)


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_rendezvous_port(host: str = "127.0.0.1", candidates: range | None = None,
                         chooser: random.Random | None = None) -> int:
    """A TCP port free on ``host`` now, chosen at random below the ephemeral range (see the module's
    docstring); the kernel's choice (``bind(0)``) where that range is empty or every try is taken."""
    candidates = ports_below_ephemeral() if candidates is None else candidates
    chooser = chooser or random.SystemRandom()
    for _ in range(_ATTEMPTS if len(candidates) else 0):
        port = chooser.choice(candidates)
        if _binds(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
