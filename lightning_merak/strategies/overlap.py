"""Sub-batch overlap of tensor-parallel communication with computation, for unmodified models.

A micro-batch is split into ``k`` sub-batches along the batch dimension and each runs the
whole forward (all blocks of the model or stage) as a coroutine on its own thread. Only
one sub-batch computes at a time: it runs until it launches a tensor-parallel collective,
then hands the turn to the next sub-batch, and when its turn comes back it waits for its
collective, which by then has mostly completed behind the others' computation. The turn
order is fixed (round-robin), so every rank issues its collectives in the same order.

Backward mirrors this: the sub-batches' autograd graphs are separate, and their backward
passes run as the same kind of coroutines, switching at every gradient all-reduce. The
region is one autograd node whose inputs include the module's parameters, so a caller's
``torch.autograd.grad(outputs, inputs)`` (pipeline shape inference) leaves parameter
gradients untouched, exactly as without the region.

Recomputation never repeats a collective: inside a checkpointed block the post-collective
tensors are recorded during the forward (:func:`collective_replay_contexts`) and handed back
when the block is recomputed.

Each sub-batch draws random numbers (dropout) from its own generator state, swapped in and
out at every turn: a recomputed block restores the state it started from and must draw the
same masks again, which it would not if other sub-batches had drawn in between. Work done for
the whole batch at a meeting (:func:`meet_in_turn`) draws from the caller's state instead.

The model code is not changed: the region wraps a module's ``forward``; tensors whose first
dimension is the batch are split, the others are passed to every sub-batch whole.
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
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_merak.strategies import random_state

__all__ = [
    "CommunicationTrace",
    "PendingCollective",
    "SubBatchForward",
    "all_gather_in_turn",
    "all_reduce_in_turn",
    "all_to_all_in_turn",
    "collective_replay_contexts",
    "in_checkpointed_region",
    "in_sub_batch_region",
    "mark_sub_batch_share",
    "meet_in_turn",
    "record_communication",
    "reduce_scatter_in_turn",
    "run_sub_batches",
    "start_all_gather_in_turn",
    "start_all_reduce_in_turn",
    "start_reduce_scatter_in_turn",
    "start_all_to_all_in_turn",
]

_local = threading.local()


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
        self._wake[index].acquire()
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


def _yield_if_in_sub_batch() -> None:
    turns: Optional[_TurnTaking] = getattr(_local, "turns", None)
    if turns is not None:
        turns.yield_turn(_local.index)


@contextlib.contextmanager
def _thread_state(grad: bool, inference: bool, autocast: list[tuple[str, torch.dtype]], cuda_device: Optional[int],
                  threads: int):
    """Carry the caller's thread-local torch modes (and intra-op thread count) into a sub-batch thread."""
    torch.set_num_threads(threads)
    with contextlib.ExitStack() as stack:
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        stack.enter_context(torch.inference_mode(inference))
        stack.enter_context(torch.set_grad_enabled(grad))
        for device_type, dtype in autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        yield


def _caller_state(grad: bool) -> dict[str, Any]:
    autocast = [(device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                if torch.is_autocast_enabled(device)]
    cuda_device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"grad": grad, "inference": torch.is_inference_mode_enabled(), "autocast": autocast,
            "cuda_device": cuda_device, "threads": torch.get_num_threads()}


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


def _run_in_turns(tasks: list[Callable[[], Any]], state: dict[str, Any]) -> list[Any]:
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


# Communication trace -------------------------------------------------------------------------


