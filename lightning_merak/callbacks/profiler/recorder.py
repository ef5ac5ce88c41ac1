"""Recording a rank's work and communication while a :class:`TraceRecorder` is active (thin integration).

torch 2.13 gives gloo no completion hook (``_register_on_completion_hook`` is NCCL-only) and its
``torch.profiler`` ranges end when the op is enqueued, not when it completes, so ops are recorded
at the call: while recording, the collective and point-to-point functions of ``torch.distributed``
(the names every caller, torch's pipelining included, looks up at call time) are replaced by
wrappers that note the op, its bytes, group and launch time, its completion (the work's future)
and when the caller waited for it; so are torch's functional collectives' Python entry points (DTensor's), whose
wait is the first ``wait_tensor`` on their result. DDP's gradient buckets, which its C++ reducer reduces without
passing through Python, are recorded by a communication hook (:func:`traced_allreduce_hook`).
Pipeline stages' forward and backward chunks and the model's blocks become spans. Outside the
recording window nothing is wrapped: no overhead when the profiler is off.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

try:
    from torch.distributed import _functional_collectives as functional
except ImportError:  # a torch without functional collectives: only torch.distributed's functions are recorded
    functional = None

from lightning_merak.distributed.turns import in_sub_batch_region, sub_batch_index, watch_turn_waits
from lightning_merak.parallel.pipeline.busy import CHUNK_METHODS
from lightning_merak.planning.replay.trace import COLLECTIVE_OPS, P2P_OPS, CommRecord, RankTrace, Span, assign_depths

__all__ = ["TraceRecorder", "active_recorder", "traced_allreduce_hook"]

_FUNCTIONAL_COLLECTIVES = ("all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single",
                           "all_to_all_single")
"""torch's functional collectives (``torch.ops._c10d_functional``: DTensor's redistributions, e.g. Muon's
Newton-Schulz at tp>1), by their Python entry points, which the others (``all_gather_tensor``, the ``_autograd``
variants) call; recorded under ``torch.distributed``'s names, whose bytes they count alike."""
_INPUT_ARGUMENT = {"all_gather_into_tensor": "input_tensor", "all_gather_single": "input_tensor",
                   "reduce_scatter_tensor": "input", "reduce_scatter_single": "input", "all_to_all_single": "input",
                   "all_gather": "tensor"}

_active: Optional["TraceRecorder"] = None


def active_recorder() -> Optional["TraceRecorder"]:
    """The recorder currently recording on this rank, if any."""
    return _active


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _argument_binder(original: Callable) -> Callable[[tuple, dict], dict[str, Any]]:
    """Name a call's arguments as ``original``'s signature does, its defaults included."""
    parameters = inspect.signature(original).parameters
    names = list(parameters)
    defaults = {n: p.default for n, p in parameters.items() if p.default is not inspect.Parameter.empty}
    return lambda args, kwargs: {**defaults, **dict(zip(names, args)), **kwargs}


def _waited_at_once(record: CommRecord, launch: float) -> None:
    """Mark ``record`` as an op its call waited for: launched at ``launch``, complete now."""
    now = time.perf_counter()
    record.blocking, record.wait_start, record.wait_end, record.complete = True, launch, now, now


