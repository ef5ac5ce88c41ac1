"""This rank's part of a :class:`~.variable.ContextPlan`: each round's forward and backward, at the round's degree.

A round of degree ``k > 1`` runs its sample through :class:`~.model.ContextParallelForward` over this rank's
subgroup of ``k`` consecutive ranks of the context-parallel group (:func:`context_subgroups`); a round of degree 1
runs each of this rank's samples whole, through the model's own forward with plain causal attention
(:meth:`~.model.ContextParallelForward.local`). Every sample is scored with the summed next-token cross-entropy
over the whole global batch's target count, so the parts of all ranks add up to the global batch's token mean.

Every rank runs every round of its replica's plan with one backward each, also where its slot is empty (a few
tokens times zero), so every rank of the data-parallel reduction counts the same backward passes.
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_merak.distributed.process_groups import new_group
from lightning_merak.parallel.context.model import IGNORE_INDEX, ContextParallelForward
from lightning_merak.parallel.context.variable import DegreeCost, Round, split_length
from lightning_merak.parallel.layout import LayoutGroups
from lightning_merak.parallel.micro_batching.plan import CostModel
from lightning_merak.protocols.layout_aware import data_parallel_groups_from_mesh
from lightning_merak.util import random_state
from lightning_merak.util.timing import DeviceTimer

__all__ = ["CALIBRATION_FLOOR", "RoundRunner", "calibration_lengths", "context_subgroups", "fit_degree_cost",
           "measure_degree_cost", "short_calibration_problem"]


def context_subgroups(groups: LayoutGroups) -> dict[int, dist.ProcessGroup]:
    """This rank's subgroup of each degree ``k`` (a divisor of the context-parallel degree, above 1): ``k``
    consecutive ranks of its context-parallel group. Every rank creates every subgroup, in one order (a collective)."""
    size = groups.layout.context_parallel
    assert groups.context_group is not None, "subgroups split the layout's context-parallel group"
    mine: dict[int, dist.ProcessGroup] = {size: groups.context_group}
    degrees = [k for k in range(2, size) if size % k == 0]
    if not degrees:
        return mine
    mesh = groups.mesh
    for line in data_parallel_groups_from_mesh(mesh.mesh.tolist(), mesh.mesh_dim_names or ()):
        for start in range(0, len(line), size):
            context_ranks = line[start:start + size]
            for degree in degrees:
                for first in range(0, size, degree):
                    ranks = context_ranks[first:first + degree]
                    group = new_group(ranks)
                    if dist.get_rank() in ranks:
                        mine[degree] = group
    return mine


class RoundRunner:
    """Runs rounds on this rank of a context-parallel group through the model's installed context-parallel forward.

    ``forward`` is the model's :class:`~.model.ContextParallelForward` (over the whole group); ``subgroups`` this
    rank's group of each degree above 1 (:func:`context_subgroups`).
    """

    def __init__(self, forward: ContextParallelForward, subgroups: dict[int, dist.ProcessGroup]) -> None:
        self._forward = forward
        self._group_rank = dist.get_rank(subgroups[max(subgroups)])
        self._forwards = {degree: forward if group is subgroups[max(subgroups)] else forward.over(group)
                          for degree, group in subgroups.items()}
        self._first_of = {degree: dist.get_rank(group) == 0 for degree, group in subgroups.items()}

    def run(self, rounds: Sequence[Round], tokens: Tensor, lengths: Sequence[int], targets: int,
            backward: Optional[Callable[[Tensor, int], None]]) -> Tensor:
        """Every round's forward (and ``backward(loss, degree)``, if given, on the round's loss: this rank's summed
        cross-entropy over ``targets``, the group's at degree ``k > 1``); returns this rank's share of the global
        batch's token-mean loss (a split sample counted on its subgroup's first rank), detached."""
        share = torch.zeros((), dtype=torch.float32, device=tokens.device)
        for round_ in rounds:
            samples = round_.samples_of(self._group_rank)
            if round_.degree > 1 and samples:
                (index,) = samples
                loss = self._split(tokens[index, :lengths[index]], round_.degree, targets)
                if self._first_of[round_.degree]:
                    share += loss.detach().float()
            elif samples:
                losses = [self._local(tokens[index, :lengths[index]], targets) for index in samples]
                loss = torch.stack(losses).sum()
                share += loss.detach().float()
            else:  # an empty slot: a backward pass all the same, adding zero
                loss = self._local(tokens[0, :min(8, lengths[0])], targets) * 0.0
            if backward is not None:
                backward(loss, round_.degree if samples else 1)
        return share

    def _local(self, sample: Tensor, targets: int) -> Tensor:
        inputs = sample[None]
        return self._forward.local(input_ids=inputs, labels=inputs, use_cache=False,
                                   num_items_in_batch=torch.tensor(targets, device=sample.device)).loss

    def _split(self, sample: Tensor, degree: int, targets: int) -> Tensor:
        length = split_length(len(sample), degree)
        inputs = sample.new_zeros(1, length)
        labels = sample.new_full((1, length), IGNORE_INDEX)
        inputs[0, :len(sample)] = sample
        labels[0, :len(sample)] = sample
        # the padding repeats the last real position: a model's position table (GPT-2's n_positions) may end at
        # the sample's length, and no real token attends to the padding after it
        positions = torch.arange(length, device=sample.device).clamp(max=max(len(sample) - 1, 1))[None]
        return self._forwards[degree](input_ids=inputs, labels=labels, position_ids=positions,
                                      num_items_in_batch=torch.tensor(targets, device=sample.device)).loss


CALIBRATION_FLOOR = 4
"""The shortest longest sample :func:`measure_degree_cost` can time: three lengths of at least two tokens (a
next-token target each) fit its three coefficients."""


def short_calibration_problem(size: int, longest: int, setting: Optional[str] = None) -> Optional[str]:
    """Why :func:`measure_degree_cost` cannot time samples of at most ``longest`` tokens, or None: it needs three
    lengths of at least two tokens, so a longest sample of :data:`CALIBRATION_FLOOR`. ``setting``: the key that
    caps the samples (``data.max_length``), named with its fix; without it, the cap the run found."""
    if longest >= CALIBRATION_FLOOR:
        return None
    cause, fix = ((f"{setting}={longest} allows no longer sample", f"raise {setting} to at least {CALIBRATION_FLOOR}")
                  if setting else (f"the longest sample the model and data allow has {longest}",
                                   f"use samples of at least {CALIBRATION_FLOOR} tokens"))
    return (f"context_parallel_degree='per_micro_batch' measures its cost model on samples of three lengths, whole "
            f"and split over context_parallel={size} ranks, the longest at least {CALIBRATION_FLOOR} tokens, but "
            f"{cause}; set strategy.micro_batching_cost to a fixed cost model instead, or {fix}")


def calibration_lengths(token_cap: int, size: int, longest: Optional[int] = None) -> list[int]:
    """The sample lengths :func:`measure_degree_cost` times: an eighth, a quarter and half of the per-rank token cap,
    each a multiple of ``2 x size`` (a split sample's chunks), spread instead below ``longest`` where that is
    shorter (the longest sample the run and the model's position table allow: the model runs no longer ones).

    Below ``6 x size`` tokens three whole chunks do not fit: the lengths are then a quarter, half and all of
    ``longest``, which the split runs pad to whole chunks (the padding repeating the sample's last position, so
    within the table), as the rounds pad a sample."""
    problem = None if longest is None else short_calibration_problem(size, longest)
    if problem is not None:
        raise ValueError(problem)
    unit = 2 * size
    span = token_cap // 2 if longest is None else min(token_cap // 2, longest)
    lengths = sorted({max(unit, span // part // unit * unit) for part in (4, 2, 1)})
    if len(lengths) == 3:
        return lengths
    if longest is None or longest >= 3 * unit:  # a span too short to spread them
        return [unit, 2 * unit, 3 * unit]
    return [max(2, longest // 4), max(3, longest // 2), longest]


def measure_degree_cost(runner: RoundRunner, model: torch.nn.Module, size: int, token_cap: int, vocab_size: int,
                        device: torch.device, longest: Optional[int] = None) -> DegreeCost:
    """A :class:`DegreeCost` measured on these ranks: one forward and backward of a sample of each
    :func:`calibration_lengths` (at most ``longest`` tokens) whole on every rank and split over the context-parallel
    group of ``size`` (device time), the compute fitted by least squares and each ring step's exposed exchange the
    median remainder. Every rank of the world calls it (a collective); the world's first rank's figures are used
    everywhere, so every rank plans alike. The gradients it computes on ``model`` are dropped and the random streams
    left as they were."""
    generator = torch.Generator().manual_seed(0)
    alone: list[tuple[int, int, float]] = []
    split: list[tuple[int, float]] = []
    saved = random_state.capture()
    parameters = [p for p in model.parameters() if p.requires_grad]
    with torch.inference_mode(False), torch.enable_grad():
        for index, length in enumerate(calibration_lengths(token_cap, size, longest)):
            tokens = torch.randint(vocab_size, (1, length), generator=generator).to(device)
            for degree in (1, size):
                round_ = Round(degree, ((0,),) * (size // degree))
                for timed in ((False, True) if index == 0 else (True,)):  # the first call warms up
                    dist.barrier()
                    with DeviceTimer(device) as timer:
                        runner.run([round_], tokens, [length], length - 1, lambda loss, _: loss.backward())
                    if timed and degree == 1:
                        alone.append((1, length, timer.seconds))
                    elif timed:
                        split.append((length, timer.seconds))
    for param in parameters:
        param.grad = None
    random_state.restore(saved)
    fitted = fit_degree_cost(alone, split, size)
    figures: list[float] = [fitted.compute.per_token, fitted.compute.per_token_squared, fitted.compute.overhead,
                            fitted.exchange_per_step]
    dist.broadcast_object_list(figures, src=0)
    return DegreeCost(CostModel(*figures[:3]), exchange_per_step=figures[3])


def fit_degree_cost(alone: Sequence[tuple[int, int, float]], split: Sequence[tuple[int, float]],
                    size: int) -> DegreeCost:
    """The :class:`DegreeCost` of samples timed whole on one rank (``alone``: rows, tokens, seconds) and split over
    ``size`` ranks (``split``: tokens, seconds): the compute fitted by least squares on ``alone``, each ring step's
    exchange the median of what a split sample took beyond :meth:`DegreeCost.time`'s compute (its fixed overhead
    once per forward, as the model charges it, and ``1/size`` of the work)."""
    compute = DegreeCost(CostModel.fit(alone))
    exchange = [(seconds - compute.time(length, size)) / (size - 1) for length, seconds in split]
    return DegreeCost(compute.compute, exchange_per_step=max(0.0, statistics.median(exchange)))
