"""Inputs of the layout planner: what the machine and the model cost, and what to search.

These records hold plain numbers. A profiler fills them by measuring the machine (or a test
writes them by hand); the cost model and the search only read them, so the planner's
choice can be reproduced from a saved profile without touching a process group.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence, TypeVar

from lightning_merak.parallel.pipeline import SCHEDULES, simulate_schedule
from lightning_merak.planning.planner.attention import CONTEXT_ATTENTION_METHODS, ContextAttention
from lightning_merak.planning.planner.experts import ExpertLayers

DATA_PARALLEL_SHARDING = ("none", "optimizer", "gradients", "full")
"""What the data-parallel ranks may split, least sharded first (the order ties between equally fast layouts take):
nothing, the optimizer state (ZeRO-1), gradients too (ZeRO-2), parameters too (FSDP2)."""


def _check_non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{owner}: {name} must be >= 0, got {value}")


def _check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{owner}: {name} must be > 0, got {value}")


@dataclass(frozen=True)
class CollectiveCost:
    """Alpha-beta cost of one kind of collective on one group: a fixed latency plus bytes over bandwidth."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        _check_non_negative("CollectiveCost", latency_s=self.latency_s)
        _check_positive("CollectiveCost", bandwidth_bytes_per_s=self.bandwidth_bytes_per_s)

    def all_reduce_s(self, nbytes: float, ranks: int) -> float:
        """Ring all-reduce of ``nbytes`` over ``ranks``: each rank moves 2(ranks - 1)/ranks of the data."""
        _check_non_negative("all_reduce_s", nbytes=nbytes)
        if ranks < 1:
            raise ValueError(f"all_reduce_s: ranks must be >= 1, got {ranks}")
        if ranks == 1:
            return 0.0
        return self.latency_s + 2.0 * (ranks - 1) / ranks * nbytes / self.bandwidth_bytes_per_s

    def send_s(self, nbytes: float) -> float:
        """Point-to-point transfer of ``nbytes``."""
        _check_non_negative("send_s", nbytes=nbytes)
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


def fit_collective_cost(points: list[tuple[float, float]], factor: float = 1.0) -> CollectiveCost:
    """The alpha-beta cost ``t = latency + factor · bytes / bandwidth`` closest to measured ``(bytes, seconds)`` points.

    Least squares on the *relative* error, so a fit spanning kilobytes to tens of megabytes
    is as good at the small end as at the large one. Noise that would make the latency or
    the per-byte cost negative pins that term to zero and refits the other.
    """
    if len(points) < 2 or len({nbytes for nbytes, _ in points}) < 2:
        raise ValueError(f"fit_collective_cost needs points at two or more sizes, got {points}")
    if any(nbytes < 0 or seconds <= 0 for nbytes, seconds in points):
        raise ValueError(f"fit_collective_cost needs bytes >= 0 and seconds > 0, got {points}")
    # minimise sum(((latency + slope * n) / t - 1) ** 2): linear least squares in (latency, slope)
    s_aa = sum(1 / t**2 for _, t in points)
    s_ab = sum(n / t**2 for n, t in points)
    s_bb = sum(n * n / t**2 for n, t in points)
    s_a = sum(1 / t for _, t in points)
    s_b = sum(n / t for n, t in points)
    determinant = s_aa * s_bb - s_ab * s_ab
    latency = (s_a * s_bb - s_b * s_ab) / determinant
    slope = (s_aa * s_b - s_ab * s_a) / determinant
    if slope <= 0:
        latency, slope = s_a / s_aa, 0.0
    elif latency < 0:
        latency, slope = 0.0, s_b / s_bb
    bandwidth = factor / slope if slope > 0 else float("inf")
    return CollectiveCost(latency_s=latency, bandwidth_bytes_per_s=bandwidth)


