"""The multi-process test bed itself: results, failures, hangs, and DDP vs a single-process reference."""

import multiprocessing as mp
import pickle
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_merak.testing import (
    DistributedRunError,
    TrainingTrace,
    assert_traces_match,
    record_reference_trace,
    run_distributed,
    snapshot_gradients,
)

STEPS, GLOBAL_BATCH, FEATURES = 5, 8, 6
# The liveness bounds below guard behaviours (fail at once / at the deadline, not never), not speed: each sits
# far from both what a healthy run takes on a loaded machine and what a broken one would take. The hang
# deadline is the test's own wait: ranks fork from a warm forkserver in under a second, and a deadline
# that passes before either rank started still names both ranks, which the test accepts.
FAIL_FAST_DEADLINE_S, HANG_DEADLINE_S, HANG_S = 240, 8, 600


def _sum_of_ranks(rank: int, world_size: int, scale: float) -> float:
    value = torch.tensor([rank * scale])
    dist.all_reduce(value)
    return value.item()


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()


def _rank_one_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(HANG_S)


def _make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, FEATURES, generator=generator), torch.randn(GLOBAL_BATCH, 1, generator=generator))
        for _ in range(STEPS)
    ]


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


def _ddp_trace(rank: int, world_size: int) -> TrainingTrace:
    model = DistributedDataParallel(_make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = GLOBAL_BATCH // world_size
    trace = TrainingTrace()
    for inputs, targets in _batches():
        optimizer.zero_grad()
        loss = _mse(model, (inputs[rank * shard:(rank + 1) * shard], targets[rank * shard:(rank + 1) * shard]))
        loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        trace.append(global_loss.item() / world_size, snapshot_gradients(model.module))
        optimizer.step()
    return trace


@pytest.mark.distributed
def test_returns_per_rank_results():
    assert run_distributed(_sum_of_ranks, world_size=3, args=(2.0,)) == [6.0, 6.0, 6.0]


@pytest.mark.distributed
def test_a_failing_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="rank 1 failed(.|\n)*rank one is broken"):
        run_distributed(_rank_one_raises, world_size=2, timeout_s=FAIL_FAST_DEADLINE_S)
    # liveness: raised as soon as rank 1 failed, not when rank 0's barrier or the run's deadline expired
    assert time.monotonic() - start < FAIL_FAST_DEADLINE_S / 2
    assert not mp.active_children()


@pytest.mark.distributed
def test_a_rank_that_cannot_start_raises_its_own_error():
    # The function does not pickle, so no rank process starts; the pickling error is what the
    # caller must see, not a failure to clean up the processes that never ran.
    with pytest.raises((pickle.PicklingError, AttributeError), match="pickle"):
        run_distributed(lambda rank, world_size: rank, world_size=2, timeout_s=20)
    assert not mp.active_children()


@pytest.mark.distributed
def test_a_hanging_rank_is_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match=rf"ranks \[(0, )?1\] did not finish within {HANG_DEADLINE_S}s"):
        run_distributed(_rank_one_hangs, world_size=2, timeout_s=HANG_DEADLINE_S)
    # liveness: the hanging rank was ended at the deadline (plus reaping), not left to sleep HANG_S out
    assert time.monotonic() - start < HANG_S / 4
    assert not mp.active_children()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_matches_single_process_reference(world_size):
    model = _make_model()
    reference = record_reference_trace(model, _batches(), _mse, torch.optim.SGD(model.parameters(), lr=0.1))
    traces = run_distributed(_ddp_trace, world_size=world_size)
    for trace in traces:
        assert_traces_match(reference, trace, loss_rtol=1e-5, grad_rtol=1e-5)


def test_comparison_catches_a_wrong_gradient():
    model = _make_model()
    reference = record_reference_trace(model, _batches(), _mse, torch.optim.SGD(model.parameters(), lr=0.1))
    broken = TrainingTrace(
        losses=list(reference.losses),
        gradients=[{name: grad * (1.001 if step == 3 else 1.0) for name, grad in grads.items()}
                   for step, grads in enumerate(reference.gradients)],
    )
    with pytest.raises(AssertionError, match="step 3: gradient of 0.weight differs"):
        assert_traces_match(reference, broken)
    shifted = TrainingTrace(losses=[loss * 1.01 for loss in reference.losses], gradients=reference.gradients)
    with pytest.raises(AssertionError, match="step 0: loss"):
        assert_traces_match(reference, shifted)
