"""The rendezvous port is chosen below the kernel's ephemeral range and binds when chosen."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from lightning_merak.util.ports import LOWEST_PORT, free_rendezvous_port, ports_below_ephemeral


def test_the_candidates_end_where_the_ephemeral_range_starts(tmp_path: Path) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("40000\t60999\n")
    assert ports_below_ephemeral(range_file) == range(LOWEST_PORT, 40000)
    assert ports_below_ephemeral(tmp_path / "missing") == range(LOWEST_PORT, 32768)


def test_the_chosen_port_is_below_the_ephemeral_range_and_binds() -> None:
    candidates = ports_below_ephemeral()
    for _ in range(20):
        port = free_rendezvous_port()
        if len(candidates):
            assert port in candidates
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_returned() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        # the only candidate is taken: every try fails and the kernel chooses another
        assert free_rendezvous_port(candidates=range(taken, taken + 1), chooser=random.Random(0)) != taken


def test_with_no_candidate_the_kernel_chooses() -> None:
    port = free_rendezvous_port(candidates=range(0))
    assert 0 < port < 65536
