"""One checked rendezvous before the process group: every rank of this attempt, with the same settings, or a message.

Why: torch's ``env://`` rendezvous (Lightning creates the process group through it) has three silent failures.

- torchrun's agents keep one TCPStore for the whole job (torch 2.13, static and c10d rendezvous alike) and
  the process group exchanges its peers' addresses under the same keys in every attempt: a restarted rank can
  read a dead rank's address (gloo: "Connection refused"). No count tells the attempts apart on every node:
  ``TORCHELASTIC_RESTART_COUNT`` rises only on the node whose own worker failed; a node restarted because
  another node left keeps its count (torch's ``elastic/agent/server/api.py``), and the round of torch's c10d
  rendezvous lives in the rendezvous store, which workers are not told about.
- A node that never comes (not started, started with another's ``NODE_RANK``, refused at launch) leaves rank 0
  waiting in silence for the process group's timeout, then torch says "1/2 clients joined", naming no node.
- A node started with other settings (another ``data.seed``) trains something else without a word, or dies in a
  gloo size mismatch that names no setting.

So :func:`install_checked_rendezvous` wraps the ``env://`` handler: the ranks meet in the store before the process
group exists (:func:`join_ranks`). Rank 0 draws a fresh token; each other rank says hello with a fresh nonce and is
answered with the token under that nonce, so no rank can take a dead attempt's answer for its own. Every key the
process group then writes goes under that token. While ranks are missing, the waiting ranks log who is missing
every :data:`PROGRESS_EVERY_S`; at the timeout every joined rank stops naming the absent ranks and the causes.
Each rank compares its settings with rank 0's (:mod:`lightning_merak.cli.same_config`), and if any differ every
rank refuses, naming the keys and both values.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any, NoReturn
from urllib.parse import parse_qs, urlparse

from lightning_merak.cli.same_config import SettingsDiffer, describe_differences, setting_differences

__all__ = [
    "PROGRESS_EVERY_S", "RendezvousFailed", "SettingsDiffer", "install_checked_rendezvous", "join_ranks",
    "missing_ranks_message",
]

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0
"""How often a rank that waits for the others at the rendezvous says who is missing."""

_KEYS = "merak_rendezvous"
_MARK = "_merak_checked_rendezvous"
_POLL_S = 0.1


class RendezvousFailed(RuntimeError):
    """The ranks could not all meet (one never came, or rank 0 could not host the store); the message names who and
    the fix."""


def _where(rank: int) -> str:
    node = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK"))
    return f"rank {rank} (host {socket.gethostname()}" + (f", node {node}" if node is not None else "") + ")"


def _node_of(rank: int, ranks_per_node: int | None) -> str:
    return f" (node {rank // ranks_per_node})" if ranks_per_node else ""


def missing_ranks_message(missing: list[int], world_size: int, waited_s: float, ranks_per_node: int | None,
                          store_address: str) -> str:
    """Why the run stops when ``missing`` ranks never came: who, the likely causes, the fix."""
    absent = ", ".join(f"rank {rank}{_node_of(rank, ranks_per_node)}" for rank in missing)
    return (f"{world_size - len(missing)}/{world_size} ranks joined the rendezvous at {store_address} in "
            f"{waited_s:.0f} s; missing: {absent}. Likely causes: that node was not started; two nodes were started "
            "with the same NODE_RANK (each node needs its own, 0 to trainer.num_nodes - 1); that node refused its "
            "launch (see its log); its MASTER_ADDR/MASTER_PORT point elsewhere. Start every node with the same "
            "command line, its own NODE_RANK and node 0's MASTER_ADDR and MASTER_PORT (docs/guides/multi-node.md)")


def _twice_message(ranks: list[int], ranks_per_node: int | None) -> str:
    """The note on ranks that came from two processes each: two nodes were given one ``NODE_RANK``."""
    if not ranks:
        return ""
    twice = ", ".join(f"rank {rank}{_node_of(rank, ranks_per_node)}" for rank in ranks)
    return (f" {twice} came from two processes each: two nodes were started with the same NODE_RANK; give each "
            "node its own NODE_RANK, 0 to trainer.num_nodes - 1, and start every node again")


def _wait_for(found: Callable[[], Any], deadline: float, say_waiting: Callable[[float], None]) -> Any:
    """Poll ``found`` until it returns something other than None or ``deadline`` passes (then None); call
    ``say_waiting`` with the seconds waited every :data:`PROGRESS_EVERY_S`."""
    start = time.monotonic()
    next_word = start + PROGRESS_EVERY_S
    while True:
        value = found()
        if value is not None:
            return value
        now = time.monotonic()
        if now >= deadline:
            return None
        if now >= next_word:
            say_waiting(now - start)
            next_word = now + PROGRESS_EVERY_S
        time.sleep(_POLL_S)


def _read(store: Any, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def join_ranks(store: Any, rank: int, world_size: int, timeout_s: float, settings: Mapping[str, object],
               ranks_per_node: int | None = None, store_address: str = "the rendezvous store") -> str:
    """Meet every rank of this attempt in ``store``; return the token all of them share and no other attempt has.

    Raises :class:`RendezvousFailed` on every joined rank when ranks are still missing after ``timeout_s``, and
    :class:`SettingsDiffer` on every rank when a rank's ``settings`` differ from rank 0's."""
    deadline = time.monotonic() + timeout_s
    settings = json.loads(json.dumps(dict(settings), default=str))  # compared as rank 0's arrive: as JSON values
    if rank == 0:
        return _lead(store, world_size, deadline, timeout_s, settings, ranks_per_node, store_address)
    nonce = uuid.uuid4().hex
    store.set(f"{_KEYS}/hello/{rank}", nonce)
    store.add(f"{_KEYS}/hellos", 1)

    def answered() -> str | None:
        reply = _read(store, f"{_KEYS}/reply/{rank}")
        return reply.split(":", 1)[1] if reply is not None and reply.startswith(nonce + ":") else None

    token = _wait_for(answered, deadline, lambda waited: log.warning(
        "rank %d waits for rank 0 (node 0) at %s: %.0f s so far", rank, store_address, waited))
    if token is None:
        raise RendezvousFailed(
            f"rank 0 (node 0) did not answer rank {rank} at {store_address} in {timeout_s:.0f} s: node 0 ended or "
            f"refused its launch (see its log), or another node was started with this node's NODE_RANK and took rank "
            f"{rank}. Give each node its own NODE_RANK, 0 to trainer.num_nodes - 1, and start every node again")
    leader_settings = json.loads(store.get(f"{_KEYS}/{token}/settings"))
    differences = setting_differences(settings, leader_settings)
    store.set(f"{_KEYS}/{token}/ack/{rank}", json.dumps({"where": _where(rank), "differences": differences}))
    store.add(f"{_KEYS}/{token}/claims/{rank}", 1)  # two processes of one rank (one NODE_RANK twice) count 2
    store.add(f"{_KEYS}/{token}/joined", 1)
    # rank 0 gives its verdict by its own deadline; a margin, so that this rank reads it rather than guessing
    verdict = _wait_for(lambda: _read(store, f"{_KEYS}/{token}/verdict"), deadline + PROGRESS_EVERY_S,
                        lambda waited: log.warning("rank %d waits for the other ranks at %s (rank 0 counts them): "
                                                   "%.0f s so far", rank, store_address, waited))
    if verdict is None:
        raise RendezvousFailed(f"rank 0 at {store_address} gave no verdict on the rendezvous within "
                               f"{timeout_s:.0f} s (its process ended?); see its log")
    store.add(f"{_KEYS}/{token}/verdicts_read", 1)  # rank 0, which hosts the store, may end once all have read it
    return _obey(json.loads(verdict), token)


def _lead(store: Any, world_size: int, deadline: float, timeout_s: float, settings: Mapping[str, object],
          ranks_per_node: int | None, store_address: str) -> str:
    """Rank 0's part: answer every hello with a fresh token until every rank has acknowledged it, then say the
    verdict (who is missing, whose settings differ) to every rank."""
    token = uuid.uuid4().hex
    store.set(f"{_KEYS}/{token}/settings", json.dumps(settings))
    others, answered, hellos_seen = range(1, world_size), {}, -1

    def everyone() -> bool | None:
        nonlocal hellos_seen
        hellos = store.add(f"{_KEYS}/hellos", 0)
        if hellos != hellos_seen:  # a hello arrived: answer it (a dead attempt's stale hello gets a harmless reply)
            hellos_seen = hellos
            for other in others:
                nonce = _read(store, f"{_KEYS}/hello/{other}")
                if nonce is not None and answered.get(other) != nonce:
                    store.set(f"{_KEYS}/reply/{other}", f"{nonce}:{token}")
                    answered[other] = nonce
        # the count says when to look; the ranks themselves, since a rank that came twice counts twice
        if store.add(f"{_KEYS}/{token}/joined", 0) >= world_size - 1 and not missing():
            return True
        return None

    def missing() -> list[int]:
        return [other for other in others if not store.check([f"{_KEYS}/{token}/ack/{other}"])]

    def twice() -> list[int]:
        return [other for other in others if store.add(f"{_KEYS}/{token}/claims/{other}", 0) > 1]

    def say_waiting(waited: float) -> None:
        absent = missing()
        log.warning("rank 0 waits for ranks at %s: %d/%d joined after %.0f s; missing: %s", store_address,
                    world_size - len(absent), world_size, waited,
                    ", ".join(f"rank {other}{_node_of(other, ranks_per_node)}" for other in absent))

    if _wait_for(everyone, deadline, say_waiting) is None:
        message = (missing_ranks_message(missing(), world_size, timeout_s, ranks_per_node, store_address)
                   + _twice_message(twice(), ranks_per_node))
        _refuse_all(store, token, {"missing": message}, store.add(f"{_KEYS}/{token}/joined", 0))
    if twice():  # every rank came, one of them from two processes: the extra one would break the group
        message = _twice_message(twice(), ranks_per_node).strip()
        _refuse_all(store, token, {"missing": message}, store.add(f"{_KEYS}/{token}/joined", 0))
    differing = {}
    for other in range(1, world_size):
        ack = json.loads(store.get(f"{_KEYS}/{token}/ack/{other}"))
        if ack["differences"]:
            differing[ack["where"]] = ack["differences"]
    if differing:
        _refuse_all(store, token, {"differ": describe_differences(differing)}, world_size - 1)
    store.set(f"{_KEYS}/{token}/verdict", json.dumps({}))
    return token


def _refuse_all(store: Any, token: str, verdict: Mapping[str, str], readers: int) -> NoReturn:
    """Rank 0's refusal: say ``verdict`` to the ``readers`` ranks that joined, keep hosting the store until they have
    read it (a bounded wait: rank 0's end would close the store under a rank still polling), then raise it here."""
    store.set(f"{_KEYS}/{token}/verdict", json.dumps(dict(verdict)))
    _wait_for(lambda: True if store.add(f"{_KEYS}/{token}/verdicts_read", 0) >= readers else None,
              time.monotonic() + PROGRESS_EVERY_S, lambda waited: None)
    if "missing" in verdict:
        raise RendezvousFailed(verdict["missing"])
    raise SettingsDiffer(verdict["differ"])


def _obey(verdict: Mapping[str, str], token: str) -> str:
    if "missing" in verdict:
        raise RendezvousFailed(verdict["missing"])
    if "differ" in verdict:
        raise SettingsDiffer(verdict["differ"])
    return token


def _rank_and_world(url: str) -> tuple[int, int]:
    """The rank and world size ``init_process_group`` put in the ``env://`` URL, else the environment's."""
    query = {key: values[-1] for key, values in parse_qs(urlparse(url).query).items()}
    return int(query.get("rank", os.environ.get("RANK", -1))), int(query.get("world_size",
                                                                             os.environ.get("WORLD_SIZE", -1)))


def _open_store(rank: int, world_size: int, timeout: timedelta) -> tuple[Any, str]:
    """The store the ranks meet in: torchrun's agent store, else rank 0's own (hosted without waiting for the
    others: :func:`join_ranks` waits for them and says who is missing); the others connect, saying so while they
    wait for it."""
    from torch.distributed import TCPStore  # lazy: torch

    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(f"env:// rendezvous: environment variable {name} expected, but not set")
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    where = f"{address}:{port}"
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if rank == 0 and not agent_store:
        try:
            return TCPStore(address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                            multi_tenant=True), where
        except RuntimeError as error:  # torch's DistNetworkError: the port is taken
            raise RendezvousFailed(
                f"rank 0 cannot host the rendezvous store on port {port} ({error}): another process holds it: "
                "another node started with NODE_RANK=0 on this host (each node needs its own NODE_RANK), or an "
                "earlier run that has not ended; end it or choose another MASTER_PORT on every node") from None
    deadline = time.monotonic() + timeout.total_seconds()
    start = time.monotonic()
    while True:
        remaining = deadline - time.monotonic()
        try:
            store = TCPStore(address, port, is_master=False,
                             timeout=timedelta(seconds=max(1.0, min(PROGRESS_EVERY_S, remaining))))
            store.set_timeout(timeout)
            return store, where
        except RuntimeError:
            if time.monotonic() >= deadline - 1.0:
                raise RendezvousFailed(
                    f"rank {rank} found no rendezvous store at {where} in {time.monotonic() - start:.0f} s: "
                    + ("torchrun's agent on node 0 is gone" if agent_store else
                       "node 0 (rank 0) was not started, refused its launch, or MASTER_ADDR/MASTER_PORT do not "
                       "point at it; start node 0 with the same command line, NODE_RANK=0 and this MASTER_PORT")
                ) from None
            log.warning("rank %d waits for the rendezvous store of node 0 at %s: %.0f s so far", rank, where,
                        time.monotonic() - start)


def install_checked_rendezvous(settings: Mapping[str, object] | None = None,
                               ranks_per_node: int | None = None) -> bool:
    """Make the process group's ``env://`` rendezvous a checked one (module docstring); True if installed.

    ``settings``: this rank's run settings that every rank must share
    (:func:`~lightning_merak.cli.same_config.run_settings`); ``ranks_per_node`` names the nodes of missing ranks.
    Call before the process group is created (``merak-train``'s ``prepare`` does)."""
    rendezvous_module = importlib.import_module("torch.distributed.rendezvous")  # the package exports a function
    handlers = getattr(rendezvous_module, "_rendezvous_handlers", None)  # private: checked, not assumed
    if not isinstance(handlers, dict) or "env" not in handlers:
        log.warning("this torch keeps no env:// rendezvous handler table: ranks are not checked at the rendezvous "
                    "(a missing node waits for the process group's timeout, differing settings go unnoticed) and a "
                    "torchrun restart may read a failed attempt's addresses (gloo: 'Connection refused')")
        return False
    original = getattr(handlers["env"], _MARK, handlers["env"])
    agreed = dict(settings or {})

    def handler(url: str, timeout: timedelta = rendezvous_module.default_pg_timeout,
                **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        from torch.distributed import PrefixStore  # lazy: torch

        rank, world_size = _rank_and_world(url)
        if rank < 0 or world_size < 1:  # not the launch this handler knows: torch's own says what is missing
            yield from original(url, timeout=timeout, **kwargs)
            return
        store, where = _open_store(rank, world_size, timeout)
        token = join_ranks(store, rank, world_size, timeout.total_seconds(), agreed, ranks_per_node, where)
        yield PrefixStore(f"merak_attempt_{token}", store), rank, world_size
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    setattr(handler, _MARK, original)
    handlers["env"] = handler
    return True