@dataclass
class CommunicationTrace:
    """Tensor-parallel collectives of a run: which, when each was launched, completed and waited for.

    ``exposed_s`` is the time ranks spent blocked on a collective (no computation could run),
    ``busy_s`` the time at least one collective was in flight.
    """

    events: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.events.append(event)

    @staticmethod
    def _union(intervals: list[tuple[float, float]]) -> float:
        total, end = 0.0, float("-inf")
        for start, stop in sorted(intervals):
            if stop <= end:
                continue
            total += stop - max(start, end)
            end = stop
        return total

    @property
    def exposed_s(self) -> float:
        return self._union([(e["wait_start"], e["wait_end"]) for e in self.events])

    @property
    def busy_s(self) -> float:
        return self._union([(e["launch"], e["complete"]) for e in self.events])

    @property
    def exposed_fraction(self) -> float:
        """Share of the communication time that computation did not hide."""
        busy = self.busy_s
        return self.exposed_s / busy if busy > 0 else 0.0

    def chrome_trace(self) -> dict[str, Any]:
        """The events as a Chrome/Perfetto trace (one row per sub-batch, one for the wire)."""
        if not self.events:
            return {"traceEvents": []}
        origin = min(e["launch"] for e in self.events)
        rows = []
        for event in self.events:
            lane = int(event["sub_batch"])
            rows.append({"name": f"{event.get('op', 'collective')} in flight", "ph": "X", "pid": 0, "tid": "wire",
                         "ts": (event["launch"] - origin) * 1e6, "dur": (event["complete"] - event["launch"]) * 1e6})
            rows.append({"name": "exposed wait", "ph": "X", "pid": 0, "tid": f"sub-batch {lane}",
                         "ts": (event["wait_start"] - origin) * 1e6,
                         "dur": (event["wait_end"] - event["wait_start"]) * 1e6})
        return {"traceEvents": rows}


_trace: Optional[CommunicationTrace] = None


@contextlib.contextmanager
def record_communication() -> Iterator[CommunicationTrace]:
    """Record every tensor-parallel collective issued inside the block (any thread)."""
    global _trace
    previous, _trace = _trace, CommunicationTrace()
    try:
        yield _trace
    finally:
        _trace = previous


@contextlib.contextmanager
def unrecorded_communication() -> Iterator[None]:
    """Leave the collectives issued inside out of an enclosing :func:`record_communication` (setup checks)."""
    global _trace
    previous, _trace = _trace, None
    try:
        yield
    finally:
        _trace = previous


# Collectives --------------------------------------------------------------------------------


class _CollectiveReplay:
    """Post-collective tensors of one checkpointed forward, handed back on recomputation."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []
        self.mode = "record"


def _replay_stack() -> list[_CollectiveReplay]:
    if not hasattr(_local, "replay"):
        _local.replay = []
    return _local.replay


@contextlib.contextmanager
def _replaying(replay: _CollectiveReplay, mode: str) -> Iterator[None]:
    stack = _replay_stack()
    replay.mode = mode
    stack.append(replay)
    try:
        yield
    finally:
        stack.pop()


def collective_replay_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint``: record collectives, then replay them.

    The forward context stores each collective's result; the recompute context returns
    them in order instead of communicating again.
    """
    replay = _CollectiveReplay()
    return _replaying(replay, "record"), _replaying(replay, "replay")


