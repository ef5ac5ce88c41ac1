"""Time one block, the head, the first stage's own work and the loss at several micro-batch sizes, in this process
(no group, no network).

A trace holds block calls of one size; the replay's micro-batch what-ifs need calls of others.
:func:`probe_call_curves` records the model once per size (:func:`~lightning_merak.parallel.pipeline.trace.
trace_model`, no profiling), then times a block's forward and backward (the model's blocks called one after
another, as a pipeline stage calls its own, per block: a block called alone, after the head or the loss has run,
finds its weights out of the cache, which inflates small calls most), the head's (everything after the
blocks, and the loss), the prefix's: what a pipeline's first stage runs besides its blocks (the embedding,
position tables and mask, and the stage's exit from the model's forward: a first stage holding no block,
:func:`~lightning_merak.parallel.pipeline.stage.build_stage_module`), whose backward a trace does not time
apart from the blocks', and the loss alone, which a pipeline computes between chunks. The sizes are interleaved
round after round so that a slow spell of a shared machine falls on every size alike, and each size's fastest call
is kept as a :class:`~lightning_merak.planning.replay.call_curve.CallCurve` point: another process taking the core only
adds time, and adds a larger share to a short call than to a long one, which would bend the curve's shape (medians
did, at load averages above 10).
"""

from __future__ import annotations

import copy
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch import nn

from lightning_merak.parallel.pipeline.stage import build_stage_module
from lightning_merak.parallel.pipeline.trace import ModelTrace, find_trunk, trace_model
from lightning_merak.planning.replay.call_curve import CallCurve
from lightning_merak.util.timing import DeviceTimer

__all__ = ["ProbedCurves", "next_token_loss", "probe_call_curves"]


class ProbedCurves(NamedTuple):
    """A probe's call curves: a block, the head with its loss, the first pipeline stage's prefix, the loss alone."""

    block: CallCurve
    head: CallCurve
    prefix: CallCurve
    loss: CallCurve


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A causal language model's loss: cross-entropy of each position's logits against the next token."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))


def _call_model(model: nn.Module, ids: torch.Tensor) -> object:
    return model(ids)


def _timed(run: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, float]:
    """(forward seconds, backward seconds) on ``device`` of one call of ``run`` and the backward of its output."""
    with DeviceTimer(device) as forward:
        out = run()
    with DeviceTimer(device) as backward:
        out.backward(torch.ones_like(out))
    return forward.seconds, backward.seconds


def probe_call_curves(model: nn.Module, tokens: torch.Tensor, sizes: Sequence[int], rounds: int = 30,
                      warmup: int = 2, loss: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                      ) -> ProbedCurves:
    """The fastest forward and backward seconds of a block (the model's blocks in a row, per block), of the head
    (with ``loss``, default :func:`next_token_loss`), of the first stage's prefix (on a copy of ``model``) and of the
    loss alone on the first ``n`` rows of ``tokens`` for each ``n`` in ``sizes``.

    ``rounds`` timed calls per size after ``warmup`` untimed ones; the model's gradients are cleared afterwards.
    Raises before timing anything where ``sizes`` are fewer than two, not increasing, or above ``tokens``' rows.
    """
    sizes = list(sizes)
    if len(sizes) < 2 or any(b <= a for a, b in zip(sizes, sizes[1:])) or sizes[0] < 1:
        raise ValueError(f"probe at least two increasing micro-batch sizes of one sample or more, got {sizes}")
    if sizes[-1] > tokens.size(0):
        raise ValueError(f"the largest size ({sizes[-1]}) needs as many rows of tokens, got {tokens.size(0)}")
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be positive and warmup not negative, got {rounds} / {warmup}")
    loss = loss or next_token_loss
    _, blocks = find_trunk(model)
    traces = [trace_model(model, tokens[:n], profile=False) for n in sizes]
    prefix_stage = build_stage_module(copy.deepcopy(model), traces[0], (0, 1), 0, _call_model)
    calls: list[tuple[Callable[[], torch.Tensor], ...]] = []
    for n, recorded in zip(sizes, traces):
        batch = tokens[:n]
        args, kwargs = recorded.block_arguments(recorded.sample_side_tensors)
        block_input = recorded.sample_hidden.detach().clone().requires_grad_(True)
        with torch.no_grad():
            last = recorded.sample_hidden.detach()
            for each in blocks:
                last = recorded.hidden_of(each(last, *args, **kwargs))
        head_input = last.detach().clone().requires_grad_(True)
        with torch.no_grad():
            logits = recorded.run_head(model, last).detach().requires_grad_(True)

        def run_block(block_input: torch.Tensor = block_input, args: tuple = args, kwargs: dict = kwargs,
                      recorded: ModelTrace = recorded) -> torch.Tensor:
            hidden = block_input
            for each in blocks:
                hidden = recorded.hidden_of(each(hidden, *args, **kwargs))
            return hidden

        def run_head(head_input: torch.Tensor = head_input, recorded: ModelTrace = recorded,
                     batch: torch.Tensor = batch) -> torch.Tensor:
            return loss(recorded.run_head(model, head_input), batch)

        def run_prefix(batch: torch.Tensor = batch) -> torch.Tensor:
            return prefix_stage(batch)[0]

        def run_loss(logits: torch.Tensor = logits, batch: torch.Tensor = batch) -> torch.Tensor:
            return loss(logits, batch)

        calls.append((run_block, run_head, run_prefix, run_loss))
    times: dict[tuple[int, int], list[tuple[float, float]]] = {}
    was_training = model.training
    model.train()
    prefix_stage.train()
    try:
        for round_index in range(warmup + rounds):
            for index, pair in enumerate(calls):
                for part, run in enumerate(pair):
                    measured = _timed(run, tokens.device)
                    if round_index >= warmup:
                        times.setdefault((index, part), []).append(measured)
    finally:
        model.train(was_training)
        for param in model.parameters():
            param.grad = None

    def curve(part: int) -> CallCurve:
        calls_per_run = len(blocks) if part == 0 else 1
        fastest = [(min(f for f, _ in times[index, part]) / calls_per_run,
                    min(b for _, b in times[index, part]) / calls_per_run) for index in range(len(sizes))]
        return CallCurve(tuple(float(n) for n in sizes), tuple(f for f, _ in fastest), tuple(b for _, b in fastest))

    return ProbedCurves(*(curve(part) for part in range(4)))
