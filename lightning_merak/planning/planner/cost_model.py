"""Predicted step time and peak memory of one data x pipeline x tensor-parallel layout.

The model composes the pipeline core: the proxy graph [prefix, block x n, suffix] is split
into stages (AutoPipe when there are several), each stage's forward and backward per
micro-batch come from real tensor-parallel blocks where the profile timed them (their time
includes whatever the runtime overlaps: sub-batches, and the column groups' input-gradient
all-reduce behind their weight gradients), else from the overlapped tensor-parallel chain
(:mod:`.overlap`), which knows sub-batches only and so leaves that backward all-reduce
exposed; with the pipeline runtime's own time per chunk added, the pipeline schedule
simulator turns those into an iteration. The data-parallel communication, clipping and the
optimizer step follow; the part of the communication hidden behind the backward (and, fully
sharded, the forward) is left out (:func:`data_parallel_s`). Per-rank memory counts what each
data-parallel sharding mode keeps (:func:`~.data_parallel.model_state_bytes`). MoE layers run expert parallel add
their token exchange to each micro-batch and keep 1/ep of their experts (:mod:`.experts`). Context parallelism
gives each rank 1/cp of every sequence's work and activations and adds the attention exchange (:mod:`.context`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate

from lightning_merak.parallel.pipeline import (
    BlockCost,
    blocks_to_recompute,
    partition_autopipe,
    peak_inflight_microbatches,
    simulate_schedule,
    stage_aware_recompute_ratios,
)
from lightning_merak.planning.planner.context import context_rank_block, exchange_s
from lightning_merak.planning.planner.data_parallel import data_parallel_s, model_state_bytes
from lightning_merak.planning.planner.experts import stage_experts
from lightning_merak.planning.planner.overlap import OverlapResult, simulate_overlapped_chain
from lightning_merak.planning.planner.profile import (
    CONTEXT_ATTENTION_METHODS,
    DATA_PARALLEL_SHARDING,
    MeasuredBlocks,
    ModelProfile,
    NetworkProfile,
    SearchSpace,
)

COMPONENTS = ("compute", "exposed_tp_comm", "expert_all_to_all", "context_exchange", "vocab_exchange",
              "pipeline_runtime", "pipeline_bubble", "dp_allreduce", "grad_clip", "optimizer")
"""The parts a predicted step time is split into; they add up to the step time ("dp_allreduce": the exposed
data-parallel communication, whatever its collectives)."""
MEMORY_COMPONENTS = ("parameters", "gradients", "optimizer_state", "activations")
"""The parts of a rank's predicted peak memory; they add up to it."""


