"""Side CUDA streams for work that overlaps the compute stream, and the waits that keep it correct.

Why: a kernel or copy queued on a second stream runs beside the compute stream only if both are told
about each other. Three orderings make it safe (the caching allocator knows streams, not threads):

1. the side stream waits for the compute stream before its work, so it reads finished inputs;
2. every tensor the side stream reads or writes but the compute stream allocated is recorded on the
   side stream (``Tensor.record_stream``), so freeing it on the compute stream does not hand its memory
   to a new tensor while the side stream still uses it;
3. the consumer stream waits for the side stream's event before reading the results, and the results
   (allocated on the side stream) are recorded on the consumer stream.

:class:`SideStreamWork` does the three in that order; :func:`side_stream` hands out one cached stream per
device and purpose. On the CPU (and any device without streams) everything here is a no-op: the work runs
inline and the results are the same tensors.

Collectives are not run here: NCCL queues an asynchronous collective on its own internal stream, which
waits for the current stream at launch, and ``work.wait()`` makes the current stream wait for it; callers
keep the tensors they handed over referenced until then
(:class:`~lightning_merak.distributed.collectives.PendingCollective`).

The CUDA calls go through one :class:`StreamApi`; :func:`using_stream_api` swaps it (tests record the calls).
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any, Iterator, Optional, TypeVar

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["SideStreamWork", "StreamApi", "current_stream", "side_stream", "stream_scope", "using_stream_api"]

T = TypeVar("T")


class StreamApi:
    """The CUDA stream calls this module makes, in one place (torch's by default)."""

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def on_streams(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory is handed out per stream (a CUDA tensor's)."""
        return tensor.is_cuda


_api = StreamApi()
_streams: dict[tuple[str, Optional[int], str], Any] = {}


@contextlib.contextmanager
def using_stream_api(api: StreamApi) -> Iterator[StreamApi]:
    """Route this module's CUDA stream calls through ``api`` inside the block (its cached streams too)."""
    global _api
    previous, saved = _api, dict(_streams)
    _api = api
    _streams.clear()
    try:
        yield api
    finally:
        _api = previous
        _streams.clear()
        _streams.update(saved)


def _has_streams(device: torch.device) -> bool:
    return device.type == "cuda"


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def side_stream(device: torch.device, purpose: str) -> Optional[Any]:
    """The side stream of ``purpose`` on ``device`` (the same one at every call), or None without streams."""
    device = torch.device(device)
    if not _has_streams(device):
        return None
    device = _indexed(device)
    key = (device.type, device.index, purpose)
    if key not in _streams:
        _streams[key] = _api.new_stream(device)
    return _streams[key]


def current_stream(device: torch.device) -> Optional[Any]:
    """The calling thread's current stream on ``device``, or None without streams."""
    device = torch.device(device)
    return _api.current_stream(_indexed(device)) if _has_streams(device) else None


def stream_scope(stream: Optional[Any]) -> contextlib.AbstractContextManager:
    """Make ``stream`` current inside the block (nothing for None): carries a caller's stream into a thread,
    which otherwise starts on the device's default stream."""
    return contextlib.nullcontext() if stream is None else _api.use_stream(stream)


def _device_tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor) and _api.on_streams(leaf)]


class SideStreamWork:
    """``with SideStreamWork(device, purpose) as side: ...`` queues the block's kernels on the side stream.

    Entering makes the side stream wait for the current (compute) stream; :meth:`uses` records the tensors
    the block reads or writes that the compute stream allocated; leaving records an event on the side stream.
    :meth:`hand_over` (on the thread and stream that reads the results) makes that stream wait for the event
    and records the results on it. :meth:`done` polls the event.
    """

    def __init__(self, device: torch.device, purpose: str) -> None:
        self.device = torch.device(device)
        self.stream = side_stream(self.device, purpose)
        self._event: Optional[Any] = None
        self._scope: Optional[contextlib.AbstractContextManager] = None

    def __enter__(self) -> "SideStreamWork":
        if self.stream is not None:
            self.stream.wait_stream(current_stream(self.device))
            self._scope = _api.use_stream(self.stream)
            self._scope.__enter__()
        return self

    def uses(self, *tensors: Any) -> None:
        """Tensors the side stream touches that another stream allocated: not reused before it is done."""
        if self.stream is not None:
            for tensor in _device_tensors(tensors):
                _api.record_stream(tensor, self.stream)

    def __exit__(self, kind: Optional[type[BaseException]], error: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        if self._scope is None:
            return
        scope, self._scope = self._scope, None
        scope.__exit__(kind, error, traceback)
        self._event = _api.new_event()
        self._event.record(self.stream)

    def done(self) -> bool:
        """Whether the side stream has run the block (always on the CPU)."""
        return self._event is None or bool(self._event.query())

    def hand_over(self, result: T) -> T:
        """``result`` made safe to read on the calling thread's current stream: that stream waits for the
        block, and the result's tensors are recorded on it. Call once the block has left."""
        if self._event is not None:
            consumer = current_stream(self.device)
            consumer.wait_event(self._event)
            for tensor in _device_tensors(result):
                _api.record_stream(tensor, consumer)
        return result