def fit_pipeline_runtime(step_s: dict[int, float], p2p_s: float, stages: int = 2) -> tuple[float, float]:
    """The pipeline runtime's time per chunk action and per step, from steps of stages that compute nothing.

    ``step_s`` maps two or more micro-batch counts to the measured 1F1B step of ``stages``
    stages with no computation, whose messages each take ``p2p_s`` on the wire. The action
    time is the one for which the schedule simulator, given forward and backward chunks of
    that length, reproduces how the step grows from the fewest micro-batches to the most;
    the per-step time is what the fewest micro-batches' step leaves beyond the simulation.
    Returns ``(action_s, step_s)``, both >= 0.
    """
    if len(step_s) < 2 or any(count < 1 for count in step_s):
        raise ValueError(f"fit_pipeline_runtime needs steps at two or more micro-batch counts >= 1, got {step_s}")
    if any(seconds < 0 for seconds in step_s.values()) or p2p_s < 0:
        raise ValueError(f"fit_pipeline_runtime needs times >= 0, got steps {step_s} and p2p_s={p2p_s}")
    fewest, most = min(step_s), max(step_s)

    def simulated(count: int, action_s: float) -> float:
        return simulate_schedule([action_s] * stages, [action_s] * stages, count, "1f1b", p2p_s).iteration_s

    def simulated_growth(action_s: float) -> float:
        return simulated(most, action_s) - simulated(fewest, action_s)

    growth = step_s[most] - step_s[fewest]
    low, high = 0.0, 0.0
    if simulated_growth(0.0) < growth:
        high = growth  # each added micro-batch adds at least two actions, so this is an upper bound
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if simulated_growth(middle) < growth else (low, middle)
    return high, max(0.0, step_s[fewest] - simulated(fewest, high))