class _TracedWork:
    """A backend work that notes when its caller waits for it; everything else goes to the work."""

    def __init__(self, work: Any, record: CommRecord) -> None:
        self._work, self._record = work, record

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = self._work.wait(*args, **kwargs)
        if self._record.wait_start is None:
            self._record.wait_start, self._record.wait_end = start, time.perf_counter()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class TraceRecorder:
    """One rank's spans and communication ops over the steps it is told about (:meth:`begin_step`)."""

    def __init__(self, rank: int, block_spans: bool = True) -> None:
        self.trace = RankTrace(rank)
        self.step = -1
        self._block_spans = block_spans
        self._lock = threading.Lock()
        self._seq: dict[tuple, int] = defaultdict(int)
        self._group_ranks: dict[int, tuple[int, ...]] = {}
        self._inside = threading.local()
        self._restore: list[Callable[[], None]] = []
        self._handles: list[Any] = []
        self._root_found = False
        self._open_backward: dict[int, Span] = {}
        self._open_blocks: dict[tuple[int, int], Span] = {}
        self._functional_waits: WeakIdKeyDictionary = WeakIdKeyDictionary()

    # Spans ---------------------------------------------------------------------------------------

    def open_span(self, name: str, category: str) -> Span:
        """A span starting now; it is recorded once closed (nesting depths are set by :meth:`finish`)."""
        thread = f"sub-batch {sub_batch_index()}" if in_sub_batch_region() else "main"
        return Span(name, category, time.perf_counter(), float("nan"), self.step, thread=thread)

    def close_span(self, span: Span) -> None:
        span.end = time.perf_counter()
        with self._lock:
            self.trace.spans.append(span)

    def finish(self) -> RankTrace:
        """Stop recording; the record with every span's depth set from how the spans nest."""
        self.uninstall()
        assign_depths(self.trace.spans)
        return self.trace

    @contextlib.contextmanager
    def span(self, name: str, category: str) -> Iterator[None]:
        opened = self.open_span(name, category)
        try:
            yield
        finally:
            self.close_span(opened)

    def begin_step(self, step: int) -> Span:
        self.step = step
        self._open_backward = {}
        return self.open_span(f"step {step}", "step")

    # Communication -------------------------------------------------------------------------------

    def _ranks_of(self, group: Optional[dist.ProcessGroup]) -> tuple[int, ...]:
        group = group if group is not None else c10d._get_default_group()
        key = id(group)
        if key not in self._group_ranks:
            self._group_ranks[key] = tuple(dist.get_process_group_ranks(group))
        return self._group_ranks[key]

    def note(self, op: str, kind: str, group: Optional[dist.ProcessGroup], nbytes: int, launch: float,
             peer: Optional[int] = None, tag: int = 0, stream: str = "main") -> CommRecord:
        """A new op record with its per-group (collective) or per-pair (point-to-point) sequence number."""
        ranks = self._ranks_of(group)
        me = self.trace.rank
        key = (ranks,) if kind == "collective" else (kind, me, peer, tag)
        with self._lock:
            seq = self._seq[key]
            self._seq[key] += 1
            record = CommRecord(op, kind, ranks, seq, nbytes, launch, self.step, peer=peer, tag=tag, stream=stream)
            self.trace.comms.append(record)
        return record

    def watch(self, record: CommRecord, work: Any) -> None:
        """Note ``work``'s completion time on ``record`` when the backend gives it a future."""
        try:
            future = work.get_future()
        except (RuntimeError, AttributeError):
            return
        future.then(lambda _: setattr(record, "complete", time.perf_counter()))

    def _records(self) -> bool:
        """Whether a call now is this recorder's to note (it is recording, and not inside a call it notes)."""
        return not getattr(self._inside, "depth", 0) and _active is self

    def _call_unnoted(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        """``original(*args, **kwargs)`` with the communication calls it makes itself left out of the trace."""
        self._inside.depth = 1
        try:
            return original(*args, **kwargs)
        finally:
            self._inside.depth = 0

    def _wrap(self, name: str, original: Callable) -> Callable:
        bind = _argument_binder(original)
        recorder = self

        def traced(*args: Any, **kwargs: Any) -> Any:
            if not recorder._records():
                return original(*args, **kwargs)
            arguments = bind(args, kwargs)
            group = arguments.get("group")
            kind, peer = "collective", None
            if name in P2P_OPS:
                kind = "send" if name in ("isend", "send") else "recv"
                group_peer = arguments.get("group_dst" if kind == "send" else "group_src")
                peer = arguments.get("dst" if kind == "send" else "src")
                if peer is None and group_peer is not None:
                    peer = dist.get_global_rank(group if group is not None else c10d._get_default_group(),
                                                group_peer)
            nbytes = _nbytes(arguments.get(_INPUT_ARGUMENT.get(name, "tensor")))
            launch = time.perf_counter()
            result = recorder._call_unnoted(original, *args, **kwargs)
            record = recorder.note(name, kind, group, nbytes, launch, peer, int(arguments.get("tag") or 0))
            asynchronous = name in ("isend", "irecv") or bool(arguments.get("async_op"))
            if asynchronous and result is not None:
                recorder.watch(record, result)
                return _TracedWork(result, record)
            _waited_at_once(record, launch)
            return result

        traced.__wrapped__ = original  # type: ignore[attr-defined]
        return traced

    def _wrap_functional(self, name: str, original: Callable) -> Callable:
        """A functional collective, noted at its call; its wait is the first ``wait_tensor`` on its result."""
        bind = _argument_binder(original)
        recorder = self

        def traced(*args: Any, **kwargs: Any) -> Any:
            if not recorder._records():
                return original(*args, **kwargs)
            arguments = bind(args, kwargs)
            launch = time.perf_counter()
            result = recorder._call_unnoted(original, *args, **kwargs)
            group = c10d._resolve_process_group(functional._resolve_group_name(arguments["group"],
                                                                                arguments.get("tag", "")))
            record = recorder.note(name, "collective", group, _nbytes(arguments["self"]), launch)
            if isinstance(result, functional.AsyncCollectiveTensor) and not result.completed:
                recorder._functional_waits[result.elem] = record
            else:  # waited for inside (tracing, or a gather along another dimension)
                _waited_at_once(record, launch)
            return result

        traced.__wrapped__ = original  # type: ignore[attr-defined]
        return traced

    def _wrap_functional_wait(self, original: Callable) -> Callable:
        recorder = self

        def traced_wait(tensor: torch.Tensor) -> torch.Tensor:
            record = recorder._functional_waits.pop(tensor, None) if _active is recorder else None
            start = time.perf_counter()
            result = original(tensor)
            if record is not None:
                record.wait_start, record.wait_end = start, time.perf_counter()
            return result

        traced_wait.__wrapped__ = original  # type: ignore[attr-defined]
        return traced_wait

    def _install_functional(self) -> None:
        """Wrap the functional collectives' Python entry points and ``wait_tensor`` (where this torch has them)."""
        needed = _FUNCTIONAL_COLLECTIVES + ("wait_tensor", "AsyncCollectiveTensor", "_resolve_group_name")
        if functional is None or not all(hasattr(functional, n) for n in needed) \
                or not hasattr(c10d, "_resolve_process_group"):
            return
        wrapped = {name: self._wrap_functional(name, getattr(functional, name)) for name in _FUNCTIONAL_COLLECTIVES}
        wrapped["wait_tensor"] = self._wrap_functional_wait(functional.wait_tensor)
        for name, traced in wrapped.items():
            self._restore.append(lambda name=name, original=getattr(functional, name):
                                 setattr(functional, name, original))
            setattr(functional, name, traced)

    # Installing ----------------------------------------------------------------------------------

    def install(self) -> None:
        """Start recording: wrap the communication functions and the pipeline stages' chunks."""
        global _active
        if _active is not None:
            raise RuntimeError("another TraceRecorder is recording on this rank; stop it first")
        _active = self
        for name in COLLECTIVE_OPS + P2P_OPS:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            traced = self._wrap(name, original)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    setattr(module, name, traced)
                    self._restore.append(lambda module=module, name=name, original=original:
                                         setattr(module, name, original))
        self._install_functional()
        self._wrap_pipeline_stages()
        if self._block_spans:
            self._handles.append(nn.modules.module.register_module_forward_pre_hook(self._find_root))
            self._restore.append(watch_turn_waits(self._turn_waited))

    def uninstall(self) -> None:
        """Stop recording and put every wrapped function back."""
        global _active
        for restore in reversed(self._restore):
            restore()
        for handle in self._handles:
            handle.remove()
        self._restore, self._handles = [], []
        self._functional_waits = WeakIdKeyDictionary()
        if _active is self:
            _active = None

    def _turn_waited(self, sub_batch: int, start: float, end: float) -> None:
        """A sub-batch's wait for its turn, as a WAIT span on its thread: the blocks it sits in exclude it."""
        if _active is self:
            with self._lock:
                self.trace.spans.append(Span("turn", "WAIT", start, end, self.step, thread=f"sub-batch {sub_batch}"))

    def _wrap_pipeline_stages(self) -> None:
        try:
            from torch.distributed.pipelining.stage import _PipelineStageBase
        except ImportError:
            return
        classes, pending = [], [_PipelineStageBase]
        while pending:  # subclasses that override a chunk method (the project's early-receive stage) too
            cls = pending.pop()
            classes.append(cls)
            pending.extend(cls.__subclasses__())
        for cls in classes:
            for method in CHUNK_METHODS:
                category = "FW" if method.startswith("forward") else "BW"
                original = cls.__dict__.get(method)
                if original is None:
                    continue

                def chunk(stage: Any, chunk_id: int, *args: Any, _original: Callable = original,
                          _category: str = category, _method: str = method, **kwargs: Any) -> Any:
                    if getattr(self._inside, "chunk", False):  # an override calling its base: one span
                        return _original(stage, chunk_id, *args, **kwargs)
                    self._inside.chunk = True
                    try:
                        with self.span(f"stage {stage.stage_index} {_method.split('_')[0]} mb{chunk_id}", _category):
                            return _original(stage, chunk_id, *args, **kwargs)
                    finally:
                        self._inside.chunk = False

                setattr(cls, method, chunk)
                self._restore.append(lambda c=cls, m=method, o=original: setattr(c, m, o))

    def _find_root(self, module: nn.Module, args: Any) -> None:
        """On modules called while recording: hook DDP's buckets, and time the blocks of the first module
        that holds a list of them (its largest ``ModuleList``; a model runs before its blocks)."""
        if self._root_found:
            return
        if isinstance(module, nn.parallel.DistributedDataParallel):
            _hook_ddp(module)
        lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
        if not lists:
            return
        self._root_found = True
        blocks = max(lists, key=len)
        for index, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(
                lambda m, a, index=index: self._open_blocks.__setitem__((id(m), threading.get_ident()),
                                                                       self.open_span(f"block {index}", "FW"))))
            self._handles.append(block.register_forward_hook(self._close_block, always_call=True))

    def _close_block(self, module: nn.Module, args: Any, output: Any) -> None:
        # per thread: tp_overlap's sub-batches each run the block on a thread of their own, turn by turn
        span = self._open_blocks.pop((id(module), threading.get_ident()), None)
        if span is not None and _active is self:
            self.close_span(span)
            self._watch_block_backward(span.name, args, output)

    def _watch_block_backward(self, name: str, args: Any, output: Any) -> None:
        """Time this block call's backward: from its output's gradient (the backward reaches the block) to its
        input's, or to the next block's start (the block before it in the forward), whichever comes first.

        Calls whose input or output needs no gradient (a frozen embedding before the first block) and forwards
        without gradients are not timed. A recomputation's forward (activation checkpointing) falls inside the
        backward span it serves. ``tp_overlap``'s sub-batches run their backwards on their own threads, turn by
        turn: each thread's blocks are timed apart (their waits for the turn are WAIT spans of that thread).
        """
        if not torch.is_grad_enabled():
            return
        first_input = args[0] if args and isinstance(args[0], torch.Tensor) else None
        first_output = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)), None)
        if not (first_input is not None and first_input.requires_grad
                and first_output is not None and first_output.requires_grad):
            return
        opened: Optional[Span] = None

        def start(grad: torch.Tensor) -> None:
            nonlocal opened
            if _active is self:
                self._end_block_backward()
                opened = self._open_backward[threading.get_ident()] = self.open_span(name, "BW")

        def end(grad: torch.Tensor) -> None:
            if _active is self and opened is not None and self._open_backward.get(threading.get_ident()) is opened:
                self._end_block_backward()

        first_output.register_hook(start)
        first_input.register_hook(end)

    def _end_block_backward(self) -> None:
        """Close the calling thread's open block backward, if any."""
        span = self._open_backward.pop(threading.get_ident(), None)
        if span is not None:
            self.close_span(span)


