"""Shared pytest set-up.

* One thread per process, so multi-process tests do not oversubscribe the cores.
* No test inherits the seed another left in the environment with ``seed_everything``.
* The ``distributed`` marker is honest: a test without it that starts a Python process
  (``multiprocessing`` or a ``subprocess`` of the interpreter) fails with the fix, so
  ``pytest -m "not distributed"`` is always the single-process suite. Compilers and
  other non-Python tools (DeepSpeed builds an op with gcc at first use) are allowed.
* A test marked ``gpu`` is skipped where no CUDA device is available.
* Under pytest-xdist (``make test`` runs ``-n 2 --dist load``) two ``distributed`` tests may run at once, one
  per worker: measured faster on 2 cores than running them one after another in one worker (the README says
  by how much).
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

_UNMARKED_START = (
    "this test starts a Python process but is not marked distributed; add @pytest.mark.distributed "
    "(or pytestmark = pytest.mark.distributed for the module)"
)


def _starts_python(args: object) -> bool:
    """Whether a Popen command line runs the interpreter or one of its console scripts."""
    if isinstance(args, (str, bytes)):
        words = os.fsdecode(args).split()
    elif isinstance(args, os.PathLike):
        words = [os.fsdecode(args)]
    else:
        words = [os.fsdecode(word) for word in args]
    if not words:
        return False
    name = os.path.basename(words[0])
    return words[0] == sys.executable or name.startswith(("python", "merak-", "torchrun", "make"))


@pytest.fixture
def single_rank_group() -> Iterator[dist.ProcessGroup]:
    """A gloo process group of this process alone, for code that asks a group its size and rank."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


LEAKED_RUN_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK",
                        "WORLD_SIZE")
"""What an in-process run leaves in the environment, which the processes a later test starts inherit.
``seed_everything``'s seed: Lightning's strategies re-seed from it at setup (``reset_seed``), so it would re-seed
another test's ranks after their own seeding (a model built in ``configure_model`` then starts elsewhere). What
Lightning's launcher sets for an in-process DDP run: a later ``merak-train`` keeps an inherited rendezvous port, chosen
by the kernel in the ephemeral range and by then possibly another connection's (``EADDRINUSE``), and takes an
inherited ``LOCAL_RANK`` for processes started by someone else, so it starts no other rank and waits for them."""


@pytest.fixture(autouse=True)
def _single_thread_and_seed(monkeypatch):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for name in LEAKED_RUN_VARIABLES:  # removed now and put back as found afterwards: no test inherits them
        monkeypatch.delenv(name, raising=False)
    yield


@pytest.fixture(autouse=True)
def _processes_only_when_marked(request, monkeypatch):
    if request.node.get_closest_marker("distributed") is not None:
        yield
        return
    original_popen_init = subprocess.Popen.__init__

    def guarded_popen_init(self, args, *rest, **kwargs):
        if _starts_python(args):
            raise AssertionError(_UNMARKED_START)
        original_popen_init(self, args, *rest, **kwargs)

    def refuse_start(self):
        raise AssertionError(_UNMARKED_START)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen_init)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse_start)
    yield


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
