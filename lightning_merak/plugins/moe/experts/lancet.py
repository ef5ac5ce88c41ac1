"""Block-scope Lancet for ``merak_ep``: each decoder layer runs as overlapped sub-batches, at any top-k.

A decoder layer holding an expert-parallel experts module is split along the batch into ``chunks``
sub-batches that run the whole layer (attention, the family's own router, the experts) as round-robin
coroutines (:func:`~lightning_merak.distributed.sub_batches.run_sub_batches`). Inside such a region
``merak_ep``'s count all-gather and both all-to-alls are issued in turn, so while one sub-batch waits for
its exchange the others compute, in the forward and, through the all-to-alls' autograd Functions, in the
backward. Routing is per token, so the split changes no result: outputs and gradients equal the unsplit
layer's up to summation order.

``chunks="auto"`` tunes by measurement: after one untimed call, each candidate sub-batch count (1, 2, 4, 8
dividing the batch) runs :data:`TRIAL_ROUNDS` timed forward calls in turn; the candidate whose fastest call
is lowest wins. Times are the expert group's slowest rank's (one all-reduce at the end of the trials), so
every rank picks alike. The forward ranks candidates for the whole step: the backward runs the same
exchanges in reverse over the same sub-batches.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.distributed.process_groups import collective_device
from lightning_merak.distributed.sub_batches import run_sub_batches
from lightning_merak.plugins.moe.block_split import Chunks, batch_size, check_chunks, enclosing_block, split_batch
from lightning_merak.plugins.moe.experts.enable import experts_modules
from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE
from lightning_merak.util.timing import DeviceTimer

__all__ = ["CANDIDATE_CHUNKS", "TRIAL_ROUNDS", "ExpertParallelLancet", "expert_parallel_lancet"]

CANDIDATE_CHUNKS = (1, 2, 4, 8)
"""Sub-batch counts ``chunks="auto"`` tries (those dividing the micro-batch)."""
TRIAL_ROUNDS = 2
"""Timed calls per candidate before ``chunks="auto"`` decides."""


def choose_chunks(trial_seconds: dict[int, list[float]]) -> int:
    """The sub-batch count whose fastest trial call was fastest (fewer sub-batches on a tie)."""
    if not trial_seconds or any(not times for times in trial_seconds.values()):
        raise ValueError(f"every candidate needs at least one timed call, got {trial_seconds}")
    return min(sorted(trial_seconds), key=lambda chunks: min(trial_seconds[chunks]))


class ExpertParallelLancet:
    """A decoder layer's ``forward`` as overlapped sub-batches; install with :func:`expert_parallel_lancet`."""

    def __init__(self, block: nn.Module, experts: nn.Module, chunks: Chunks) -> None:
        check_chunks(chunks)
        self.block, self.experts, self.forward = block, experts, block.forward
        self.chunks: Optional[int] = None if chunks == "auto" else int(chunks)
        self.trials: dict[int, list[float]] = {}
        self._calls = 0

    def _shard(self) -> Any:
        """The experts' :class:`~.parallel.ExpertShard` once they are expert parallel over several ranks."""
        shard = getattr(self.experts, SHARD_ATTRIBUTE, None)
        return None if shard is None or shard.ep_size == 1 else shard

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        batch = split_batch(self.block, args, kwargs, self.chunks)
        if self.chunks is not None:
            return self._run(self.chunks, args, kwargs)
        shard = self._shard()
        if shard is None:  # one expert-parallel rank: nothing to overlap
            return self.forward(*args, **kwargs)
        return self._trial(batch, shard.group, args, kwargs)

    def _run(self, chunks: int, args: tuple, kwargs: dict[str, Any]) -> Any:
        parameters = [p for p in self.block.parameters() if p.requires_grad]
        collector = _output_collector()
        if not collector or chunks == 1:
            return run_sub_batches(self.forward, chunks, args, kwargs, parameters)
        keys = [key for key, value in collector.items() if key != "hidden_states" and isinstance(value, list)]
        output, captured, token_major = run_sub_batches(_capturing(self.forward, keys), chunks, args, kwargs,
                                                        parameters)
        for key in keys:
            for tensor, flattened in zip(captured[key], token_major[key]):
                collector[key].append(tensor.flatten(0, 1) if flattened else tensor)
        return output

    def _trial(self, batch: int, group: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """One call of the ``auto`` search: untimed first, then every candidate in turn, then the choice."""
        candidates = [c for c in CANDIDATE_CHUNKS if c <= batch and batch % c == 0]
        call, self._calls = self._calls, self._calls + 1
        if call == 0:
            return self.forward(*args, **kwargs)
        chunks = candidates[(call - 1) % len(candidates)]
        with DeviceTimer(next(self.block.parameters()).device) as trial:
            output = self._run(chunks, args, kwargs)
        self.trials.setdefault(chunks, []).append(trial.seconds)
        if call == TRIAL_ROUNDS * len(candidates):
            self._decide(candidates, group)
        return output

    def _decide(self, candidates: Sequence[int], group: Any) -> None:
        times = torch.tensor([self.trials[c] for c in candidates], dtype=torch.float64, device=collective_device(group))
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        self.trials = {c: row.tolist() for c, row in zip(candidates, times)}
        self.chunks = choose_chunks(self.trials)


def _output_collector() -> Optional[dict[str, Any]]:
    """The outputs transformers is recording for the running model call (router logits, attentions), if any.

    transformers records them by forward hooks into a context variable, which a sub-batch's thread does not see;
    :func:`_capturing` records them per sub-batch and returns them through the region, so their gradients (the
    aux loss's) reach earlier layers as without the split.
    """
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without output capturing records nothing to carry over
        return None
    return _active_collector.get()


def _capturing(forward: Any, keys: Sequence[str]) -> Any:
    """``forward`` that also returns what the model's output hooks recorded under ``keys`` during it, each tensor
    batch-first (token-major rows ``[sub_batch·seq, …]`` viewed as ``[sub_batch, seq, …]``) so the region
    concatenates the sub-batches' shares in batch order."""
    from transformers.utils.output_capturing import _active_collector

    def run(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, list[torch.Tensor]], dict[str, list[bool]]]:
        sub_batch = batch_size(args, kwargs)
        recorded: dict[str, list[torch.Tensor]] = {key: [] for key in keys}
        token = _active_collector.set(recorded)
        try:
            output = forward(*args, **kwargs)
        finally:
            _active_collector.reset(token)
        token_major = {key: [t.shape[0] != sub_batch for t in tensors] for key, tensors in recorded.items()}
        for key, tensors in recorded.items():
            for index, tensor in enumerate(tensors):
                if token_major[key][index]:
                    if tensor.shape[0] % sub_batch:
                        raise ValueError(f"recorded {key} of shape {tuple(tensor.shape)} is neither batch-first nor "
                                         f"token-major over {sub_batch} samples; run without output_{key}")
                    tensors[index] = tensor.unflatten(0, (sub_batch, -1))
        return output, recorded, token_major

    return run