def _communicate_once(communicate: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``communicate()``, except inside a recomputed checkpoint region, which gets the recorded result."""
    stack = _replay_stack()
    replay = stack[-1] if stack else None
    if replay is not None and replay.mode == "replay":
        if not replay.outputs:
            raise RuntimeError("recomputation issued more tensor-parallel collectives than the forward recorded")
        return replay.outputs.pop(0)
    result = communicate()
    if replay is not None:
        replay.outputs.append(result.detach())
    return result


def all_reduce_in_turn(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place, letting other sub-batches compute meanwhile.

    Inside a recomputed checkpoint region the recorded result is returned instead.
    """
    if tensor.is_meta or dist.get_world_size(group) == 1:
        return tensor
    return _communicate_once(lambda: _launch_all_reduce(tensor, group).wait())


def _launch_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> "PendingCollective":
    launch = time.perf_counter()
    return PendingCollective(tensor, dist.all_reduce(tensor, group=group, async_op=True), launch, "all_reduce")


def _start_in_turn(tensor: torch.Tensor, group: dist.ProcessGroup, now: Callable[[], torch.Tensor],
                   launch: Callable[[], "PendingCollective"]) -> "PendingCollective":
    """``launch()``, or ``now()`` done at once where nothing is launched: a single rank, a meta
    tensor, or a checkpointed region, where collectives are recorded or replayed."""
    if dist.get_world_size(group) == 1 or tensor.is_meta or _replay_stack():
        return PendingCollective(now(), None)
    return launch()


def start_all_reduce_in_turn(tensor: torch.Tensor, group: dist.ProcessGroup) -> "PendingCollective":
    """Launch the in-place sum of ``tensor`` over ``group``; the caller computes until it waits.

    For work the caller itself has to do meanwhile (a column group's weight gradients while
    its input gradient is summed). Done at once where :func:`_start_in_turn` says so.
    """
    return _start_in_turn(tensor, group, lambda: all_reduce_in_turn(tensor, group),
                          lambda: _launch_all_reduce(tensor, group))


def all_gather_in_turn(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (rank order), letting other sub-batches compute meanwhile.

    Inside a recomputed checkpoint region the recorded result is returned instead.
    """
    ranks = dist.get_world_size(group)
    if ranks == 1:
        return tensor
    if tensor.is_meta:
        return torch.cat([tensor] * ranks, dim=dim)
    return _communicate_once(lambda: _launch_all_gather(tensor, group, dim).wait())


def _launch_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> "PendingCollective":
    ranks = dist.get_world_size(group)
    pieces = tensor.new_empty((ranks * tensor.shape[0], *tensor.shape[1:]))
    launch = time.perf_counter()
    work = dist.all_gather_single(pieces, tensor.contiguous(), group=group, async_op=True)
    return PendingCollective(pieces, work, launch, "all_gather",
                             finish=lambda gathered: torch.cat(gathered.chunk(ranks), dim=dim))


def start_all_gather_in_turn(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> "PendingCollective":
    """Launch :func:`all_gather_in_turn`; the caller computes until it waits for the concatenation.

    Done at once where :func:`_start_in_turn` says so.
    """
    return _start_in_turn(tensor, group, lambda: all_gather_in_turn(tensor, group, dim),
                          lambda: _launch_all_gather(tensor, group, dim))


def reduce_scatter_in_turn(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` and keep this rank's slice of ``dim``, letting other sub-batches compute meanwhile.

    On gloo the slices travel by one all-to-all and are summed locally: gloo's reduce-scatter
    took 2–5× as long as that for the same bytes, and its work has no completion future to trace.
    Inside a recomputed checkpoint region the recorded result is returned instead.
    """
    ranks = dist.get_world_size(group)
    if ranks == 1:
        return tensor
    if tensor.is_meta:
        _check_splits(tensor, ranks, dim)
        return tensor.chunk(ranks, dim=dim)[0].clone()
    return _communicate_once(lambda: _launch_reduce_scatter(tensor, group, dim).wait())


def _check_splits(tensor: torch.Tensor, ranks: int, dim: int) -> None:
    if tensor.shape[dim] % ranks:
        raise ValueError(f"dimension {dim} of a {tuple(tensor.shape)} tensor does not split over {ranks} ranks")


def _launch_reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> "PendingCollective":
    ranks = dist.get_world_size(group)
    _check_splits(tensor, ranks, dim)
    pieces = torch.cat(tensor.chunk(ranks, dim=dim))
    launch = time.perf_counter()
    if dist.get_backend(group) == "gloo":
        received = torch.empty_like(pieces)
        work = dist.all_to_all_single(received, pieces, group=group, async_op=True)
        return PendingCollective(received, work, launch, "reduce_scatter",
                                 finish=lambda slices: slices.unflatten(0, (ranks, -1)).sum(0))
    result = pieces.new_empty((pieces.shape[0] // ranks, *pieces.shape[1:]))
    work = dist.reduce_scatter_single(result, pieces, group=group, async_op=True)
    return PendingCollective(result, work, launch, "reduce_scatter")


def start_reduce_scatter_in_turn(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> "PendingCollective":
    """Launch :func:`reduce_scatter_in_turn`; the caller computes until it waits for this rank's slice.

    Done at once where :func:`_start_in_turn` says so.
    """
    return _start_in_turn(tensor, group, lambda: reduce_scatter_in_turn(tensor, group, dim),
                          lambda: _launch_reduce_scatter(tensor, group, dim))


class PendingCollective:
    """An asynchronous collective launched in turn; :meth:`wait` hands the turn on first.

    The turn is handed on whether or not the collective has already completed, so the
    turn order (and with it the order of every later collective) is the same on every rank.
    ``exposed_s`` is the time this rank then stayed blocked on it.
    """

    def __init__(self, result: torch.Tensor, work: Any, launch: Optional[float] = None,
                 op: str = "collective", finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """``launch`` is the ``time.perf_counter()`` taken just before the collective was issued (default: now);
        ``finish`` turns the completed buffer into the result (a local sum, say)."""
        self.result, self._work, self._op, self._finish = result, work, op, finish
        self.exposed_s = 0.0
        self._launch = time.perf_counter() if launch is None else launch
        self._completion: dict[str, float] = {}
        self._trace = _trace
        if work is not None and self._trace is not None:
            work.get_future().then(lambda _: self._completion.setdefault("complete", time.perf_counter()))

    def wait(self) -> torch.Tensor:
        if self._work is None:
            return self.result
        work, self._work = self._work, None
        _yield_if_in_sub_batch()
        wait_start = time.perf_counter()
        work.wait()
        wait_end = time.perf_counter()
        self.exposed_s = wait_end - wait_start
        if self._trace is not None:
            self._trace.add({"op": self._op, "sub_batch": getattr(_local, "index", 0), "launch": self._launch,
                             "wait_start": wait_start, "wait_end": wait_end,
                             "complete": self._completion.get("complete", wait_end)})
        if self._finish is not None:
            self.result = self._finish(self.result)
        return self.result


def start_all_to_all_in_turn(
    send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: Optional[dist.ProcessGroup]
) -> PendingCollective:
    """Launch ``all_to_all_single`` of the rows of ``send`` (split sizes per rank) without waiting.

    Inside a sub-batch region the other sub-batches compute until the caller waits; with a
    single rank nothing is exchanged.
    """
    if dist.get_world_size(group) == 1:
        return PendingCollective(send, None)
    recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
    launch = time.perf_counter()
    work = dist.all_to_all_single(recv, send.contiguous(), list(recv_splits), list(send_splits), group=group,
                                  async_op=True)
    return PendingCollective(recv, work, launch, "all_to_all")


def all_to_all_in_turn(
    send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """``all_to_all_single`` with split sizes, letting other sub-batches compute meanwhile."""
    return start_all_to_all_in_turn(send, send_splits, recv_splits, group).wait()


def in_checkpointed_region() -> bool:
    """Whether the calling code runs inside a checkpointed region whose collectives are recorded
    for its recomputation (:func:`collective_replay_contexts`), or is that recomputation."""
    return bool(_replay_stack())


def in_sub_batch_region() -> bool:
    """Whether the calling code runs as one sub-batch of a region (:func:`run_sub_batches`)."""
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


_SHARE_FLAG = "_merak_sub_batch_share"


def mark_sub_batch_share(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as this sub-batch's additive share of a value of the whole batch.

    A region returns the sum of its sub-batches' marked outputs (not the first of equal
    ones), and the gradient of that sum reaches every share.
    """
    setattr(tensor, _SHARE_FLAG, True)
    return tensor



# The sub-batch region ------------------------------------------------------------------------


def _split(value: Any, batch: int, parts: int) -> list[Any]:
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == batch:
        return list(value.chunk(parts))
    return [value] * parts


def _merge(outputs: list[Any], sub_batch: int) -> tuple[Any, str]:
    """One output from the sub-batches' outputs, and how: "cat", "sum" (of shares) or "same"."""
    first = outputs[0]
    if not isinstance(first, torch.Tensor):
        return first, "same"
    if len(outputs) > 1 and all(getattr(output, _SHARE_FLAG, False) for output in outputs):
        total = outputs[0]
        for share in outputs[1:]:
            total = total + share
        return total, "sum"
    if first.ndim > 0 and first.shape[0] == sub_batch and len(outputs) > 1:
        return torch.cat(outputs), "cat"
    if not first.is_meta and any(not torch.equal(first, other) for other in outputs[1:]):
        raise ValueError(
            f"an output of shape {tuple(first.shape)} differs between sub-batches but its first dimension is "
            f"not the batch; tp_overlap needs batch-first outputs (or set tp_overlap=1)"
        )
    return first, "same"


class _SubBatchRegion(torch.autograd.Function):
    """Forward of ``k`` sub-batches with separate graphs; backward runs them in turns too."""

    @staticmethod
    def forward(ctx: Any, call: dict[str, Any], *inputs_and_parameters: torch.Tensor) -> Any:
        parts, batch = call["parts"], call["batch"]
        inputs = inputs_and_parameters[: call["input_count"]]
        ctx.parameters = inputs_and_parameters[call["input_count"]:]
        leaves = [[None] * len(inputs) for _ in range(parts)]
        split_inputs = []
        for position, tensor in enumerate(inputs):
            pieces = _split(tensor, batch, parts)
            split_inputs.append(pieces[0] is not tensor)
            for index, piece in enumerate(pieces):
                leaf = piece.detach()
                if tensor.requires_grad:
                    leaf.requires_grad_(True)
                leaves[index][position] = leaf

        def task(index: int) -> Callable[[], list[Any]]:
            return lambda: tree_flatten(call["run"](leaves[index]))

        results = _run_in_turns([task(i) for i in range(parts)], _caller_state(grad=True))
        flat_outputs = [flat for flat, _ in results]
        call["spec"] = results[0][1]
        merged, merges = [], []
        for position in range(len(flat_outputs[0])):
            value, how = _merge([flat[position] for flat in flat_outputs], batch // parts)
            merged.append(value.detach() if isinstance(value, torch.Tensor) else value)
            merges.append(how)
        ctx.parts, ctx.leaves, ctx.split_inputs = parts, leaves, split_inputs
        ctx.sub_outputs, ctx.merges = flat_outputs, merges
        ctx.set_materialize_grads(False)
        call["non_tensor"] = {i: v for i, v in enumerate(merged) if not isinstance(v, torch.Tensor)}
        return tuple(v for v in merged if isinstance(v, torch.Tensor))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Any:
        tensor_positions = [i for i, v in enumerate(ctx.sub_outputs[0]) if isinstance(v, torch.Tensor)]
        per_part: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(ctx.parts)]
        for grad, position in zip(grads, tensor_positions):
            if grad is None:
                continue
            how = ctx.merges[position]
            pieces = (grad.chunk(ctx.parts) if how == "cat" else [grad] * ctx.parts if how == "sum"
                      else [grad] + [None] * (ctx.parts - 1))
            for index, piece in enumerate(pieces):
                output = ctx.sub_outputs[index][position]
                if piece is not None and output.requires_grad:
                    per_part[index][0].append(output)
                    per_part[index][1].append(piece)

        parameters = [p for p in ctx.parameters if p.requires_grad]

        def wanted(index: int) -> list[torch.Tensor]:
            return [leaf for leaf in ctx.leaves[index] if leaf.requires_grad] + parameters

        def gradients(outputs: list[torch.Tensor], output_grads: list[torch.Tensor],
                      inputs: list[torch.Tensor]) -> Sequence[Optional[torch.Tensor]]:
            if not outputs:
                return [None] * len(inputs)
            return torch.autograd.grad(outputs, inputs, output_grads, allow_unused=True)

        def task(index: int) -> Callable[[], Sequence[Optional[torch.Tensor]]]:
            return lambda: gradients(*per_part[index], wanted(index))

        if any(output.is_cuda for outputs, _ in per_part for output in outputs):
            # CUDA nodes run on the autograd device thread, which must not block on other threads:
            # one reentrant backward over all sub-batches lets the engine interleave them instead.
            everything = [t for index in range(ctx.parts) for t in wanted(index)]
            flat = gradients([o for part, _ in per_part for o in part], [g for _, part in per_part for g in part],
                             everything)
            sizes = [len(wanted(index)) for index in range(ctx.parts)]
            results = [flat[sum(sizes[:i]): sum(sizes[: i + 1])] for i in range(ctx.parts)]
        else:
            results = _run_in_turns([task(i) for i in range(ctx.parts)], _caller_state(grad=False))
        leaf_grads: list[dict[int, torch.Tensor]] = []
        parameter_grads: list[Optional[torch.Tensor]] = [None] * len(parameters)
        for index, grads_of_part in enumerate(results):
            leaves = [leaf for leaf in ctx.leaves[index] if leaf.requires_grad]
            leaf_grads.append({id(leaf): grad for leaf, grad in zip(leaves, grads_of_part) if grad is not None})
            for position, grad in enumerate(grads_of_part[len(leaves):]):
                if grad is not None:
                    total = parameter_grads[position]
                    parameter_grads[position] = grad if total is None else total + grad
        input_grads: list[Optional[torch.Tensor]] = []
        for position, split in enumerate(ctx.split_inputs):
            pieces = [grads.get(id(leaves[position])) for grads, leaves in zip(leaf_grads, ctx.leaves)]
            if all(piece is None for piece in pieces):
                input_grads.append(None)
            elif split:
                input_grads.append(torch.cat([
                    piece if piece is not None else torch.zeros_like(leaves[position])
                    for piece, leaves in zip(pieces, ctx.leaves)
                ]))
            else:
                input_grads.append(sum(piece for piece in pieces if piece is not None))
        by_parameter = dict(zip(map(id, parameters), parameter_grads))
        ctx.sub_outputs = ctx.leaves = None
        return (None, *input_grads, *(by_parameter.get(id(p)) for p in ctx.parameters))


def run_sub_batches(
    forward: Callable[..., Any],
    parts: int,
    args: tuple = (),
    kwargs: Optional[dict[str, Any]] = None,
    parameters: Sequence[torch.Tensor] = (),
) -> Any:
    """``forward(*args, **kwargs)`` computed as ``parts`` overlapped sub-batches.

    Tensors whose first dimension is the batch (that of the first tensor argument) are
    split; outputs whose first dimension is the sub-batch are concatenated back.
    ``parameters`` are those ``forward`` uses: their gradients flow through the region.
    """
    leaves, spec = tree_flatten((args, kwargs or {}))
    tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if parts == 1 or not tensor_positions:
        return forward(*args, **(kwargs or {}))
    batch = leaves[tensor_positions[0]].shape[0]
    if batch % parts:
        raise ValueError(
            f"a micro-batch of {batch} samples cannot be split into tp_overlap={parts} sub-batches; "
            f"choose a tp_overlap that divides the micro-batch size"
        )

    def run(tensors: list[torch.Tensor]) -> Any:
        values = list(leaves)
        for position, tensor in zip(tensor_positions, tensors):
            values[position] = tensor
        call_args, call_kwargs = tree_unflatten(values, spec)
        return forward(*call_args, **call_kwargs)

    inputs = [leaves[i] for i in tensor_positions]
    if not torch.is_grad_enabled():
        pieces = [_split(tensor, batch, parts) for tensor in inputs]
        results = _run_in_turns(
            [lambda index=index: tree_flatten(run([p[index] for p in pieces])) for index in range(parts)],
            _caller_state(grad=False),
        )
        flat = [_merge([r[0][position] for r in results], batch // parts)[0] for position in range(len(results[0][0]))]
        return tree_unflatten(flat, results[0][1])
    call: dict[str, Any] = {"parts": parts, "batch": batch, "run": run, "input_count": len(inputs)}
    tensors = iter(_SubBatchRegion.apply(call, *inputs, *parameters))
    non_tensor = call["non_tensor"]
    count = call["spec"].num_leaves
    flat = [non_tensor[i] if i in non_tensor else next(tensors) for i in range(count)]
    return tree_unflatten(flat, call["spec"])


class SubBatchForward:
    """A module's ``forward`` run as overlapped sub-batches;
    install with ``module.forward = SubBatchForward(module, k)``.
    """

    def __init__(self, module: torch.nn.Module, parts: int) -> None:
        self.module, self.parts, self.forward = module, parts, module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        parameters = [p for p in self.module.parameters() if p.requires_grad]
        return run_sub_batches(self.forward, self.parts, args, kwargs, parameters)