@dataclass(frozen=True)
class Layout:
    """One way to run the model: degrees, micro-batches per step, sub-batches per micro-batch, recompute,
    and what the data-parallel ranks shard (:data:`DATA_PARALLEL_SHARDING`).

    ``recompute_ratio`` is the first stage's ratio of stage-aware recompute (spec 1.4); with a
    single stage it must be 0 ("none") or 1 ("full"), the two modes the runtime has there. ``ep`` is
    the expert-parallel size of a model's MoE layers: ``ep`` of the dp ranks share out each stage's experts.
    ``cp`` ranks split each sequence (context parallelism, attention by ``context_attention``); ``dp`` counts
    batch replicas only, so the world is dp x cp x pp x tp and the data-parallel ranks (:attr:`data_parallel_ranks`,
    which gradients are averaged and state sharded over) are dp x cp. Context parallelism is priced with one stage
    and no sub-batches, as merak3d runs it.
    """

    dp: int
    pp: int
    tp: int
    micro_batches: int
    overlap: int
    recompute_ratio: float
    sharding: str = "none"
    ep: int = 1
    cp: int = 1
    context_attention: str = "ring"
    vocab_stages: bool = False
    """The LM head split by vocabulary rows over the pipeline ranks (merak3d's ``vocab_stages``)."""

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "micro_batches", "overlap", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"Layout.recompute_ratio must be in [0, 1], got {self.recompute_ratio}")
        if self.overlap > 1 and self.tp == 1:
            raise ValueError(f"overlap={self.overlap} needs tensor parallelism (tp > 1); use overlap=1 with tp=1")
        if self.pp == 1 and self.recompute_ratio not in (0.0, 1.0):
            raise ValueError(
                f"recompute_ratio={self.recompute_ratio} needs several pipeline stages; "
                "with pp=1 use 0 (no recompute) or 1 (full recompute)"
            )
        if self.pp > 1 and self.micro_batches < self.pp:
            raise ValueError(
                f"micro_batches={self.micro_batches} < pp={self.pp}; pipeline schedules need at least one "
                "micro-batch per stage"
            )
        if self.sharding not in DATA_PARALLEL_SHARDING:
            raise ValueError(f"Layout.sharding={self.sharding!r} is unknown; choose one of {DATA_PARALLEL_SHARDING}")
        if self.sharding == "full" and self.overlap > 1:
            raise ValueError(f"sharding='full' cannot run overlap={self.overlap} sub-batches (each would gather and "
                             "free the parameters on its own); use overlap=1")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} does not divide dp={self.dp}: experts are spread over data-parallel ranks; "
                             "choose a divisor of dp")
        if self.context_attention not in CONTEXT_ATTENTION_METHODS:
            raise ValueError(f"Layout.context_attention={self.context_attention!r} is unknown; choose one of "
                             f"{CONTEXT_ATTENTION_METHODS}")
        if self.cp > 1 and self.ep > 1:
            raise ValueError(f"cp={self.cp} runs with ep=1 (as merak3d's context parallelism does), got ep={self.ep}")
        if self.cp == 1 and self.context_attention != "ring":
            raise ValueError("context_attention chooses how a split sequence attends; with cp=1 leave it 'ring'")
        if self.vocab_stages and (self.pp == 1 or self.sharding == "full"):
            raise ValueError(f"vocab_stages splits the LM head over pipeline stages (pp > 1) without full sharding, "
                             f"got pp={self.pp}, sharding={self.sharding!r}")

    @property
    def data_parallel_ranks(self) -> int:
        """Ranks holding the same parameters: batch replicas x context ranks."""
        return self.dp * self.cp

    @property
    def tie_break_key(self) -> tuple[int, int, int, int, int, float, int, int, int, bool]:
        """Order among equally fast layouts: less context parallelism, fewer stages, less TP, fewer micro-batches,
        less overlap and recompute, less sharding, smaller expert groups, ring before all-to-all, the head whole."""
        return (self.cp, self.pp, self.tp, self.micro_batches, self.overlap, self.recompute_ratio,
                DATA_PARALLEL_SHARDING.index(self.sharding), self.ep,
                CONTEXT_ATTENTION_METHODS.index(self.context_attention), self.vocab_stages)

    def describe(self) -> str:
        sharding = "" if self.sharding == "none" else f" sharding={self.sharding}"
        experts = "" if self.ep == 1 else f" ep={self.ep}"
        context = "" if self.cp == 1 else f" cp={self.cp} ({self.context_attention})"
        vocab = " vocab_stages" if self.vocab_stages else ""
        return (
            f"dp={self.dp}{context} pp={self.pp} tp={self.tp} micro_batches={self.micro_batches} "
            f"overlap={self.overlap} recompute_ratio={self.recompute_ratio:g}{sharding}{experts}{vocab}"
        )


@dataclass(frozen=True)
class Prediction:
    """Predicted cost of a layout: step time, its parts (:data:`COMPONENTS`), and peak bytes on the fullest rank
    with their parts (:data:`MEMORY_COMPONENTS`)."""

    layout: Layout
    step_time_s: float
    samples_per_step: int
    memory_bytes: float
    components: dict[str, float]
    fits: bool
    memory_components: dict[str, float] = field(default_factory=dict)

    @property
    def time_per_sample_s(self) -> float:
        """What the search minimises: step time for a fixed batch, inverse throughput when dp changes it."""
        return self.step_time_s / self.samples_per_step


