"""Turn-taking between sub-batch threads: one computes at a time, the others wait for their turn.

A micro-batch split into ``k`` sub-batches (:mod:`~lightning_merak.distributed.sub_batches`) runs each
as a coroutine on its own thread. Only one sub-batch computes at a time: it runs until it waits
for a collective (:mod:`~lightning_merak.distributed.collectives`), then hands the turn to the next
sub-batch, and when its turn comes back it waits for its collective, which by then has mostly
completed behind the others' computation. The turn order is fixed (round-robin), so every rank
issues its collectives in the same order.

Each sub-batch draws random numbers (dropout) from its own generator state, swapped in and
out at every turn: a recomputed block restores the state it started from and must draw the
same masks again, which it would not if other sub-batches had drawn in between. Work done for
the whole batch at a meeting (:func:`meet_in_turn`) draws from the caller's state instead.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence

import torch

from lightning_merak.distributed.streams import current_stream, stream_scope
from lightning_merak.util import random_state

__all__ = ["caller_state", "in_sub_batch_region", "meet_in_turn", "run_in_turns", "sub_batch_index",
           "watch_turn_waits", "yield_turn"]

_local = threading.local()
_turn_wait_watchers: list[Callable[[int, float, float], None]] = []


def watch_turn_waits(callback: Callable[[int, float, float], None]) -> Callable[[], None]:
    """Call ``callback(sub_batch, start, end)`` (``time.perf_counter`` seconds), on the waiting thread, after every
    wait of a sub-batch for its turn: while it waits another sub-batch computes, which a profiler must not count as
    the waiting one's work. Returns the function that stops the calls."""
    _turn_wait_watchers.append(callback)
    return lambda: _turn_wait_watchers.remove(callback)


class _RandomStreams:
    """One random generator state per sub-batch, held in the process-wide generators while it has the turn.

    The sub-batches' seeds derive from the caller's generator state without advancing it (the
    same on every rank, so replicated computation stays replicated). The caller's stream is
    left to what stands for the whole batch: a meeting's combined computation draws from it, as
    the unsplit model would, and the caller continues from there.
    """

    def __init__(self, count: int) -> None:
        self._caller = random_state.capture()
        base = int(torch.randint(2**62, (1,), generator=torch.Generator().set_state(self._caller[0])))
        self._states = [random_state.seeded(random_state.spread_seed(base, index)) for index in range(count)]

    def resume(self, index: int) -> None:
        random_state.restore(self._states[index])

    def pause(self, index: int) -> None:
        self._states[index] = random_state.capture()

    @contextlib.contextmanager
    def as_caller(self, index: int) -> Iterator[None]:
        """Draw from the caller's stream (whole-batch work) inside sub-batch ``index``'s turn."""
        self.pause(index)
        random_state.restore(self._caller)
        try:
            yield
        finally:
            self._caller = random_state.capture()
            self.resume(index)

    def restore_caller(self) -> None:
        random_state.restore(self._caller)


class _TurnTaking:
    """Round-robin turns between sub-batch threads; one computes at a time.

    Each thread sleeps on its own lock and only the thread whose turn comes is woken: a
    shared condition woke every waiting sub-batch at every switch, and each of them then
    took the GIL from the computing thread just to go back to sleep.
    """

    def __init__(self, count: int, streams: Optional[_RandomStreams] = None) -> None:
        """With ``streams``, a thread's random generator state goes with its turn."""
        self._streams = streams
        self._lock = threading.Lock()
        self._finished = [False] * count
        self._wake = [threading.Lock() for _ in range(count)]
        for index in range(1, count):
            self._wake[index].acquire()

    def _pass_turn(self, index: int) -> None:
        """Wake the next unfinished sub-batch after ``index`` (``index`` itself when it is the last one left)."""
        count = len(self._finished)
        with self._lock:
            for step in range(1, count + 1):
                candidate = (index + step) % count
                if not self._finished[candidate]:
                    self._wake[candidate].release()
                    return

    def wait_for_turn(self, index: int) -> None:
        started = time.perf_counter()
        self._wake[index].acquire()
        for watcher in tuple(_turn_wait_watchers):
            watcher(index, started, time.perf_counter())
        if self._streams is not None:
            self._streams.resume(index)

    def yield_turn(self, index: int) -> None:
        if self._streams is not None:
            self._streams.pause(index)
        self._pass_turn(index)
        self.wait_for_turn(index)

    def whole_batch_random(self, index: int) -> contextlib.AbstractContextManager:
        """Random draws of whole-batch work done in ``index``'s turn come from the caller's stream."""
        return contextlib.nullcontext() if self._streams is None else self._streams.as_caller(index)

    def finish(self, index: int) -> None:
        with self._lock:
            self._finished[index] = True
        self._pass_turn(index)