def traced_allreduce_hook(process_group: Optional[dist.ProcessGroup], bucket: Any) -> torch.futures.Future:
    """DDP's default bucket all-reduce, recorded while a :class:`TraceRecorder` is active."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    recorder = _active
    launch = time.perf_counter()
    if recorder is None:
        return allreduce_hook(process_group, bucket)
    future = recorder._call_unnoted(allreduce_hook, process_group, bucket)
    buffer = bucket.buffer()
    record = recorder.note("ddp_all_reduce", "collective", process_group,
                           buffer.numel() * buffer.element_size(), launch, stream="ddp")

    def completed(result: torch.futures.Future) -> Any:
        record.complete = time.perf_counter()
        return result.value()

    return future.then(completed)


# DDP checks the hook's annotations as objects; postponed annotations would be strings.
traced_allreduce_hook.__annotations__.update(bucket=dist.GradBucket, process_group=Optional[dist.ProcessGroup],
                                             **{"return": torch.futures.Future[torch.Tensor]})


def _hook_ddp(model: nn.parallel.DistributedDataParallel) -> None:
    """Record ``model``'s bucket all-reduces, unless it already has a communication hook of its own."""
    try:
        model.register_comm_hook(model.process_group, traced_allreduce_hook)
    except (RuntimeError, ValueError):
        return