def micro_batch_samples(layout: Layout, space: SearchSpace) -> int:
    """Samples per micro-batch, with a clear error when the batch does not split evenly."""
    per_replica = space.replica_batch(layout.dp)
    if per_replica is None:
        raise ValueError(
            f"global_batch_size={space.global_batch_size} is not divisible by dp={layout.dp}; "
            "choose a batch that every data-parallel replica gets an equal share of"
        )
    if per_replica % layout.micro_batches:
        raise ValueError(
            f"the per-replica batch {per_replica} is not divisible by micro_batches={layout.micro_batches}; "
            "choose micro_batches dividing it"
        )
    samples = per_replica // layout.micro_batches
    if samples % layout.overlap:
        raise ValueError(
            f"a micro-batch of {samples} samples does not split into overlap={layout.overlap} equal sub-batches; "
            "choose an overlap dividing it"
        )
    return samples


@dataclass(frozen=True)
class _Stage:
    """Which nodes of [prefix, block x n, suffix] a pipeline stage holds."""

    has_prefix: bool
    num_blocks: int
    has_suffix: bool


@lru_cache(maxsize=4096)
def _chain(segments: tuple[float, ...], comm_s: float, k: int) -> OverlapResult:
    return simulate_overlapped_chain(segments, comm_s, k)


@lru_cache(maxsize=4096)
def _iteration_s(
    forward_s: tuple[float, ...], backward_s: tuple[float, ...], micro_batches: int, schedule: str,
    p2p_s: tuple[float, ...],
) -> float:
    return simulate_schedule(forward_s, backward_s, micro_batches, schedule, p2p_s).iteration_s


def _chain_segments(
    head_s: float, block_segments_s: tuple[float, ...], num_blocks: int, tail_s: float
) -> tuple[float, ...]:
    """Segments of one sub-batch through a stage: ``head_s`` folds into the first, ``tail_s`` is the last.

    Every block segment ends with a collective, so the tail (after the last block's final
    collective) is a segment of its own, empty on a stage without the final nodes.
    """
    segments = []
    open_s = head_s
    for _ in range(num_blocks):
        for segment_s in block_segments_s:
            segments.append(open_s + segment_s)
            open_s = 0.0
    segments.append(open_s + tail_s)
    return tuple(segments)


@lru_cache(maxsize=1024)
def _split_block_counts(nodes: tuple[BlockCost, ...], num_stages: int, micro_batches: int,
                        vocab_stages: bool = False, embedding_splits: bool = True) -> tuple[_Stage, ...]:
    """AutoPipe's split of [prefix, block x n, suffix], as the runtime computes it (no recompute, no p2p term); with
    ``vocab_stages`` every stage runs its share of the suffix (the LM head), and of the prefix (the embedding)
    where ``embedding_splits``, and the last (first) keeps the node."""
    partition = partition_autopipe(list(nodes), num_stages, micro_batches, vocab_stages=vocab_stages,
                                   split_embedding=embedding_splits)
    stages = []
    for stage in range(num_stages):
        nodes_of_stage = partition.blocks_of(stage, len(nodes))
        has_prefix = nodes_of_stage.start == 0
        has_suffix = nodes_of_stage.stop == len(nodes)
        stages.append(_Stage(has_prefix, len(nodes_of_stage) - has_prefix - has_suffix, has_suffix))
    return tuple(stages)