@dataclass(frozen=True)
class NetworkProfile:
    """Measured collective costs: all-reduce per group size (links differ by size), and the pipeline p2p link.

    ``gradient_sync`` (optional, per data-parallel group size) is the whole data-parallel
    gradient synchronisation as the runtime performs it (flatten, all-reduce, average, copy
    back), as latency plus gradient bytes over an effective bandwidth; without it the plain
    all-reduce cost stands in. ``pipeline_action_s`` is what the pipeline runtime itself
    spends on each forward or backward chunk of a stage beyond its computation and the wire
    (running the schedule, posting and completing the chunk's sends and receives), and
    ``pipeline_step_s`` what it spends once per step (:func:`fit_pipeline_runtime`). ``all_to_all``
    (optional, per expert group size) is the expert group's link for the MoE token exchange, as the
    bytes one rank sends; without it the all-reduce link of that group size stands in.
    """

    all_reduce: dict[int, CollectiveCost]
    p2p: CollectiveCost
    gradient_sync: dict[int, CollectiveCost] = field(default_factory=dict)
    pipeline_action_s: float = 0.0
    pipeline_step_s: float = 0.0
    all_to_all: dict[int, CollectiveCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_non_negative("NetworkProfile", pipeline_action_s=self.pipeline_action_s,
                            pipeline_step_s=self.pipeline_step_s)
        bad_sizes = [size for size in self.all_reduce if size < 2]
        if bad_sizes:
            raise ValueError(
                f"NetworkProfile.all_reduce is keyed by group sizes >= 2 (a single rank needs no collective), "
                f"got {sorted(bad_sizes)}"
            )

    def all_reduce_s(self, nbytes: float, ranks: int) -> float:
        """All-reduce time over a group of ``ranks``, from the cost measured for that group size."""
        if ranks == 1:
            return 0.0
        if ranks not in self.all_reduce:
            raise ValueError(
                f"the network profile has no all-reduce cost for groups of {ranks} ranks "
                f"(measured: {sorted(self.all_reduce)}); profile all-reduce over {ranks} ranks"
            )
        return self.all_reduce[ranks].all_reduce_s(nbytes, ranks)

    def gradient_sync_s(self, nbytes: float, ranks: int) -> float:
        """Data-parallel gradient synchronisation of ``nbytes`` over ``ranks`` replicas."""
        if ranks == 1:
            return 0.0
        if ranks in self.gradient_sync:
            return self.gradient_sync[ranks].send_s(nbytes)
        return self.all_reduce_s(nbytes, ranks)

    def all_to_all_link(self, ranks: int) -> CollectiveCost:
        """The link an all-to-all over ``ranks`` runs on: measured, else the all-reduce link of that group size."""
        if ranks in self.all_to_all:
            return self.all_to_all[ranks]
        if ranks not in self.all_reduce:
            raise ValueError(f"the network profile has no all-to-all or all-reduce cost for groups of {ranks} ranks "
                             f"(measured: {sorted(self.all_to_all)}, {sorted(self.all_reduce)}); profile one")
        return self.all_reduce[ranks]


@dataclass(frozen=True)
class BlockTimes:
    """Compute time of one transformer block on one rank, split at its tensor-parallel collectives.

    Forward: (attention part, MLP part), each ending where an all-reduce of the block's hidden
    state follows when tp > 1. Backward, in execution order: (MLP part, attention part), each
    ending where the all-reduce of its input gradient follows.
    """

    forward_segments_s: tuple[float, ...]
    backward_segments_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.forward_segments_s or not self.backward_segments_s:
            raise ValueError("BlockTimes needs at least one forward and one backward segment")
        for name in ("forward_segments_s", "backward_segments_s"):
            if any(value < 0 for value in getattr(self, name)):
                raise ValueError(f"BlockTimes: every entry of {name} must be >= 0, got {getattr(self, name)}")

    @property
    def forward_s(self) -> float:
        return sum(self.forward_segments_s)


@dataclass(frozen=True)
class MeasuredBlocks:
    """Time through real tensor-parallel blocks on one rank: collectives and sub-batch turns included.

    Measured over regions of one and of several blocks, so a region of ``n`` blocks costs the
    first block (which carries the sub-batch pipeline's fill and drain) plus ``n - 1`` times
    each further one. This is what the runtime actually pays, where the modelled chain
    (:class:`BlockTimes` plus an all-reduce cost) misses contention between computation and
    communication on shared cores, the layers' own overhead, and the turn switches.
    """

    forward_first_s: float
    forward_next_s: float
    backward_first_s: float
    backward_next_s: float

    def __post_init__(self) -> None:
        _check_non_negative(
            "MeasuredBlocks", forward_first_s=self.forward_first_s, forward_next_s=self.forward_next_s,
            backward_first_s=self.backward_first_s, backward_next_s=self.backward_next_s,
        )

    def forward_s(self, num_blocks: int) -> float:
        return self.forward_first_s + (num_blocks - 1) * self.forward_next_s if num_blocks else 0.0

    def backward_s(self, num_blocks: int) -> float:
        return self.backward_first_s + (num_blocks - 1) * self.backward_next_s if num_blocks else 0.0


@dataclass(frozen=True)
class ModelProfile:
    """What one model costs per rank, at the tensor-parallel degrees and sub-batch sizes the search needs.

    ``hidden_bytes_per_sample`` is one sample's hidden state (seq x hidden x dtype bytes): the size
    per sample of every tensor-parallel all-reduce and of the send between pipeline stages.
    ``block_times`` is keyed by (tp, samples per sub-batch); ``prefix_times`` and ``suffix_times``
    (embedding; final norm and LM head, never tensor-parallel) by samples, as (forward_s, backward_s).
    Parameter and activation bytes are those held by one rank; activation bytes are what one
    block saves for backward per sample without recompute. The optimizer step takes
    ``optimizer_s_per_parameter_byte`` per parameter byte. Each parameter byte also brings
    ``gradient_bytes_per_parameter_byte`` of gradient, ``optimizer_bytes_per_parameter_byte`` of
    optimizer state (two Adam moments in the parameters' dtype by default) and, under
    ``*-mixed`` precision, ``compute_copy_bytes_per_parameter_byte`` for the 16-bit copies autocast
    makes of the parameters in use (the parameters themselves are then the fp32 master weights).

    Optional measurements of the real runtime refine the model where present:
    ``measured_blocks`` by (tp, overlap, samples per micro-batch) for tp > 1, and
    ``block_optimizer_s`` by tp, the optimizer step over one block's (sharded) parameters;
    ``loss_times`` by samples per micro-batch, the training loss on the model's output as
    (forward_s, backward_s), paid once per micro-batch on the last stage (a profile without
    it, such as one written by hand, predicts no loss cost). ``block_sequence_split_bytes_per_sample``
    by tp is the part of the activation bytes saved outside the split layers (norms, residuals,
    the column layers' inputs): sequence parallelism splits it over tp (a profile without it
    prices sequence parallelism's memory as plain tensor parallelism's). Gradient clipping by
    norm (read only when the search space clips) takes ``block_clip_s`` by tp over one block's
    (sharded) gradients and ``clip_s_per_parameter_byte`` over the rest: the norm's pass and the
    scaling pass, as when clipping takes effect. ``prefix_update_s`` and ``suffix_update_s``,
    where measured, are (optimizer step, clipping passes) over the embedding's and the head's
    own parameters: per byte, a large embedding table's update can cost several times a block's
    (each step writes temporaries of the whole table), so the per-byte figures stand in only
    where these are absent. ``experts`` describes MoE layers run expert parallel (``merak_ep``):
    their token exchange and the experts each rank keeps (:mod:`.experts`). ``context`` is the attention shape
    context parallelism exchanges (:mod:`.context`), needed only to price ``cp > 1``; where measured,
    ``attention_kernel_times`` by (tp, samples) is the model's attention kernel over the whole sequence in one
    layer and ``context_kernel_times`` by (cp, method, tp, samples) one context rank's attention compute in its
    place, both (forward_s, backward_s) (:mod:`lightning_merak.planning.measure.context`).
    ``carried_bytes_per_sample[b]`` (``num_blocks + 1`` entries, or none) is what a stage boundary in front of block
    ``b`` sends per sample beside the hidden state: the skip values crossing it (a tensor a later block reads that
    an earlier block returned, :class:`~lightning_merak.parallel.pipeline.recording.SkipValue`).
    ``loss_saved_bytes_per_sample`` is what the training loss saves for backward per sample (a language model's
    fp32 log-probabilities over the vocabulary: often more than all its blocks save); 0 predicts no loss memory.
    ``block_trainable_bytes`` by tp, ``prefix_trainable_bytes`` and ``suffix_trainable_bytes`` are the parameter
    bytes that train (adapters included): only they take gradients, optimizer state, gradient synchronisation and
    the optimizer step; absent, every parameter trains.
    """

    num_blocks: int
    hidden_bytes_per_sample: int
    block_times: dict[tuple[int, int], BlockTimes]
    prefix_times: dict[int, tuple[float, float]]
    suffix_times: dict[int, tuple[float, float]]
    block_parameter_bytes: dict[int, int]
    prefix_parameter_bytes: int
    suffix_parameter_bytes: int
    block_activation_bytes_per_sample: dict[int, int]
    optimizer_s_per_parameter_byte: float
    gradient_bytes_per_parameter_byte: float = 1.0
    optimizer_bytes_per_parameter_byte: float = 2.0
    compute_copy_bytes_per_parameter_byte: float = 0.0
    measured_blocks: dict[tuple[int, int, int], MeasuredBlocks] = field(default_factory=dict)
    block_optimizer_s: dict[int, float] = field(default_factory=dict)
    loss_times: dict[int, tuple[float, float]] = field(default_factory=dict)
    block_sequence_split_bytes_per_sample: dict[int, int] = field(default_factory=dict)
    block_clip_s: dict[int, float] = field(default_factory=dict)
    clip_s_per_parameter_byte: float = 0.0
    prefix_update_s: tuple[float, float] | None = None
    suffix_update_s: tuple[float, float] | None = None
    experts: ExpertLayers | None = None
    context: ContextAttention | None = None
    attention_kernel_times: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    context_kernel_times: dict[tuple[int, str, int, int], tuple[float, float]] = field(default_factory=dict)
    carried_bytes_per_sample: tuple[int, ...] = ()
    loss_saved_bytes_per_sample: int = 0
    block_trainable_bytes: dict[int, int] = field(default_factory=dict)
    prefix_trainable_bytes: int | None = None
    suffix_trainable_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_positive("ModelProfile", num_blocks=self.num_blocks)
        carried = self.carried_bytes_per_sample
        if carried and (len(carried) != self.num_blocks + 1 or min(carried) < 0):
            raise ValueError(f"ModelProfile.carried_bytes_per_sample needs num_blocks + 1 = {self.num_blocks + 1} "
                             f"entries >= 0 (one per place a cut can be), got {carried}")
        _check_non_negative(
            "ModelProfile",
            hidden_bytes_per_sample=self.hidden_bytes_per_sample,
            prefix_parameter_bytes=self.prefix_parameter_bytes,
            suffix_parameter_bytes=self.suffix_parameter_bytes,
            optimizer_s_per_parameter_byte=self.optimizer_s_per_parameter_byte,
            gradient_bytes_per_parameter_byte=self.gradient_bytes_per_parameter_byte,
            optimizer_bytes_per_parameter_byte=self.optimizer_bytes_per_parameter_byte,
            compute_copy_bytes_per_parameter_byte=self.compute_copy_bytes_per_parameter_byte,
            clip_s_per_parameter_byte=self.clip_s_per_parameter_byte,
            loss_saved_bytes_per_sample=self.loss_saved_bytes_per_sample,
        )
        for name, trainable, total in (
            ("prefix_trainable_bytes", self.prefix_trainable_bytes, self.prefix_parameter_bytes),
            ("suffix_trainable_bytes", self.suffix_trainable_bytes, self.suffix_parameter_bytes),
            *((f"block_trainable_bytes[{tp}]", trainable, self.block_parameter_bytes.get(tp, 0))
              for tp, trainable in self.block_trainable_bytes.items())):
            if trainable is not None and not 0 <= trainable <= total:
                raise ValueError(f"ModelProfile.{name}={trainable} must be within [0, {total}], the parameter bytes")
        for name in ("prefix_update_s", "suffix_update_s"):
            times = getattr(self, name)
            if times is not None and (len(times) != 2 or min(times) < 0):
                raise ValueError(f"ModelProfile.{name} must be (optimizer_s, clip_s), both >= 0, got {times}")
        for name in ("prefix_times", "suffix_times", "loss_times", "attention_kernel_times", "context_kernel_times"):
            for samples, times in getattr(self, name).items():
                if len(times) != 2 or min(times) < 0:
                    raise ValueError(
                        f"ModelProfile.{name}[{samples}] must be (forward_s, backward_s), both >= 0, got {times}"
                    )

    def block_times_at(self, tp: int, samples: int) -> BlockTimes:
        return _lookup(self.block_times, (tp, samples), "block_times", "(tp, samples)")

    def prefix_times_at(self, samples: int) -> tuple[float, float]:
        return _lookup(self.prefix_times, samples, "prefix_times", "samples")

    def suffix_times_at(self, samples: int) -> tuple[float, float]:
        return _lookup(self.suffix_times, samples, "suffix_times", "samples")

    def loss_times_at(self, samples: int) -> tuple[float, float]:
        """The loss on one micro-batch of ``samples``; zero when the profile measured no loss at all."""
        if not self.loss_times:
            return 0.0, 0.0
        return _lookup(self.loss_times, samples, "loss_times", "samples")

    def carried_bytes_at(self, block: int) -> int:
        """Skip-value bytes per sample a stage boundary in front of block ``block`` sends (0 without skips)."""
        return self.carried_bytes_per_sample[block] if self.carried_bytes_per_sample else 0

    def block_clip_s_at(self, tp: int) -> float:
        return _lookup(self.block_clip_s, tp, "block_clip_s", "tp")

    def block_parameter_bytes_at(self, tp: int) -> int:
        return _lookup(self.block_parameter_bytes, tp, "block_parameter_bytes", "tp")

    def block_trainable_bytes_at(self, tp: int) -> int:
        """The bytes of one block's parameters on one rank that train (all of them when not profiled)."""
        if not self.block_trainable_bytes:
            return self.block_parameter_bytes_at(tp)
        return _lookup(self.block_trainable_bytes, tp, "block_trainable_bytes", "tp")

    def outside_trainable_bytes(self) -> tuple[int, int]:
        """``(prefix, suffix)`` parameter bytes that train (all of them when not profiled)."""
        return (self.prefix_parameter_bytes if self.prefix_trainable_bytes is None else self.prefix_trainable_bytes,
                self.suffix_parameter_bytes if self.suffix_trainable_bytes is None else self.suffix_trainable_bytes)

    def block_activation_bytes_at(self, tp: int, sequence_parallel: bool = False) -> int:
        """Bytes one block saves per sample on one rank; with ``sequence_parallel`` its sequence-split part is 1/tp."""
        saved = _lookup(self.block_activation_bytes_per_sample, tp, "block_activation_bytes_per_sample", "tp")
        if not sequence_parallel or tp == 1:
            return saved
        split = self.block_sequence_split_bytes_per_sample.get(tp, 0)
        if not 0 <= split <= saved:
            raise ValueError(f"ModelProfile.block_sequence_split_bytes_per_sample[{tp}]={split} must be within "
                             f"[0, {saved}], the block's activation bytes per sample")
        return saved - split + split // tp


def average_profiles(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """One profile from every rank's measurement of the same model: times averaged, sizes checked equal.

    Ranks profile at once, and on a shared machine their cores differ in speed from moment to
    moment (one block's time measured 25% apart on two ranks in the same second), while a
    layout's step runs on all of them; rank 0's figures alone would carry its core's luck.
    Saved-activation bytes, which data-dependent shapes can make differ between ranks, take
    the largest, so memory is planned for the fullest rank.
    """
    if not profiles:
        raise ValueError("average_profiles needs at least one profile")
    return _average(list(profiles), "ModelProfile")


_LARGEST_OF = ("block_activation_bytes_per_sample", "block_sequence_split_bytes_per_sample",
               "loss_saved_bytes_per_sample")


def _average(values: list[Any], where: str, largest: bool = False) -> Any:
    """The mean of measured times; sizes must agree, except those marked ``largest``, which take the maximum."""
    first = values[0]
    if isinstance(first, int) and largest:
        return max(values)
    if first is None or isinstance(first, int):
        if any(value != first for value in values):
            raise ValueError(f"{where} differs between the profiles ({values}); they must describe one model")
        return first
    if isinstance(first, float):
        return statistics.fmean(values)
    if isinstance(first, tuple):
        if len({len(value) for value in values}) != 1:
            raise ValueError(f"{where} has different lengths in the profiles: {values}")
        return tuple(_average(list(parts), f"{where}[{index}]", largest) for index, parts in enumerate(zip(*values)))
    if isinstance(first, dict):
        if any(value.keys() != first.keys() for value in values):
            raise ValueError(f"{where} has different keys in the profiles: {[sorted(v) for v in values]}")
        return {key: _average([value[key] for value in values], f"{where}[{key}]", largest) for key in first}
    if dataclasses.is_dataclass(first):
        return type(first)(**{f.name: _average([getattr(value, f.name) for value in values], f"{where}.{f.name}",
                                               f.name in _LARGEST_OF)
                              for f in dataclasses.fields(first)})
    raise TypeError(f"{where}: cannot average values of type {type(first).__name__}")


_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


def _lookup(table: dict[_Key, _Value], key: _Key, table_name: str, key_name: str) -> _Value:
    if key not in table:
        raise ValueError(
            f"the model profile has no {table_name} entry for {key_name}={key} (present: {sorted(table)}); "
            "profile the keys that required_profile_keys(space) lists"
        )
    return table[key]


@dataclass(frozen=True)
class SearchSpace:
    """The layouts the planner may choose from.

    ``micro_batch_choices=None`` allows every micro-batch count that divides the per-replica
    batch. ``recompute_ratios`` are first-stage ratios of stage-aware recompute (spec 1.4);
    a single-stage layout only takes 0 ("none") or 1 ("full"). ``memory_limit_bytes=None``
    means no limit. ``sequence_parallel`` runs every tensor-parallel layout sequence-parallel
    (less activation memory; its time comes from the profile, which must then be taken so).
    ``clip_gradients`` counts clipping by the global gradient norm in every step (as Lightning's
    ``gradient_clip_val`` with the "norm" algorithm): its passes over the gradients and a scalar
    all-reduce over the pipeline and the tensor-parallel groups. ``vocab_parallel`` splits the
    embedding and LM head (the parameters outside the blocks) over the tensor-parallel ranks.

    ``sharding_modes`` are the :data:`DATA_PARALLEL_SHARDING` modes searched together with the
    degrees (one fixed mode, or several for ``data_parallel_sharding="auto"``); ``shard_size``
    the ranks a shard group spans (hybrid sharding; None: every data-parallel rank).
    Gradients are reduced in collectives of ``grad_bucket_bytes`` (None: all in one, after the
    backward, the default of a hand-written space); ``overlap_grad_reduce`` hides that reduction
    behind the backward, bucket by bucket. ``ep_size`` is the expert-parallel size of a model with
    expert layers (``ModelProfile.experts``): each layout's ``ep``, None for its whole data-parallel
    group (merak3d's default); layouts whose dp it does not divide are left out.
    ``context_parallel_degrees`` are the context-parallel degrees searched (each sequence split over ``cp``
    ranks, world = dp x cp x pp x tp), with attention by each of ``context_attention_methods`` that the model's
    heads allow; a degree above 1 is searched with one stage and no sub-batches (as merak3d runs it).

    The batch is either ``global_batch_size`` (samples per step, split over the data-parallel
    replicas) or ``replica_batch_size`` (samples each replica trains on per step, as a
    Lightning dataloader's ``batch_size`` under merak3d: the global batch grows with dp). Give
    exactly one; layouts are ranked by time per sample, which is step time for a fixed batch.
    """

    world_size: int
    global_batch_size: int | None
    tp_degrees_allowed: tuple[int, ...]
    max_pipeline_stages: int
    micro_batch_choices: tuple[int, ...] | None = None
    overlap_choices: tuple[int, ...] = (1, 2, 4)
    recompute_ratios: tuple[float, ...] = (0.0, 0.5, 1.0)
    memory_limit_bytes: float | None = None
    schedule: str = "1f1b"
    replica_batch_size: int | None = None
    sequence_parallel: bool = False
    clip_gradients: bool = False
    vocab_parallel: bool = True
    sharding_modes: tuple[str, ...] = ("none",)
    shard_size: int | None = None
    overlap_grad_reduce: bool = False
    grad_bucket_bytes: float | None = None
    ep_size: int | None = 1
    context_parallel_degrees: tuple[int, ...] = (1,)
    context_attention_methods: tuple[str, ...] = CONTEXT_ATTENTION_METHODS
    vocab_stages_choices: tuple[bool, ...] = (False,)
    """Whether the LM head is split over the pipeline stages (``vocab_stages``), searched where a layout runs it
    (pp > 1, cp = 1, parameters not fully sharded; others keep it whole): ``(False, True)`` plans it."""
    embedding_splits_with_head: bool = True
    """Whether a split LM head takes the input embedding with it (a plain ``nn.Embedding``, or one tied to the head,
    under a schedule that splits it); otherwise the first stage keeps the embedding whole."""
    context_with_stages: bool = True
    """Whether a split sequence may also run in pipeline stages (cp > 1 with pp > 1): merak3d runs it for a module
    scoring ``CausalLMModule``'s loss without a router aux loss across stages."""

    def __post_init__(self) -> None:
        if (self.global_batch_size is None) == (self.replica_batch_size is None):
            raise ValueError("SearchSpace needs exactly one of global_batch_size and replica_batch_size")
        _check_positive(
            "SearchSpace",
            world_size=self.world_size,
            max_pipeline_stages=self.max_pipeline_stages,
            batch_size=self.global_batch_size or self.replica_batch_size,
        )
        for name in ("tp_degrees_allowed", "overlap_choices"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"SearchSpace.{name} needs at least one value, all >= 1, got {values}")
        if self.micro_batch_choices is not None and (not self.micro_batch_choices or min(self.micro_batch_choices) < 1):
            raise ValueError(
                f"SearchSpace.micro_batch_choices must be None or values >= 1, got {self.micro_batch_choices}"
            )
        if not self.recompute_ratios or not all(0.0 <= ratio <= 1.0 for ratio in self.recompute_ratios):
            raise ValueError(f"SearchSpace.recompute_ratios needs values in [0, 1], got {self.recompute_ratios}")
        if self.memory_limit_bytes is not None:
            _check_positive("SearchSpace", memory_limit_bytes=self.memory_limit_bytes)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"SearchSpace.schedule={self.schedule!r} is unknown; choose one of {SCHEDULES}")
        unknown = [mode for mode in self.sharding_modes if mode not in DATA_PARALLEL_SHARDING]
        if not self.sharding_modes or unknown:
            raise ValueError(f"SearchSpace.sharding_modes={self.sharding_modes} needs at least one mode, all from "
                             f"{DATA_PARALLEL_SHARDING}")
        if self.shard_size is not None:
            _check_positive("SearchSpace", shard_size=self.shard_size)
        if self.grad_bucket_bytes is not None:
            _check_positive("SearchSpace", grad_bucket_bytes=self.grad_bucket_bytes)
        if self.ep_size is not None:
            _check_positive("SearchSpace", ep_size=self.ep_size)
        if not self.context_parallel_degrees or min(self.context_parallel_degrees) < 1:
            raise ValueError(f"SearchSpace.context_parallel_degrees needs at least one value, all >= 1, got "
                             f"{self.context_parallel_degrees}")
        unknown = [m for m in self.context_attention_methods if m not in CONTEXT_ATTENTION_METHODS]
        if not self.context_attention_methods or unknown:
            raise ValueError(f"SearchSpace.context_attention_methods={self.context_attention_methods} needs at least "
                             f"one method, all from {CONTEXT_ATTENTION_METHODS}")

    def shards(self, mode: str, dp: int) -> int:
        """Ranks that split the state of ``mode`` over ``dp`` replicas: 1 when nothing is split."""
        if mode == "none" or dp == 1:
            return 1
        if self.shard_size is not None and dp % self.shard_size:
            raise ValueError(f"shard_size={self.shard_size} does not divide dp={dp}; data-parallel ranks = shard "
                             "size x replicas")
        return self.shard_size or dp

    def expert_parallel(self, dp: int) -> int | None:
        """The expert-parallel size of a layout with ``dp`` replicas, or None when it does not divide dp."""
        ep = dp if self.ep_size is None else self.ep_size
        return ep if dp % ep == 0 else None

    def replica_batch(self, dp: int) -> int | None:
        """Samples each of ``dp`` replicas trains on per step, or None when the batch does not split."""
        if self.replica_batch_size is not None:
            return self.replica_batch_size
        assert self.global_batch_size is not None
        return self.global_batch_size // dp if self.global_batch_size % dp == 0 else None
