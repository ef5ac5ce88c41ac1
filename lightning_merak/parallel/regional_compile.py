"""Regional compilation: each transformer block's forward compiled on its own with ``torch.compile``.

Compiling block by block (torchtitan's regional compile) rather than the whole model keeps what lies between
blocks eager — pipeline stage boundaries, FSDP2's and ZeRO's gather hooks, sub-batch overlap, recomputation — and
compiles one graph for every block of a class: torch inlines a block's parameters as graph inputs
(``torch._dynamo.config.inline_inbuilt_nn_modules``), so the second and later blocks reuse the first one's code.

Each block is compiled whole (``fullgraph=True``): a graph break would otherwise run part of the block eagerly on
every step and hide the cost. A block dynamo cannot capture whole has its children with parameters compiled one by
one instead and its own code run eagerly, with one notice naming it and the reason (nothing of the block ran before
the refusal, so the step goes on with the same result).

In a process with no CUDA device, inductor's compile workers are capped at the process's own threads
(:func:`share_compile_workers`): by default it starts as many as the machine has cores, which then import torch and
compile beside the ranks' training threads. Measured on 2 cores (two Llama blocks, hidden 128, forward and
backward, one thread): with the default pool a compiled step ran 52-54 ms for several steps after warm-up where it
settles at 36 ms; capped, every step after warm-up took 35-41 ms. ``TORCHINDUCTOR_COMPILE_THREADS`` set by the user
is left as it is.
:func:`compile_counts` reads torch's counters of graphs, graph breaks and recompilations, for the benchmark and the
run's log.
"""

from __future__ import annotations

import logging
import os
import re
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["CompileCounts", "CompiledForward", "compile_blocks", "compile_counts", "compiled_forward_of",
           "profiled_block", "share_compile_workers"]

log = logging.getLogger(__name__)


class CompiledForward:
    """A module's forward run through ``torch.compile(fullgraph=True)``; on the first call dynamo refuses, its
    children with parameters are compiled one by one instead (``parts=True``) and the module's own code runs eagerly.

    A strategy installs it on the block instance (``block.forward = CompiledForward(block, "model.layers.0")``),
    below recomputation and above nothing else, so hooks on the block stay outside the graph. A MoE block is the
    usual case for parts: its token dispatch has data-dependent shapes (or asynchronous collectives), while its
    attention and norms compile.
    """

    def __init__(self, module: nn.Module, name: str, *, backend: str = "inductor", parts: bool = True,
                 notify: Optional[Callable[[str], None]] = None) -> None:
        self.forward: Callable[..., Any] = module.forward
        self.name = name
        self.eager_reason: Optional[str] = None
        """Why this module's own code runs eagerly, once dynamo refused it (None while it runs compiled)."""
        self.parts: list[CompiledForward] = []
        """Its children's compiled forwards, once it fell back to compiling them one by one."""
        self._module = weakref.ref(module)
        self._backend, self._split_into_parts = backend, parts
        share_compile_workers()
        self._compiled = torch.compile(self.forward, fullgraph=True, backend=backend)
        self._notify = notify if notify is not None else _notify_once

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.eager_reason is None:
            try:
                return self._compiled(*args, **kwargs)
            except _unsupported_errors() as error:
                # fullgraph: the whole module is traced before any of it runs, so nothing was done twice
                self._fall_back(_first_line(error))
        return self.forward(*args, **kwargs)

    def _fall_back(self, reason: str) -> None:
        self.eager_reason = reason
        module = self._module()
        children = ([(name, child) for name, child in module.named_children() if _has_parameters(child)]
                    if module is not None and self._split_into_parts else [])
        self.parts = [_install(child, f"{self.name}.{name}", self._backend, False, self._notify)
                      for name, child in children]
        how = (f"its parts ({', '.join(name for name, _ in children)}) are compiled one by one" if children
               else "it runs eagerly")
        self._notify(f"compile: {self.name} is not captured whole by torch.compile ({reason}); {how}")


def _install(module: nn.Module, name: str, backend: str, parts: bool,
             notify: Optional[Callable[[str], None]]) -> CompiledForward:
    existing = compiled_forward_of(module)
    if existing is not None:
        return existing
    compiled = CompiledForward(module, name, backend=backend, parts=parts, notify=notify)
    module.forward = compiled
    return compiled