def _stages(layout: Layout, profile: ModelProfile, samples: int, comm_s: float, vocab_parallel: bool,
            embedding_splits: bool = True) -> tuple[_Stage, ...]:
    """The pipeline split: one stage holds everything; several come from AutoPipe over per-node costs.

    A block's cost is its share of the whole model's overlapped chain, so the split sees
    exposed communication; prefix and suffix cost their compute over all sub-batches.
    """
    num_blocks = profile.num_blocks
    if layout.pp == 1:
        return (_Stage(True, num_blocks, True),)
    sub = samples // layout.overlap
    measured = _measured_blocks(layout, profile, samples)
    if measured is not None:
        block_forward_s = measured.forward_s(num_blocks) / num_blocks
        block_backward_s = measured.backward_s(num_blocks) / num_blocks
    else:
        block_times = profile.block_times_at(layout.tp, sub)
        whole_forward, whole_backward = (
            _chain(_chain_segments(0.0, segments_s, num_blocks, 0.0), comm_s, layout.overlap)
            for segments_s in (block_times.forward_segments_s, block_times.backward_segments_s)
        )
        block_forward_s, block_backward_s = whole_forward.time_s / num_blocks, whole_backward.time_s / num_blocks
    prefix_forward, prefix_backward = profile.prefix_times_at(sub)
    suffix_forward, suffix_backward = profile.suffix_times_at(sub)
    hidden_bytes = profile.hidden_bytes_per_sample * samples
    blocks = [BlockCost(
        name=f"block.{index}",
        forward_s=block_forward_s,
        backward_s=block_backward_s,
        param_bytes=profile.block_parameter_bytes_at(layout.tp),
        output_bytes=hidden_bytes + profile.carried_bytes_at(index + 1) * samples,
        saved_bytes=profile.block_activation_bytes_at(layout.tp) * samples,
    ) for index in range(num_blocks)]
    prefix = BlockCost(
        name="prefix",
        forward_s=layout.overlap * prefix_forward,
        backward_s=layout.overlap * prefix_backward,
        param_bytes=_outside_parameter_bytes(profile, layout.tp, vocab_parallel)[0],
        output_bytes=hidden_bytes,
        saved_bytes=0,
        is_embedding=True,
    )
    suffix = BlockCost(
        name="suffix",
        forward_s=layout.overlap * suffix_forward,
        backward_s=layout.overlap * suffix_backward,
        param_bytes=_outside_parameter_bytes(profile, layout.tp, vocab_parallel)[1],
        output_bytes=0,
        saved_bytes=0,
    )
    return _split_block_counts((prefix, *blocks, suffix), layout.pp, layout.micro_batches, layout.vocab_stages,
                               embedding_splits)


