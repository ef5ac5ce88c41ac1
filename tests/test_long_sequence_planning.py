"""Planning at long sequences stays bounded: slow quantities are timed fewer times, attention kernels past
:data:`LONGEST_TIMED_SEQUENCE` are timed shorter and extrapolated, and ranks exchange their profiles in the store
with a deadline sized to the work, so that minutes of profiling do not look like a hang to the watchdog."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_merak.planning.measure.context import extrapolate_attention_s, time_attention_kernels
from lightning_merak.planning.planner import ContextAttention
from lightning_merak.testing.distributed import run_distributed
from lightning_merak.util.timing import MIN_BUDGETED_REPEATS, mean_call_time, median_call_time, repeat_budget


def test_a_repeat_budget_cuts_the_repeats_of_slow_calls_only():
    calls: list[float] = []

    def slow() -> None:
        calls.append(time.perf_counter())
        time.sleep(0.02)

    with repeat_budget(0.01):
        median_call_time(slow, 11, "cpu")
        assert len(calls) == 1 + MIN_BUDGETED_REPEATS  # the warm-up alone spent the budget: the fewest timed calls
        calls.clear()
        mean_call_time(lambda: calls.append(0.0), 11, "cpu")  # microseconds: every repeat
        assert len(calls) == 12
    calls.clear()
    median_call_time(slow, 5, "cpu")  # outside a budget: as asked
    assert len(calls) == 6
    with pytest.raises(ValueError, match="seconds > 0"), repeat_budget(0.0):
        pass


def test_attention_time_is_extrapolated_as_linear_plus_quadratic_in_the_length():
    def seconds(length: int) -> float:
        return 2e-6 * length + 3e-9 * length**2

    assert extrapolate_attention_s([(1024, seconds(1024)), (512, seconds(512))], 16384) == pytest.approx(
        seconds(16384))
    # noise that would make a coefficient negative keeps the estimate growing with the length
    assert extrapolate_attention_s([(1000, 1.0), (2000, 1.5)], 4000) == pytest.approx(3.0)
    assert extrapolate_attention_s([(1000, 1.0), (2000, 8.0)], 4000) == pytest.approx(32.0)
    with pytest.raises(ValueError, match="two distinct"):
        extrapolate_attention_s([(1000, 1.0), (1000, 2.0)], 4000)


def _shape(length: int) -> ContextAttention:
    return ContextAttention(sequence_length=length, hidden_size=128, heads=4, key_value_heads=2, head_dim=32,
                            element_bytes=4)


_KEYS = {(2, "ring", 1, 1), (4, "ring", 1, 1), (2, "all_to_all", 1, 1)}


def test_kernels_past_the_longest_timed_length_are_timed_shorter_and_extrapolated(monkeypatch):
    """Asked for 4096 tokens with 2048 the longest timed, every kernel is timed at 1024 and 2048 tokens only, and
    each of its forward and backward times at 4096 is the linear-plus-quadratic fit through those two.

    The kernels' timer is replaced by a known law of the length, so the check holds on any machine; how close the
    fit comes to a real kernel's time is the planner benchmark's measurement, not a test's."""
    import lightning_merak.planning.measure.context as context

    def law(length: int, key: tuple, backward: bool) -> float:
        scale = (1 + sum(part for part in key if isinstance(part, int))) * (2.0 if backward else 1.0)
        return scale * (3e-6 * length + 5e-10 * length**2)

    timed_lengths: list[int] = []

    def fake_timed_kernels(shape, keys, device, repeats):
        timed_lengths.append(shape.sequence_length)
        whole = {(tp, samples): (law(shape.sequence_length, (tp, samples), False),
                                 law(shape.sequence_length, (tp, samples), True)) for _, _, tp, samples in keys}
        split = {key: (law(shape.sequence_length, key, False), law(shape.sequence_length, key, True))
                 for key in keys}
        return whole, split

    monkeypatch.setattr(context, "_timed_kernels", fake_timed_kernels)
    whole, split = time_attention_kernels(_shape(4096), _KEYS, torch.device("cpu"), repeats=3, longest_timed=2048)
    assert timed_lengths == [1024, 2048]
    assert set(split) == _KEYS and set(whole) == {(1, 1)}
    for table in (whole, split):
        for key, (forward_s, backward_s) in table.items():
            assert forward_s == pytest.approx(law(4096, key, False))
            assert backward_s == pytest.approx(law(4096, key, True))
    timed_lengths.clear()
    time_attention_kernels(_shape(2048), _KEYS, torch.device("cpu"), repeats=3, longest_timed=2048)
    assert timed_lengths == [2048]  # up to the longest timed length: timed as asked


def test_kernel_timing_cost_does_not_grow_with_the_sequence():
    """A million tokens (hours per kernel call on a CPU) are planned from timings at 512 and 256."""
    started = time.perf_counter()
    whole, split = time_attention_kernels(_shape(1 << 20), _KEYS, torch.device("cpu"), repeats=3, longest_timed=512)
    assert time.perf_counter() - started < 20.0
    short, _ = time_attention_kernels(_shape(512), _KEYS, torch.device("cpu"), repeats=3)
    assert set(split) == _KEYS and whole[(1, 1)][0] > 100 * short[(1, 1)][0]


def _exchange_after_working_alone(rank: int, world_size: int) -> tuple[list, str]:
    import torch.distributed as dist

    from lightning_merak.distributed.store_gather import StoreGatherTimeout, gather_through_store
    from lightning_merak.distributed.watchdog import Watchdog, working_alone

    watchdog = Watchdog(timeout_s=1.0, dead_after_s=30, poll_s=0.2, timeout_option="faults.collective_timeout_s")
    watchdog.start()
    with working_alone("a long profile"):
        if rank == 1:
            time.sleep(2.5)  # rank 0 waits in the barrier meanwhile, past the stall timeout: no alarm
        dist.barrier()
        gathered = gather_through_store({"rank": rank}, "test/first", 10.0, "profiling", "the_option")
    watchdog.stop()
    if rank == 1:
        return gathered, ""  # never delivers to the second gather
    try:
        gather_through_store(rank, "test/second", 1.0, "profiling the model", "strategy.timeout_s")
    except StoreGatherTimeout as error:
        return gathered, str(error)
    return gathered, "no timeout"


@pytest.mark.distributed
def test_ranks_working_alone_raise_no_stall_and_exchange_through_the_store_with_a_deadline():
    """A rank inside ``working_alone`` waits past the watchdog's stall timeout without an alarm; the store
    exchange returns every rank's value, and past its deadline names the missing rank and the option."""
    results = run_distributed(_exchange_after_working_alone, world_size=2, timeout_s=120)
    assert results[0][0] == results[1][0] == [{"rank": 0}, {"rank": 1}]
    assert "rank 0 waited 1 s for ranks [1] to finish profiling the model" in results[0][1]
    assert "raise strategy.timeout_s" in results[0][1]
