"""ZeRO's bucket reduce-scatters start in order with at most ``limit`` receive buffers alive at once."""

from __future__ import annotations

import pytest
import torch

from lightning_merak.parallel.data.reduce_scatter import ReduceScatterQueue


class _FakeExchange:
    """An exchange that holds a receive buffer until waited on and completes when the test says so."""

    def __init__(self, log: list, out: torch.Tensor, flat: torch.Tensor, buffered: bool) -> None:
        self.out, self.flat, self.done, self.buffered, self.log = out, flat, False, buffered, log
        log.append(("start", int(flat[0])))

    def is_completed(self) -> bool:
        return self.done

    @property
    def holds_buffer(self) -> bool:
        return self.buffered

    def wait(self) -> None:
        self.done, self.buffered = True, False
        self.out.fill_(self.flat[0])


def _queue(limit: int, buffered: bool = True) -> tuple[ReduceScatterQueue, list, list, dict]:
    log, done, started = [], [], {}

    def start(out: torch.Tensor, flat: torch.Tensor, group: object) -> _FakeExchange:
        started[int(flat[0])] = _FakeExchange(log, out, flat, buffered)
        return started[int(flat[0])]

    return ReduceScatterQueue(None, done.append, limit=limit, start=start), log, done, started


def _submit(queue: ReduceScatterQueue, index: int) -> torch.Tensor:
    out = torch.zeros(1)
    queue.submit(index, out, torch.full((2,), float(index)))
    return out


def test_buckets_beyond_the_limit_wait_without_a_buffer_and_start_in_order() -> None:
    queue, log, done, started = _queue(limit=2)
    outs = [_submit(queue, index) for index in range(5)]
    assert [entry[1] for entry in log] == [0, 1]  # two buffers alive, three buckets waiting
    assert all(index in queue for index in range(5)) and 5 not in queue
    started[1].done = True  # completed out of order: bucket 1 is finished, bucket 2 starts
    queue.poll()
    assert done == [1] and [entry[1] for entry in log] == [0, 1, 2]
    queue.drain()
    assert [entry[1] for entry in log] == [0, 1, 2, 3, 4]
    assert sorted(done) == [0, 1, 2, 3, 4] and len(done) == 5  # each bucket's callback once
    assert [float(out) for out in outs] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert 0 not in queue  # drained: the next step starts afresh


def test_exchanges_without_a_buffer_are_not_held_back() -> None:
    queue, log, done, _ = _queue(limit=1, buffered=False)
    for index in range(4):
        _submit(queue, index)
    assert [entry[1] for entry in log] == [0, 1, 2, 3]
    queue.drain()
    assert done == [0, 1, 2, 3]


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="limit=0"):
        ReduceScatterQueue(None, lambda index: None, limit=0)