def yield_turn() -> None:
    """Hand the turn to the next sub-batch and wait for it to come back (nothing outside a region)."""
    turns: Optional[_TurnTaking] = getattr(_local, "turns", None)
    if turns is not None:
        turns.yield_turn(_local.index)


def sub_batch_index() -> int:
    """The calling sub-batch's position in its region (0 outside a region)."""
    return getattr(_local, "index", 0)


@contextlib.contextmanager
def _thread_state(grad: bool, inference: bool, autocast: list[tuple[str, torch.dtype]], cuda_device: Optional[int],
                  threads: int, cuda_stream: Any = None):
    """Carry the caller's thread-local torch modes (and intra-op thread count) into a sub-batch thread.

    On CUDA that includes the caller's stream (a new thread starts on the device's default stream): the
    sub-batches compute on it in turns while their collectives run on NCCL's stream, ordered by ``work.wait()``
    (:mod:`~lightning_merak.distributed.collectives`), so the region's outputs are ready on the caller's stream.
    """
    torch.set_num_threads(threads)
    with contextlib.ExitStack() as stack:
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        stack.enter_context(stream_scope(cuda_stream))
        stack.enter_context(torch.inference_mode(inference))
        stack.enter_context(torch.set_grad_enabled(grad))
        for device_type, dtype in autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        yield


