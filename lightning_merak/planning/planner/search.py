"""Exhaustive search over layouts: every candidate is predicted, the fastest that fits memory wins.

The space is small (a few hundred layouts for a node or two, per sharding mode searched), so enumeration is exact and
cheap; the order of equally fast layouts is fixed (:attr:`Layout.tie_break_key`) so every
rank computing the plan gets the same answer.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable

from lightning_merak.planning.planner.cost_model import (
    COMPONENTS,
    Layout,
    Prediction,
    micro_batch_samples,
    predict,
)
from lightning_merak.planning.planner.profile import ModelProfile, NetworkProfile, SearchSpace

_GIB = 1024**3


def _divisors(value: int) -> list[int]:
    return [divisor for divisor in range(1, value + 1) if value % divisor == 0]


def expert_parallel_sizes(space: SearchSpace, dp: int, num_experts: int | None = None) -> list[int]:
    """The expert-parallel sizes a layout of ``dp`` replicas is searched at: ``space.ep_size`` where it divides dp;
    left unset (None) for a model of ``num_experts`` experts per MoE layer, every size dividing both dp and the
    experts (ep < dp replicates each expert group's experts over dp/ep groups); else dp."""
    if space.ep_size is None and num_experts is not None:
        return [ep for ep in _divisors(dp) if num_experts % ep == 0]
    ep = space.expert_parallel(dp)
    return [] if ep is None else [ep]


def candidate_layouts(space: SearchSpace, num_blocks: int | None = None,
                      num_experts: int | None = None) -> list[Layout]:
    """Every layout of ``space``, in a fixed order.

    dp x cp x pp x tp = world size with cp from ``context_parallel_degrees``, tp from ``tp_degrees_allowed``
    and pp at most ``max_pipeline_stages`` (and ``num_blocks + 2`` nodes when given). Micro-batch counts are
    ``micro_batch_choices`` of at least pp dividing the per-replica batch (None: every such divisor with stages,
    one micro-batch without: the run's count, so a run's micro-batches are the priced ones at any pp).
    Overlap degrees divide the micro-batch and exceed 1 only with tp > 1; one stage takes
    recompute ratios 0 or 1 only. Each takes every mode of ``sharding_modes`` it can run
    (:func:`sharding_modes_for`), and each expert-parallel size :func:`expert_parallel_sizes` gives its dp
    (``num_experts``: the experts of each MoE layer, searched over when ``space.ep_size`` is unset).
    A context degree above 1 takes each of ``context_attention_methods``, with no expert layers,
    and with one stage unless ``space.context_with_stages`` (what merak3d's context parallelism runs with); whether
    the model's heads allow a method is the profile's to say (:func:`plan`).
    """
    max_stages = space.max_pipeline_stages if num_blocks is None else min(space.max_pipeline_stages, num_blocks + 2)
    layouts = []
    for cp, tp in itertools.product(sorted(set(space.context_parallel_degrees)), sorted(set(space.tp_degrees_allowed))):
        if space.world_size % (cp * tp) or (cp > 1 and num_experts is not None):
            continue
        methods = space.context_attention_methods if cp > 1 else ("ring",)
        for pp in _divisors(space.world_size // (cp * tp)):
            dp = space.world_size // (cp * tp * pp)
            per_replica, expert_sizes = space.replica_batch(dp), expert_parallel_sizes(space, dp, num_experts)
            if (pp > max_stages or per_replica is None or not expert_sizes
                    or (cp > 1 and pp > 1 and not space.context_with_stages)):
                continue
            if pp == 1 and space.micro_batch_choices is None:
                micro_batch_counts = [1]  # merak3d's default without stages
            else:
                choices = _divisors(per_replica) if space.micro_batch_choices is None else space.micro_batch_choices
                micro_batch_counts = sorted({count for count in choices if count >= pp and per_replica % count == 0})
            ratios = sorted(set(space.recompute_ratios) if pp > 1 else set(space.recompute_ratios) & {0.0, 1.0})
            for micro_batches in micro_batch_counts:
                samples = per_replica // micro_batches
                overlaps = sorted({k for k in space.overlap_choices if samples % k == 0}) if tp > 1 else [1]
                for overlap in overlaps:
                    for ratio in ratios:
                        for mode in sharding_modes_for(space, dp * cp, overlap):
                            layouts += [Layout(dp, pp, tp, micro_batches, overlap, ratio, mode, ep, cp, method, split)
                                        for ep in expert_sizes for method in methods
                                        for split in _vocab_stages_choices(space, pp, mode)]
    return layouts


def _vocab_stages_choices(space: SearchSpace, pp: int, sharding: str) -> list[bool]:
    """Whether a layout keeps the LM head whole or splits it over its stages: ``space``'s choices where it can
    split (pp > 1, parameters not fully sharded: the planner's memory model would shard the rows), whole
    elsewhere."""
    splits = pp > 1 and sharding != "full"
    return sorted(set(space.vocab_stages_choices)) if splits else [False]


def sharding_modes_for(space: SearchSpace, dp: int, overlap: int) -> list[str]:
    """The modes of ``space.sharding_modes`` a layout of ``dp`` data-parallel ranks and ``overlap`` sub-batches runs.

    ``"full"`` runs without sub-batches only; no mode runs where the shard size does not divide
    dp. Searching several modes, a sharded one is left out where it splits nothing (dp = 1 or
    shard size 1: it is ``"none"``); one fixed mode is kept there, as the run will be told.
    """
    modes = [mode for mode in space.sharding_modes
             if not (mode == "full" and overlap > 1)
             and not (mode != "none" and dp > 1 and space.shard_size is not None and dp % space.shard_size)]
    if len(space.sharding_modes) > 1:
        modes = [mode for mode in modes if mode == "none" or space.shards(mode, dp) > 1]
    return modes


@dataclass(frozen=True)
class ProfileKeys:
    """What a profiler must measure for one search, and nothing more.

    Block times per (tp, samples per sub-batch), prefix and suffix times per samples, block
    parameter and activation bytes per tp, and all-reduce costs per group size (the p2p link
    is always needed). ``measured_blocks`` lists the (tp, overlap, samples per micro-batch)
    at which a profiler that can run real tensor-parallel blocks should time them (optional
    entries: the model falls back to its simulated chain). ``loss_samples`` are the micro-batch
    sizes at which the training loss is timed (optional too: without them no loss is counted).
    ``all_to_all_group_sizes`` are the expert groups' sizes (``ep`` > 1) whose all-to-all a model with
    expert-parallel MoE layers exchanges over, and the context groups' sizes of all-to-all attention (optional:
    the all-reduce link of that size stands in). ``context_parallel``: some layout splits sequences, so the
    profile must describe the attention they exchange (``ModelProfile.context``); ``context_kernels`` lists the
    (cp, method, tp, samples) at which a profiler should time one context rank's attention compute (optional: the
    cost model falls back to the kernel's FLOP share).
    """

    block_times: frozenset[tuple[int, int]]
    prefix_suffix_samples: frozenset[int]
    tp_degrees: frozenset[int]
    all_reduce_group_sizes: frozenset[int]
    measured_blocks: frozenset[tuple[int, int, int]] = frozenset()
    loss_samples: frozenset[int] = frozenset()
    all_to_all_group_sizes: frozenset[int] = frozenset()
    context_parallel: bool = False
    context_kernels: frozenset[tuple[int, str, int, int]] = frozenset()


def required_profile_keys(space: SearchSpace, num_blocks: int | None = None,
                          num_experts: int | None = None) -> ProfileKeys:
    """The profile entries :func:`plan` reads for ``space`` (a model of ``num_experts`` experts per MoE layer), so a
    profiler measures nothing more."""
    block_times, samples_needed, tp_degrees, group_sizes, measured, loss_samples, expert_groups = (
        set(), set(), set(), set(), set(), set(), set()
    )
    context_kernels: set[tuple[int, str, int, int]] = set()
    for layout in candidate_layouts(space, num_blocks, num_experts):
        samples = micro_batch_samples(layout, space)
        sub = samples // layout.overlap
        block_times.add((layout.tp, sub))
        samples_needed.add(sub)
        loss_samples.add(samples)
        tp_degrees.add(layout.tp)
        ranks = layout.data_parallel_ranks
        shards = space.shards(layout.sharding, ranks)
        group_sizes.update(size for size in (layout.tp, ranks, shards, ranks // shards) if size > 1)
        if space.clip_gradients and layout.pp > 1:
            group_sizes.add(layout.pp)
        if layout.tp > 1:
            measured.add((layout.tp, layout.overlap, samples))
        if layout.ep > 1:  # the exchange's group, and the experts' gradient sum over the ranks holding the same ones
            expert_groups.add(layout.ep)
            group_sizes.update(size for size in (layout.ep, layout.dp // layout.ep) if size > 1)
        if layout.cp > 1:
            context_kernels.add((layout.cp, layout.context_attention, layout.tp, sub))
        if layout.cp > 1 and layout.context_attention == "all_to_all":
            expert_groups.add(layout.cp)
            group_sizes.add(layout.cp)
    return ProfileKeys(
        frozenset(block_times), frozenset(samples_needed), frozenset(tp_degrees), frozenset(group_sizes),
        frozenset(measured), frozenset(loss_samples), frozenset(expert_groups),
        context_parallel=bool(context_kernels), context_kernels=frozenset(context_kernels),
    )


def _missing_entries(keys: ProfileKeys, model_profile: ModelProfile, network: NetworkProfile,
                     clip_gradients: bool) -> list[str]:
    needed = [
        ("block_times", keys.block_times, model_profile.block_times),
        ("prefix_times", keys.prefix_suffix_samples, model_profile.prefix_times),
        ("suffix_times", keys.prefix_suffix_samples, model_profile.suffix_times),
        ("block_parameter_bytes", keys.tp_degrees, model_profile.block_parameter_bytes),
        ("block_activation_bytes_per_sample", keys.tp_degrees, model_profile.block_activation_bytes_per_sample),
        ("network.all_reduce", keys.all_reduce_group_sizes, network.all_reduce),
    ]
    if model_profile.loss_times:  # optional, but a profile that timed the loss must have every size
        needed.append(("loss_times", keys.loss_samples, model_profile.loss_times))
    if clip_gradients:
        needed.append(("block_clip_s", keys.tp_degrees, model_profile.block_clip_s))
    if keys.all_to_all_group_sizes:  # the exchange's link: measured, or the all-reduce link of that size
        links = network.all_to_all.keys() | network.all_reduce.keys()
        needed.append(("network.all_to_all", keys.all_to_all_group_sizes, dict.fromkeys(links)))
    missing = [f"{name}[{key}]" for name, wanted, present in needed for key in sorted(wanted - present.keys())]
    if keys.context_parallel and model_profile.context is None:
        missing.append("context (the attention shape a split sequence exchanges)")
    return missing


@dataclass(frozen=True)
class Plan:
    """The search result: fitting layouts fastest first (``ranked``), and those that did not fit, with why."""

    ranked: tuple[Prediction, ...]
    rejected: tuple[tuple[Layout, str], ...]

    @property
    def best(self) -> Prediction:
        return self.ranked[0]

    @property
    def runner_up(self) -> Prediction | None:
        return self.ranked[1] if len(self.ranked) > 1 else None

    def describe(self) -> str:
        """A few lines for the log: the choice, its predicted step time and parts, and the runner-up."""
        best = self.best
        parts = ", ".join(f"{name} {best.components[name]:.4g} s" for name in COMPONENTS)
        lines = [
            f"planner chose {best.layout.describe()}",
            f"  predicted step {best.step_time_s:.4g} s for {best.samples_per_step} samples ({parts}); "
            f"memory {best.memory_bytes / _GIB:.3g} GiB per rank",
        ]
        if self.runner_up is not None:
            runner_up = self.runner_up
            slower = runner_up.time_per_sample_s / best.time_per_sample_s - 1.0 if best.step_time_s > 0 else 0.0
            lines.append(
                f"  runner-up {runner_up.layout.describe()}: {runner_up.step_time_s:.4g} s for "
                f"{runner_up.samples_per_step} samples ({100 * slower:+.1f}% per sample)"
            )
        lines.append(f"  {len(self.ranked)} layouts fit, {len(self.rejected)} rejected for memory")
        return "\n".join(lines)


def _rank_key(prediction: Prediction) -> tuple:
    return (prediction.time_per_sample_s, *prediction.layout.tie_break_key)


def rerank(ranked: Plan, step_time_of: Callable[[Layout], float]) -> Plan:
    """``ranked`` with every fitting layout's step time from ``step_time_of`` (e.g. a trace replay), ranked again.

    Memory fits and the components stay the cost model's; the cost model's own step time is kept as the
    ``"analytic_step_s"`` component, so both predictors can be compared.
    """
    predictions = []
    for prediction in ranked.ranked:
        seconds = float(step_time_of(prediction.layout))
        if not seconds > 0:
            raise ValueError(f"the step time predictor returned {seconds} for {prediction.layout.describe()}; "
                             "it must be positive (check its calibration)")
        components = {**prediction.components, "analytic_step_s": prediction.step_time_s}
        predictions.append(dataclasses.replace(prediction, step_time_s=seconds, components=components))
    return Plan(ranked=tuple(sorted(predictions, key=_rank_key)), rejected=ranked.rejected)


def plan(space: SearchSpace, model_profile: ModelProfile, network: NetworkProfile) -> Plan:
    """Predict every candidate layout and rank those that fit ``space.memory_limit_bytes``, fastest first.

    Layouts whose expert-parallel size does not divide the model's experts are left out, and so are context-parallel
    layouts whose attention method the model's heads or sequence rule out (``model_profile.context.methods``, and
    with sequence parallelism a context rank's tokens that do not split over tp); with
    ``space.ep_size``
    unset every size dividing dp and the experts is searched, each priced by the cost model (the experts a rank
    keeps, their gradients' sum over the dp/ep ranks holding the same ones, the exchange over ep ranks). Raises
    before predicting
    anything when the profiles lack an entry the search needs, and when no layout fits, naming the memory the
    smallest one needs.
    """
    experts = model_profile.experts  # the runtime splits each layer's experts evenly over an expert group
    num_experts = None if experts is None else experts.num_experts
    layouts = [layout for layout in candidate_layouts(space, model_profile.num_blocks, num_experts)
               if experts is None or experts.num_experts % layout.ep == 0]
    if not layouts and experts is not None and candidate_layouts(space, model_profile.num_blocks):
        raise ValueError(f"no candidate layout's expert-parallel size divides the {experts.num_experts} experts; "
                         "set moe.ep_size to a divisor of them")
    if not layouts:
        raise ValueError(
            f"no candidate layout for world_size={space.world_size}, global_batch_size={space.global_batch_size}, "
            f"tp_degrees_allowed={space.tp_degrees_allowed}, max_pipeline_stages={space.max_pipeline_stages}; "
            "allow more degrees, micro-batch or overlap choices, or a batch divisible by the data-parallel degree"
        )
    missing = _missing_entries(required_profile_keys(space, model_profile.num_blocks, num_experts), model_profile,
                               network, space.clip_gradients)
    if missing:
        raise ValueError(f"the profiles lack entries the search needs: {', '.join(missing)}; profile them first")
    context = model_profile.context
    layouts = [layout for layout in layouts
               if layout.cp == 1 or (context is not None and layout.context_attention in context.methods(layout.cp,
                                                                                                         layout.tp)
                                     and not (space.sequence_parallel and layout.tp > 1
                                              and (context.sequence_length // layout.cp) % layout.tp))]
    if not layouts:
        raise ValueError(f"no context-parallel layout runs this model (sequence {context.sequence_length}, "
                         f"{context.key_value_heads} key/value heads) at context_parallel_degrees="
                         f"{space.context_parallel_degrees}: the sequence must split into 2 x cp chunks and "
                         "all-to-all needs cp to divide each tensor rank's key/value heads; allow cp=1 or another "
                         "degree")

    predictions = [predict(layout, model_profile, network, space) for layout in layouts]
    fitting = sorted((prediction for prediction in predictions if prediction.fits), key=_rank_key)
    if not fitting:
        smallest = min(predictions, key=lambda prediction: (prediction.memory_bytes, *_rank_key(prediction)))
        raise ValueError(
            f"no layout fits memory_limit_bytes={space.memory_limit_bytes:.0f}; the smallest needs "
            f"{smallest.memory_bytes:.0f} bytes ({smallest.layout.describe()}): raise the limit or the world size"
        )
    rejected = tuple(
        (
            prediction.layout,
            f"needs {prediction.memory_bytes:.0f} bytes > memory_limit_bytes={space.memory_limit_bytes:.0f}",
        )
        for prediction in predictions
        if not prediction.fits
    )
    return Plan(ranked=tuple(fitting), rejected=rejected)