def _layer_blocks(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """Each registry experts module of ``model`` with its decoder layer (:func:`~.block_split.enclosing_block`)."""
    modules = dict(model.named_modules())
    pairs: list[tuple[nn.Module, nn.Module]] = []
    for name, experts in experts_modules(model):
        block = enclosing_block(modules, name)
        if block is None:
            raise ValueError(f"experts module {name!r} is not inside a decoder layer held by an nn.ModuleList or "
                             "nn.Sequential; block-scope Lancet splits decoder layers")
        pairs.append((block, experts))
    return pairs


def expert_parallel_lancet(model: nn.Module, chunks: Chunks = "auto") -> list[nn.Module]:
    """Run every decoder layer of a transformers MoE model that holds experts as ``chunks`` overlapped
    sub-batches (``"auto"``: measured, see the module docstring); return the layers.

    Works before or after :func:`~lightning_merak.plugins.moe.experts.enable_expert_parallel`; the overlap
    starts once the experts are expert parallel. Needs ``use_cache=False`` (a key/value cache spans the batch).
    """
    check_chunks(chunks)
    pairs = _layer_blocks(model)
    if not pairs:
        raise ValueError(f"{type(model).__name__} has no experts module in transformers' experts registry; "
                         "block-scope Lancet for merak_ep needs a transformers-5 MoE model")
    for block, _ in pairs:
        if isinstance(block.forward, ExpertParallelLancet):
            raise ValueError(f"{type(block).__name__} already runs block-scope Lancet; "
                             "call expert_parallel_lancet once")
    for block, experts in pairs:
        block.forward = ExpertParallelLancet(block, experts, chunks)
    return [block for block, _ in pairs]
