"""Running pieces of a model forward and backward for the planner's measurements: the sample inputs a block
is timed on, the timed forward-and-backward calls, and what the autograd graph saves for backward, counted
as the memory it holds (by storage) rather than by tensor."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from lightning_merak.parallel.pipeline.trace import ModelTrace
from lightning_merak.util.model_outputs import logits_of
from lightning_merak.util.timing import DeviceStamp

__all__ = ["BlockRun", "SavedBytes", "forward_backward_times", "loss_profile", "sample_hidden", "side_tensors_for"]


def side_tensors_for(trace: ModelTrace, samples: int) -> tuple[torch.Tensor, ...]:
    """The trace's side arguments of the blocks, cut to ``samples`` samples where they are per sample."""
    batch = trace.sample_hidden.shape[0]
    return tuple(t[:samples] if t.ndim and t.shape[0] == batch and samples <= batch else t
                 for t in trace.sample_side_tensors)


def sample_hidden(trace: ModelTrace, samples: int) -> torch.Tensor:
    """``samples`` samples of the trace's hidden state (repeated where the trace holds fewer)."""
    hidden = trace.sample_hidden
    batch = hidden.shape[0]
    source = hidden if samples <= batch else hidden.repeat(-(-samples // batch), *[1] * (hidden.ndim - 1))
    return source[:samples].detach()


class BlockRun(nn.Module):
    """``blocks`` applied in turn to the hidden state, with the side arguments the trunk passes every block."""

    def __init__(self, blocks: list[nn.Module], trace: ModelTrace) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.trace = trace

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        for block in self.blocks:
            hidden = self.trace.hidden_of(block(hidden, *args, **kwargs))
        return hidden


def forward_backward_times(run: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict,
                           repeats: int) -> tuple[float, float]:
    """Mean forward and backward seconds of ``run`` after one warm-up; every rank runs the same calls."""
    stamps = []
    for attempt in range(repeats + 1):
        inputs = hidden.detach().requires_grad_(True)
        run.zero_grad(set_to_none=True)  # as every training step: backward allocates fresh gradients
        start = DeviceStamp(hidden.device)
        output = run(inputs, *args, **kwargs)
        middle = DeviceStamp(hidden.device)
        output.backward(torch.ones_like(output))
        end = DeviceStamp(hidden.device)
        if attempt:
            stamps.append((start, middle, end))
    return (statistics.fmean(middle.seconds_since(start) for start, middle, _ in stamps),
            statistics.fmean(end.seconds_since(middle) for _, middle, end in stamps))


def _storages(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """``(key, bytes)`` of each storage ``tensor`` keeps alive: its own, or a wrapper subclass's inner tensors'."""
    if hasattr(tensor, "__tensor_flatten__"):  # DTensor, fp8 tensors: the memory is their inner tensors'
        names, _ = tensor.__tensor_flatten__()
        return [storage for name in names for storage in _storages(getattr(tensor, name))]
    storage = tensor.untyped_storage()
    return [(storage.data_ptr(), storage.nbytes())]


_VIEW_NODES = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
                         "ReshapeAliasBackward0", "ExpandBackward0", "AsStridedBackward0"})
"""Autograd nodes of views: a saved view of a parameter's copy is the copy."""


class SavedBytes:
    """What the autograd graph saves for backward inside ``with`` (again at each entry), in the memory it holds.

    Each storage counts once and whole: saved views of one tensor (per-expert slices of a fused weight, a
    reshaped activation) share their storage, and a view keeps all of it alive. Storages of ``parameters``
    are the model's, not activations, and are left out; so are their views, which have other data pointers,
    and their 16-bit copies under autocast (one per weight and step, whatever the batch: the planner prices them
    apart, as ``compute_copy_bytes_per_parameter_byte``).
    """

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        parameters = list(parameters)
        self._parameters = {key for parameter in parameters for key, _ in _storages(parameter)}
        self._trainable_ids = {id(parameter) for parameter in parameters if parameter.requires_grad}
        self._frozen_shapes = {(tuple(sorted(parameter.shape)), parameter.dtype) for parameter in parameters
                               if not parameter.requires_grad}  # sorted: a transposed copy too
        self.by_storage: dict[int, int] = {}
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def _copy_of_parameter(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a cast of a parameter (autocast's copy of a weight): of a trainable one by its
        autograd node, of a frozen one (no node) by a frozen weight's shape in another dtype."""
        node = tensor.grad_fn
        while node is not None and type(node).__name__ in _VIEW_NODES:  # a transposed or reshaped copy
            sources = [source for source, _ in node.next_functions if source is not None]
            node = sources[0] if len(sources) == 1 else None
        if tensor.grad_fn is not None:
            return node is not None and type(node).__name__ == "ToCopyBackward0" and any(
                id(getattr(source, "variable", None)) in self._trainable_ids
                for source, _ in node.next_functions if source is not None)
        return not tensor.requires_grad and any(
            shape == tuple(sorted(tensor.shape)) and dtype != tensor.dtype for shape, dtype in self._frozen_shapes)

    def add(self, tensor: torch.Tensor) -> list[int]:
        """Count ``tensor``'s storages not counted yet; returns their keys."""
        if self._copy_of_parameter(tensor):
            return []
        new = [(key, nbytes) for key, nbytes in _storages(tensor)
               if key not in self._parameters and key not in self.by_storage]
        self.by_storage.update(new)
        return [key for key, _ in new]

    @property
    def total(self) -> int:
        return sum(self.by_storage.values())

    def __enter__(self) -> SavedBytes:
        self.by_storage.clear()

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.add(tensor)
            return tensor

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._hooks.__exit__(*exc_info)


class _Loss(nn.Module):
    """The training loss of the first ``samples`` samples' logits, as a module :func:`forward_backward_times` runs."""

    def __init__(self, loss_of: Callable[[Any, int], torch.Tensor], samples: int) -> None:
        super().__init__()
        self.loss_of, self.samples = loss_of, samples

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return self.loss_of(logits, self.samples)


def loss_profile(model: nn.Module, sample_inputs: torch.Tensor, call_model: Callable[[nn.Module, torch.Tensor], Any],
                 loss_of: Callable[[Any, int], torch.Tensor], sample_counts: Iterable[int], repeats: int,
                 logits_shape: Optional[tuple[int, ...]] = None) -> tuple[dict[int, tuple[float, float]], int]:
    """The training loss on the model's output: mean (forward, backward) seconds at each of ``sample_counts``
    samples, and the bytes it saves for backward per sample (:class:`SavedBytes`; for a language model the
    log-probabilities of the whole vocabulary at every position, upcast to fp32 by the usual loss: far more than
    a block saves). A model on the meta device is scored on random logits of ``logits_shape``."""
    counts = sorted(set(sample_counts))
    if not counts:
        return {}, 0
    if logits_shape is not None:
        logits = torch.randn((counts[-1], *logits_shape[1:]), device=sample_inputs.device)
    else:
        with torch.no_grad():
            logits = logits_of(call_model(model, sample_inputs[:counts[-1]]))
    times = {samples: forward_backward_times(_Loss(loss_of, samples), logits[:samples], (), {}, repeats)
             for samples in counts}
    scored = logits[:counts[-1]]
    with SavedBytes(()) as saved:
        _Loss(loss_of, counts[-1])(scored.detach().requires_grad_(True))
    return times, saved.total // scored.shape[0]