def share_compile_workers() -> None:
    """Without a CUDA device, cap inductor's compile workers at this process's threads (its share of the CPU the
    ranks train on), unless ``TORCHINDUCTOR_COMPILE_THREADS`` names a count; before the first compile starts them."""
    if os.environ.get("TORCHINDUCTOR_COMPILE_THREADS") or torch.cuda.is_available():
        return
    from torch._inductor import config  # lazy: inductor, only where a block is compiled

    config.compile_threads = max(1, min(config.compile_threads, torch.get_num_threads()))


def compiled_forward_of(module: nn.Module) -> Optional[CompiledForward]:
    """The module's :class:`CompiledForward`, whether installed directly or under a wrapper that keeps the forward
    it wraps as ``.forward`` (recomputation), else None."""
    forward: Any = module.__dict__.get("forward")
    while forward is not None and not isinstance(forward, nn.Module):
        if isinstance(forward, CompiledForward):
            return forward
        forward = getattr(forward, "forward", None)
    return None


def compile_blocks(blocks: Iterable[tuple[str, nn.Module]], *, backend: str = "inductor",
                   notify: Optional[Callable[[str], None]] = None) -> list[CompiledForward]:
    """Compile each ``(name, block)``'s forward in place (blocks already compiled are left as they are).

    Call it after the block is split and before it is wrapped for recomputation: the recomputed forward then runs
    the compiled one twice, and the collectives a split block calls are traced into its graph. ``notify`` gets
    each fallback's notice (default: a warning on this module's logger, once per distinct notice with the block
    indices left out, so a 32-block model gives one line).
    """
    _check_compiler()
    return [_install(block, name, backend, True, notify) for name, block in blocks]


def profiled_block(block: nn.Module, name: str, compiled: bool) -> Callable[..., Any]:
    """What a profiler calls to time ``block`` as training will run it: the block itself, or with ``compiled`` its
    forward compiled whole (eager where dynamo refuses; nothing is installed on the block, and the run's own
    compilation gives the notice)."""
    if not compiled:
        return block
    return CompiledForward(block, name, parts=False, notify=lambda message: None)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


_notified: set[tuple[str, str]] = set()


def _notify_once(message: str) -> None:
    """Warn once per notice, counting notices that differ only in block indices (``layers.3`` / ``layers.7``) as one."""
    key = (re.sub(r"\.\d+\b", ".*", message.split(" (", 1)[0]), message.split(" (", 1)[-1])
    if key not in _notified:
        _notified.add(key)
        log.warning(message + " (further blocks alike are not named)")


@dataclass(frozen=True)
class CompileCounts:
    """torch's compile counters so far in this process (dynamo's ``counters``)."""

    graphs: int
    """Distinct graphs captured (one per block class and input shape, after the first call of each)."""
    graph_breaks: int
    """Places dynamo split a graph; 0 under ``fullgraph`` unless a block fell back to eager."""
    recompiles: int
    """Frames compiled again after a guard failed (a new shape, dtype or grad mode)."""

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(self.graphs - other.graphs, self.graph_breaks - other.graph_breaks,
                             self.recompiles - other.recompiles)


def compile_counts() -> CompileCounts:
    """The counters now; all zero on a torch that keeps none where they are looked for."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # private; read where it exists
        return CompileCounts(0, 0, 0)
    stats = counters.get("stats", {})
    recompiles = sum(counters.get("recompiles", {}).values())
    return CompileCounts(int(stats.get("unique_graphs", 0)), int(sum(counters.get("graph_break", {}).values())),
                         int(recompiles))


def _unsupported_errors() -> tuple[type[BaseException], ...]:
    from torch._dynamo import exc

    return tuple(getattr(exc, name) for name in ("Unsupported", "UserError") if hasattr(exc, name))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _check_compiler() -> None:
    """Refuse, before any work, where torch.compile cannot run (an interpreter dynamo does not support)."""
    if not hasattr(torch, "compile"):
        raise ValueError("compile=True needs torch.compile (torch >= 2.0); set compile=False")
    problem = _dynamo_unsupported()
    if problem:
        raise ValueError(f"compile=True: torch.compile cannot run here ({problem}); set compile=False")


def _dynamo_unsupported() -> Optional[str]:
    try:
        import torch._dynamo.eval_frame as eval_frame
    except ImportError as error:
        return str(error)
    check = getattr(eval_frame, "check_if_dynamo_supported", None)
    if check is None:
        return None
    try:
        check()
    except RuntimeError as error:
        return str(error)
    return None
