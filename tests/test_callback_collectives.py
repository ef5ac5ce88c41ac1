"""Collectives in callbacks run on every rank or on none.

A collective that only some ranks reach (``trainer.log_dir`` broadcasts from rank 0; DeltaMemory's
plan exchange gathers from all ranks) leaves the others waiting in the next collective they meet:
a deadlock until gloo's timeout, or a "collective mismatch" abort.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_merak.callbacks.delta.blocks import discover_blocks
from lightning_merak.callbacks.delta.budget import parse_budget
from lightning_merak.callbacks.delta.callback import PLOT_NAME
from lightning_merak.callbacks.delta.runtime import ManagerOptions, MemoryManager
from lightning_merak.testing.delta_models import tiny_gpt2

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 240  # a normal run takes well under a minute; before the fix rank 0 waited 10 minutes


@pytest.mark.distributed
def test_merak_train_with_delta_memory_finishes_and_plots(tmp_path):
    """Rank 0 used to broadcast ``trainer.log_dir`` alone in ``on_train_end`` while rank 1 waited in
    ModelCheckpoint's all-reduce."""
    command = [
        sys.executable, "-m", "lightning_merak.train", "memory=delta", "memory.budget=2GiB",
        "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
        "data.num_sequences=128", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}",
    ]
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"merak-train memory=delta did not finish within {RUN_TIMEOUT_S}s (deadlock):\n{output[-4000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, output[-4000:]
    plots = list(tmp_path.rglob(PLOT_NAME))
    assert plots, f"no {PLOT_NAME} under {tmp_path}:\n{output[-4000:]}"


def _count_shares(budget: str) -> tuple[int, bool]:
    """How often a manager calls ``share`` in four steps of one input size, and whether its plan fits."""
    model = tiny_gpt2()
    model.train()
    calls = []

    def share(payload):
        calls.append(payload)
        return payload

    options = ManagerOptions(budget=parse_budget(budget), swap_tier="host", warmup_steps=1)
    manager = MemoryManager(discover_blocks(model), options, log=lambda message: None, share=share)
    manager.start(model, torch.device("cpu"))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        for _ in range(4):
            manager.begin_step("ids", ids.numel())
            loss = model(input_ids=ids, labels=ids).loss
            manager.end_forward()
            loss.backward()
            manager.end_backward()
        return len(calls), manager.plan.fits
    finally:
        manager.close()


def test_plan_exchange_does_not_depend_on_whether_this_ranks_plan_fits():
    """Pipeline stages plan apart: a stage whose plan cannot fit must still join the re-plan exchange."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny budget cannot be met: that is the point
        unfitting, unfitting_fits = _count_shares("1KiB")
    fitting, fitting_fits = _count_shares("1GiB")
    assert (unfitting_fits, fitting_fits) == (False, True)
    assert unfitting == fitting == 2, "one exchange for the plan, one for the re-plan check of the input size"