def _outside_parameter_bytes(profile: ModelProfile, tp: int, vocab_parallel: bool,
                             trainable: bool = False) -> tuple[int, int]:
    """``(prefix, suffix)`` parameter bytes per rank (only those that train with ``trainable``): vocabulary
    parallelism splits the embedding and the LM head over the tensor-parallel ranks (both counted as split: their
    vocabulary matrices dominate them)."""
    prefix, suffix = (profile.outside_trainable_bytes() if trainable
                      else (profile.prefix_parameter_bytes, profile.suffix_parameter_bytes))
    if not vocab_parallel:
        return prefix, suffix
    return -(-prefix // tp), -(-suffix // tp)


def _measured_blocks(layout: Layout, profile: ModelProfile, samples: int) -> MeasuredBlocks | None:
    """The real runtime's measured block times for this layout, when the profile has them (tp > 1 only)."""
    if layout.tp == 1:
        return None
    return profile.measured_blocks.get((layout.tp, layout.overlap, samples))


def _outside_blocks_s(profile: ModelProfile, stage: _Stage, part: int, per_byte_s: float,
                      shares: tuple[float, float]) -> float:
    """Part ``part`` (0: optimizer step, 1: clipping passes) of the update of the embedding and head parts a stage
    holds (``shares``: :func:`_vocabulary_shares`); the measured figures step only what trains, and so does the
    per-byte estimate."""
    total = 0.0
    for held, measured, parameter_bytes in zip(shares, (profile.prefix_update_s, profile.suffix_update_s),
                                               profile.outside_trainable_bytes()):
        total += held * (measured[part] if measured is not None else per_byte_s * parameter_bytes)
    return total


def _vocabulary_shares(layout: Layout, stage: _Stage, embedding_splits: bool) -> tuple[float, float]:
    """``(embedding, head)``: the fraction of the input embedding and of the LM head ``stage`` holds and runs. Under
    ``vocab_stages`` every stage holds 1/pp of the head, and of the embedding where it splits with the head
    (``embedding_splits``; otherwise the first stage keeps it whole); else the first and last stage hold them."""
    split = 1.0 / layout.pp if layout.vocab_stages else None
    head = float(stage.has_suffix) if split is None else split
    embedding = split if split is not None and embedding_splits else float(stage.has_prefix)
    return embedding, head


def _block_trainable_fraction(profile: ModelProfile, tp: int) -> float:
    """The share of a block's parameter bytes that trains: what its measured update and clipping are scaled by
    (they were timed with every parameter of the block training)."""
    return profile.block_trainable_bytes_at(tp) / max(1, profile.block_parameter_bytes_at(tp))


def _optimizer_s(layout: Layout, profile: ModelProfile, stage: _Stage, trainable_bytes: float,
                 shares: tuple[float, float]) -> float:
    """Optimizer step of one stage over what trains: measured per block and on the embedding and head where
    profiled, per byte otherwise.
    """
    per_block = profile.block_optimizer_s.get(layout.tp)
    if per_block is None:
        return profile.optimizer_s_per_parameter_byte * trainable_bytes
    return (stage.num_blocks * per_block * _block_trainable_fraction(profile, layout.tp)
            + _outside_blocks_s(profile, stage, 0, profile.optimizer_s_per_parameter_byte, shares))


def _clip_s(layout: Layout, profile: ModelProfile, network: NetworkProfile, stage: _Stage, shards: int,
            shares: tuple[float, float]) -> float:
    """Clipping by the global norm on one stage: the passes over its gradients (this rank's 1/``shards`` of them
    when sharded), and the norm's scalar all-reduces (over the shard group too)."""
    passes_s = (stage.num_blocks * profile.block_clip_s_at(layout.tp) * _block_trainable_fraction(profile, layout.tp)
                + _outside_blocks_s(profile, stage, 1, profile.clip_s_per_parameter_byte, shares))
    scalar_bytes = 8
    return (passes_s / shards + network.all_reduce_s(scalar_bytes, layout.pp)
            + network.all_reduce_s(scalar_bytes, layout.tp) + network.all_reduce_s(scalar_bytes, shards))


def _check_against_space(layout: Layout, profile: ModelProfile, space: SearchSpace) -> None:
    if layout.dp * layout.cp * layout.pp * layout.tp != space.world_size:
        raise ValueError(
            f"dp={layout.dp} x cp={layout.cp} x pp={layout.pp} x tp={layout.tp} != world_size={space.world_size}; "
            "choose degrees whose product is the world size"
        )
    if layout.cp > 1 and profile.context is None:
        raise ValueError(f"cp={layout.cp} needs the attention shape the exchange moves (ModelProfile.context); "
                         "profile it, or plan without context parallelism")
    if layout.pp > profile.num_blocks + 2:
        raise ValueError(
            f"pp={layout.pp} exceeds the {profile.num_blocks + 2} nodes (prefix, {profile.num_blocks} blocks, suffix); "
            f"use pp <= {profile.num_blocks + 2}"
        )
    space.shards(layout.sharding, layout.data_parallel_ranks)  # refuses a shard size that does not divide them


def predict(layout: Layout, model_profile: ModelProfile, network: NetworkProfile, space: SearchSpace) -> Prediction:
    """Step time (pipeline iteration + exposed data-parallel communication + clipping + optimizer)
    and peak memory per rank (:func:`model_state_bytes` plus activations).

    A sharded mode steps the optimizer and clips over this rank's 1/S of the parameters.

    Where the profile holds measured real tensor-parallel blocks for the layout, they replace
    the simulated chain (the simulated compute stays the "compute" component, the rest is
    exposed communication and runtime overhead).
    The last stage adds the training loss once per micro-batch (never split into sub-batches).
    Recomputed blocks add their forward compute, never their collectives, to the backward,
    and keep only their input plus the post-collective outputs the runtime caches (those exist
    only with tp > 1). With ``space.sequence_parallel`` a tensor-parallel block saves its
    sequence-split activations (and a recomputed one its input) for 1/tp of the sequence.
    The stage(s) holding the LM head keep what the loss saves (``model_profile.loss_saved_bytes_per_sample``, its
    vocabulary share on the stage, 1/tp of it with ``space.vocab_parallel``, 1/cp with context parallelism) per
    micro-batch in flight on the last stage, and one more such buffer at the peak (the loss backward's gradient);
    a recomputed block's rebuilt activations peak later in the backward, and the larger of the two counts.
    Only the parameters that train (``model_profile.block_trainable_bytes`` and its kin) take gradients, optimizer
    state, gradient synchronisation and the optimizer step; blocks that all are frozen behind a frozen embedding
    save no activations (nothing before them needs a gradient). Other prefix and suffix activations are not counted;
    skip values a stage receives
    (``model_profile.carried_bytes_per_sample``) are, held per in-flight micro-batch, and every cut's send
    is priced with the skip values crossing it beside the hidden state. With several stages every forward and
    backward chunk also pays the pipeline runtime's own time (``network.pipeline_action_s``), and
    the step its per-step time: the "pipeline_runtime" component. MoE layers run expert parallel
    (``model_profile.experts``) add their exchange to each micro-batch's forward and backward (the
    "expert_all_to_all" component, on the expert group's link), keep 1/ep of their experts, and
    sum the expert gradients over the dp/ep ranks holding the same experts after the backward.
    """
    _check_against_space(layout, model_profile, space)
    if model_profile.experts is not None and layout.sharding != "none":
        raise ValueError(f"sharding={layout.sharding!r} with expert-parallel MoE layers: merak_ep runs with "
                         "data_parallel_sharding='none' only; search sharding_modes=('none',)")
    samples = micro_batch_samples(layout, space)
    sub = samples // layout.overlap
    hidden_bytes = model_profile.hidden_bytes_per_sample
    share = 1.0 / layout.cp  # of every sequence's work, activations and messages, on one context rank
    comm_s = network.all_reduce_s(hidden_bytes * sub * share, layout.tp)
    ratios = stage_aware_recompute_ratios(layout.recompute_ratio, layout.pp)
    stages = _stages(layout, model_profile, samples, comm_s, space.vocab_parallel, space.embedding_splits_with_head)

    block_times, context_kernel_s, context_extra_s = context_rank_block(
        model_profile, model_profile.block_times_at(layout.tp, sub), layout.cp, layout.context_attention, layout.tp,
        sub)
    measured = _measured_blocks(layout, model_profile, samples)
    # each sub-batch exchanges its own rows in its turn, behind its own kernels only
    context_forward_s, context_backward_s = (
        (0.0, 0.0) if model_profile.context is None else (layout.overlap * seconds for seconds in exchange_s(
            model_profile.context, layout.context_attention, layout.cp, layout.tp, sub, context_kernel_s, network)))
    block_parameter_bytes = model_profile.block_parameter_bytes_at(layout.tp)
    prefix_parameter_bytes, suffix_parameter_bytes = _outside_parameter_bytes(model_profile, layout.tp,
                                                                              space.vocab_parallel)
    block_trainable = _block_trainable_fraction(model_profile, layout.tp)
    prefix_trainable_bytes, suffix_trainable_bytes = _outside_parameter_bytes(model_profile, layout.tp,
                                                                              space.vocab_parallel, trainable=True)
    # the loss's saved logits live from the head's forward to its backward: per micro-batch in flight on the last
    # stage (whose schedule every stage's share of a split head follows), split over the head's vocabulary shares
    loss_in_flight = peak_inflight_microbatches(layout.pp - 1, layout.pp, layout.micro_batches, space.schedule)
    loss_saved_bytes = (model_profile.loss_saved_bytes_per_sample * samples * share
                        / (layout.tp if space.vocab_parallel else 1))
    sequence_split = space.sequence_parallel and layout.tp > 1
    # frozen blocks behind a frozen embedding see no input that needs a gradient: autograd saves nothing for them
    blocks_save = block_trainable > 0 or prefix_trainable_bytes > 0
    activation_bytes = model_profile.block_activation_bytes_at(layout.tp, sequence_split) if blocks_save else 0
    recomputed_input_bytes = (hidden_bytes // layout.tp if sequence_split else hidden_bytes) if blocks_save else 0
    # the recorded collective outputs a recomputed block replays: two all-reduces, or two
    # all-gathers (whole sequence) and two reduce-scatters (this rank's slice)
    recomputed_extra_bytes = (2 * hidden_bytes + 2 * hidden_bytes // layout.tp if sequence_split
                              else 2 * hidden_bytes if layout.tp > 1 else 0) if blocks_save else 0
    action_s, pipeline_step_s = ((network.pipeline_action_s, network.pipeline_step_s) if layout.pp > 1
                                 else (0.0, 0.0))
    shards = space.shards(layout.sharding, layout.data_parallel_ranks)
    forward_s, backward_s, compute_s, exposed_s, memory_bytes, after_pipeline_s = [], [], [], [], [], []
    expert_s: list[float] = []
    context_s: list[float] = []
    # under vocab_stages the last stage's final hidden state (this context rank's shard) is broadcast to every stage
    # and its gradient reduced back; a split embedding's looked-up rows (at most a hidden state's worth) come to the
    # first stage and go back
    vocab_exchanges = (1 + space.embedding_splits_with_head) if layout.vocab_stages else 0
    vocab_exchange_s = vocab_exchanges * network.all_reduce_s(hidden_bytes * samples * share, layout.pp)
    for index, stage in enumerate(stages):
        embedding_share, head_share = shares = _vocabulary_shares(layout, stage, space.embedding_splits_with_head)
        prefix_forward, prefix_backward = (share * seconds for seconds in (
            model_profile.prefix_times_at(sub) if stage.has_prefix else (0.0, 0.0)))
        suffix_forward, suffix_backward = (head_share * share * seconds
                                           for seconds in model_profile.suffix_times_at(sub))
        forward = _chain(
            _chain_segments(prefix_forward, block_times.forward_segments_s, stage.num_blocks, suffix_forward),
            comm_s,
            layout.overlap,
        )
        backward = _chain(
            _chain_segments(suffix_backward, block_times.backward_segments_s, stage.num_blocks, prefix_backward),
            comm_s,
            layout.overlap,
        )
        recomputed = blocks_to_recompute(stage.num_blocks, ratios[index])
        recompute_s = recomputed * layout.overlap * block_times.forward_s
        local_s = forward.compute_s + backward.compute_s + recompute_s
        if measured is not None:
            outside_s = layout.overlap * (prefix_forward + suffix_forward)
            forward_total = (outside_s + share * measured.forward_s(stage.num_blocks)
                             + layout.overlap * stage.num_blocks * context_extra_s[0])
            outside_s = layout.overlap * (prefix_backward + suffix_backward)
            backward_total = (outside_s + share * measured.backward_s(stage.num_blocks)
                              + layout.overlap * stage.num_blocks * context_extra_s[1] + recompute_s)
        else:
            forward_total, backward_total = forward.time_s, backward.time_s + recompute_s
        loss_forward, loss_backward = (head_share * share * seconds
                                       for seconds in model_profile.loss_times_at(samples))
        forward_total += loss_forward
        backward_total += loss_backward
        local_s += loss_forward + loss_backward
        compute_s.append(local_s)
        exposed_s.append(max(0.0, forward_total + backward_total - local_s))
        forward_total += vocab_exchange_s
        backward_total += vocab_exchange_s
        experts = stage_experts(model_profile.experts, layout.ep, layout.overlap, network,
                                sum(earlier.num_blocks for earlier in stages[:index]), stage.num_blocks,
                                model_profile.num_blocks, samples)
        forward_total += experts.forward_s
        backward_total += experts.backward_s
        expert_s.append(experts.forward_s + experts.backward_s)
        # a recomputed block's forward runs its exchange again inside the backward
        context_exchange = (stage.num_blocks * context_forward_s,
                            stage.num_blocks * context_backward_s + recomputed * context_forward_s)
        forward_total += context_exchange[0]
        backward_total += context_exchange[1]
        context_s.append(sum(context_exchange))
        forward_s.append(forward_total + action_s)
        backward_s.append(backward_total + action_s)

        parameter_bytes = round(
            embedding_share * prefix_parameter_bytes
            + stage.num_blocks * block_parameter_bytes
            + head_share * suffix_parameter_bytes
            - experts.dropped_bytes
        )
        trainable_bytes = (embedding_share * prefix_trainable_bytes
                           + block_trainable * (stage.num_blocks * block_parameter_bytes - experts.dropped_bytes)
                           + head_share * suffix_trainable_bytes)
        kept_per_sample = (
            (stage.num_blocks - recomputed) * activation_bytes
            + recomputed * (recomputed_input_bytes + recomputed_extra_bytes)
            # skip values received, held until the micro-batch's backward
            + model_profile.carried_bytes_at(sum(earlier.num_blocks for earlier in stages[:index]))
        )
        in_flight = peak_inflight_microbatches(index, layout.pp, layout.micro_batches, space.schedule)
        outside_bytes = round(embedding_share * prefix_parameter_bytes + head_share * suffix_parameter_bytes)
        memory = model_state_bytes(layout.sharding, shards, layout.pp > 1, parameter_bytes,
                                   2 * block_parameter_bytes + outside_bytes, space.grad_bucket_bytes, model_profile,
                                   trainable_bytes)
        # at the peak, beside what the micro-batches in flight keep: the loss backward's logits-sized gradient,
        # or (later in the backward, the logits freed) a recomputed block's activations rebuilt
        rebuilt_bytes = activation_bytes * samples * share if recomputed else 0.0
        memory["activations"] = (in_flight * samples * kept_per_sample * share
                                 + head_share * loss_in_flight * loss_saved_bytes
                                 + max(head_share * loss_saved_bytes, rebuilt_bytes))
        memory_bytes.append(memory)
        after_pipeline_s.append(
            (
                data_parallel_s(layout.data_parallel_ranks, layout.sharding, layout.pp > 1, space, network,
                                # full sharding gathers every parameter; the others move gradients only
                                (parameter_bytes if layout.sharding == "full" else trainable_bytes)
                                - experts.kept_bytes * block_trainable, block_parameter_bytes,
                                stage.num_blocks + 1, forward_total, backward_total)
                + (network.gradient_sync_s(experts.kept_bytes * block_trainable, layout.dp // layout.ep)
                   if experts.kept_bytes * block_trainable else 0.0),
                _clip_s(layout, model_profile, network, stage, shards, shares) if space.clip_gradients else 0.0,
                _optimizer_s(layout, model_profile, stage, trainable_bytes, shares) / shards,
            )
        )

    # each cut sends the hidden state and the skip values crossing it (a context rank's share of the sequence)
    cuts = list(accumulate(stage.num_blocks for stage in stages[:-1]))
    p2p_s = tuple(network.p2p.send_s((hidden_bytes + model_profile.carried_bytes_at(block)) * samples * share)
                  for block in cuts)
    iteration_s = _iteration_s(tuple(forward_s), tuple(backward_s), layout.micro_batches, space.schedule, p2p_s)
    busiest = max(range(len(stages)), key=lambda stage: (forward_s[stage] + backward_s[stage], -stage))
    slowest_update = max(range(len(stages)), key=lambda stage: (sum(after_pipeline_s[stage]), -stage))
    dp_allreduce_s, clip_s, optimizer_s = after_pipeline_s[slowest_update]
    components = {
        "compute": layout.micro_batches * compute_s[busiest],
        "exposed_tp_comm": layout.micro_batches * exposed_s[busiest],
        "expert_all_to_all": layout.micro_batches * expert_s[busiest],
        "context_exchange": layout.micro_batches * context_s[busiest],
        "vocab_exchange": layout.micro_batches * 2 * vocab_exchange_s,
        "pipeline_runtime": layout.micro_batches * 2 * action_s + pipeline_step_s,
        "pipeline_bubble": max(
            0.0, iteration_s - layout.micro_batches * (forward_s[busiest] + backward_s[busiest])
        ),
        "dp_allreduce": dp_allreduce_s,
        "grad_clip": clip_s,
        "optimizer": optimizer_s,
    }
    fullest = max(memory_bytes, key=lambda parts: sum(parts.values()))
    peak_bytes = sum(fullest.values())
    return Prediction(
        layout=layout,
        step_time_s=iteration_s + pipeline_step_s + dp_allreduce_s + clip_s + optimizer_s,
        samples_per_step=samples * layout.micro_batches * layout.dp,
        memory_bytes=peak_bytes,
        components=components,
        fits=space.memory_limit_bytes is None or peak_bytes <= space.memory_limit_bytes,
        memory_components={name: fullest[name] for name in MEMORY_COMPONENTS},
    )