def caller_state(grad: bool) -> dict[str, Any]:
    """The calling thread's torch modes, for :func:`run_in_turns` to carry into the sub-batch threads."""
    autocast = [(device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                if torch.is_autocast_enabled(device)]
    cuda_device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    cuda_stream = None if cuda_device is None else current_stream(torch.device("cuda", cuda_device))
    return {"grad": grad, "inference": torch.is_inference_mode_enabled(), "autocast": autocast,
            "cuda_device": cuda_device, "threads": torch.get_num_threads(), "cuda_stream": cuda_stream}


class _Worker:
    """A sub-batch thread kept between regions.

    A fresh thread per region paid for its start and for the first use of torch's per-thread
    state (OpenMP team, allocator arena) at every forward and backward: one Llama forward and
    backward took 20% more CPU in a new thread than in a reused one.
    """

    _idle: list["_Worker"] = []
    _idle_lock = threading.Lock()
    _count = 0

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = queue.SimpleQueue()
        with _Worker._idle_lock:
            _Worker._count += 1
            name = f"merak-sub-batch-{_Worker._count}"
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            job, finished = self._jobs.get()
            job()
            with _Worker._idle_lock:
                _Worker._idle.append(self)
            finished.set()

    def run(self, job: Callable[[], None]) -> threading.Event:
        """Run ``job`` (which must not raise) on this worker; the event is set once it is idle again."""
        finished = threading.Event()
        self._jobs.put((job, finished))
        return finished


def _take_worker() -> _Worker:
    """An idle worker, or a new one: a region nested in a sub-batch never waits for a busy thread."""
    with _Worker._idle_lock:
        if _Worker._idle:
            return _Worker._idle.pop()
    return _Worker()


def run_in_turns(tasks: list[Callable[[], Any]], state: dict[str, Any]) -> list[Any]:
    """Run ``tasks`` as round-robin coroutines (switching at collectives); results in order.

    Each task has its own random stream (:class:`_RandomStreams`); a single task needs none.
    """
    streams = _RandomStreams(len(tasks)) if len(tasks) > 1 else None
    turns = _TurnTaking(len(tasks), streams)
    results: list[Any] = [None] * len(tasks)
    errors: list[Optional[BaseException]] = [None] * len(tasks)

    def work(index: int, task: Callable[[], Any]) -> None:
        _local.turns, _local.index = turns, index
        try:
            turns.wait_for_turn(index)
            with _thread_state(**state):
                results[index] = task()
        except BaseException as error:
            errors[index] = error
        finally:
            _local.turns = None
            turns.finish(index)

    done = [_take_worker().run(functools.partial(work, i, task)) for i, task in enumerate(tasks)]
    for finished in done:
        finished.wait()
    if streams is not None:
        streams.restore_caller()
    for error in errors:
        if error is not None:
            raise error
    return results


def in_sub_batch_region() -> bool:
    """Whether the calling code runs as one sub-batch of a region
    (:func:`~lightning_merak.distributed.sub_batches.run_sub_batches`)."""
    return getattr(_local, "turns", None) is not None


@dataclass
class _Meeting:
    key: Hashable
    values: dict[int, Any] = field(default_factory=dict)
    results: Optional[list[Any]] = None
    failed: bool = False


@dataclass
class _Meetings:
    """The meetings of one region, in the order its sub-batches reach them."""

    reached: list[int]
    meetings: list[_Meeting] = field(default_factory=list)


_meetings: "weakref.WeakKeyDictionary[_TurnTaking, _Meetings]" = weakref.WeakKeyDictionary()


def meet_in_turn(key: Hashable, value: Any, combine: Callable[[list[Any]], Sequence[Any]]) -> Any:
    """Join ``value`` with the other sub-batches' values; ``combine`` sees them all once.

    Every sub-batch of the region submits its value and hands the turn on until all have;
    ``combine`` then runs once (on the last arrival's thread, so collectives inside it are
    issued once per rank) with the values in sub-batch order, and returns one result per
    sub-batch. The n-th meeting of each sub-batch is the same meeting; ``key`` guards
    against sub-batches that take different paths. Outside a region: ``combine([value])[0]``.
    """
    turns: Optional[_TurnTaking] = getattr(_local, "turns", None)
    if turns is None:
        return combine([value])[0]
    index, parts = _local.index, len(turns._finished)
    state = _meetings.setdefault(turns, _Meetings([0] * parts))
    number = state.reached[index]
    state.reached[index] += 1
    if number == len(state.meetings):
        state.meetings.append(_Meeting(key))
    meeting = state.meetings[number]
    if meeting.key != key:
        raise RuntimeError(
            f"sub-batch {index} reached meeting {key!r} where another sub-batch reached {meeting.key!r}; "
            f"every sub-batch of a region must run the same layers in the same order")
    meeting.values[index] = value
    if len(meeting.values) == parts:
        try:
            with turns.whole_batch_random(index):
                results = list(combine([meeting.values[i] for i in range(parts)]))
        except BaseException:
            meeting.failed = True
            raise
        if len(results) != parts:
            meeting.failed = True
            raise RuntimeError(f"combine returned {len(results)} results for {parts} sub-batches")
        meeting.results, meeting.values = results, {}
    while meeting.results is None:
        if meeting.failed:
            raise RuntimeError(f"meeting {key!r} failed in another sub-batch")
        gone = [i for i in range(parts) if i not in meeting.values and turns._finished[i]]
        if gone:
            raise RuntimeError(f"sub-batch {gone[0]} finished without reaching meeting {key!r}")
        turns.yield_turn(index)
    return meeting.results[index]

