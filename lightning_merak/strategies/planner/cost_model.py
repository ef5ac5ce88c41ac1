"""Predicted step time and peak memory of one data x pipeline x tensor-parallel layout.

The model composes the pipeline core: the proxy graph [prefix, block x n, suffix] is split
into stages (AutoPipe when there are several), each stage's forward and backward per
micro-batch come from real tensor-parallel blocks where the profile timed them (their time
includes whatever the runtime overlaps: sub-batches, and the column groups' input-gradient
all-reduce behind their weight gradients), else from the overlapped tensor-parallel chain
(:mod:`.overlap`), which knows sub-batches only and so leaves that backward all-reduce
exposed; with the pipeline runtime's own time per chunk added, the pipeline schedule
simulator turns those into an iteration. The data-parallel gradient
all-reduce and the optimizer step follow, not overlapped with compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lightning_merak.strategies.pipeline import (
    BlockCost,
    blocks_to_recompute,
    partition_autopipe,
    peak_inflight_microbatches,
    simulate_schedule,
    stage_aware_recompute_ratios,
)
from lightning_merak.strategies.planner.overlap import OverlapResult, simulate_overlapped_chain
from lightning_merak.strategies.planner.profile import MeasuredBlocks, ModelProfile, NetworkProfile, SearchSpace

COMPONENTS = ("compute", "exposed_tp_comm", "pipeline_runtime", "pipeline_bubble", "dp_allreduce", "grad_clip",
              "optimizer")
"""The parts a predicted step time is split into; they add up to the step time."""


@dataclass(frozen=True)
class Layout:
    """One way to run the model: degrees, micro-batches per step, sub-batches per micro-batch, recompute.

    ``recompute_ratio`` is the first stage's ratio of stage-aware recompute (spec 1.4); with a
    single stage it must be 0 ("none") or 1 ("full"), the two modes the runtime has there.
    """

    dp: int
    pp: int
    tp: int
    micro_batches: int
    overlap: int
    recompute_ratio: float

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "micro_batches", "overlap"):
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

    @property
    def tie_break_key(self) -> tuple[int, int, int, int, float]:
        """Order among equally fast layouts: fewer stages, less TP, fewer micro-batches, less overlap and recompute."""
        return (self.pp, self.tp, self.micro_batches, self.overlap, self.recompute_ratio)

    def describe(self) -> str:
        return (
            f"dp={self.dp} pp={self.pp} tp={self.tp} micro_batches={self.micro_batches} "
            f"overlap={self.overlap} recompute_ratio={self.recompute_ratio:g}"
        )


@dataclass(frozen=True)
class Prediction:
    """Predicted cost of a layout: step time, its parts (:data:`COMPONENTS`), and peak bytes on the fullest rank."""

    layout: Layout
    step_time_s: float
    samples_per_step: int
    memory_bytes: float
    components: dict[str, float]
    fits: bool

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
    forward_s: tuple[float, ...], backward_s: tuple[float, ...], micro_batches: int, schedule: str, p2p_s: float
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
def _split_block_counts(nodes: tuple[BlockCost, ...], num_stages: int, micro_batches: int) -> tuple[_Stage, ...]:
    """AutoPipe's split of [prefix, block x n, suffix], as the runtime computes it (no recompute, no p2p term)."""
    partition = partition_autopipe(list(nodes), num_stages, micro_batches)
    stages = []
    for stage in range(num_stages):
        nodes_of_stage = partition.blocks_of(stage, len(nodes))
        has_prefix = nodes_of_stage.start == 0
        has_suffix = nodes_of_stage.stop == len(nodes)
        stages.append(_Stage(has_prefix, len(nodes_of_stage) - has_prefix - has_suffix, has_suffix))
    return tuple(stages)


def _stages(layout: Layout, profile: ModelProfile, samples: int, comm_s: float,
            vocab_parallel: bool) -> tuple[_Stage, ...]:
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
    block = BlockCost(
        name="block",
        forward_s=block_forward_s,
        backward_s=block_backward_s,
        param_bytes=profile.block_parameter_bytes_at(layout.tp),
        output_bytes=hidden_bytes,
        saved_bytes=profile.block_activation_bytes_at(layout.tp) * samples,
    )
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
    return _split_block_counts((prefix, *[block] * num_blocks, suffix), layout.pp, layout.micro_batches)


def _outside_parameter_bytes(profile: ModelProfile, tp: int, vocab_parallel: bool) -> tuple[int, int]:
    """``(prefix, suffix)`` parameter bytes per rank: vocabulary parallelism splits the embedding and the LM head
    over the tensor-parallel ranks (both counted as split: their vocabulary matrices dominate them)."""
    if not vocab_parallel:
        return profile.prefix_parameter_bytes, profile.suffix_parameter_bytes
    return -(-profile.prefix_parameter_bytes // tp), -(-profile.suffix_parameter_bytes // tp)


def _measured_blocks(layout: Layout, profile: ModelProfile, samples: int) -> MeasuredBlocks | None:
    """The real runtime's measured block times for this layout, when the profile has them (tp > 1 only)."""
    if layout.tp == 1:
        return None
    return profile.measured_blocks.get((layout.tp, layout.overlap, samples))


def _outside_blocks_s(profile: ModelProfile, stage: _Stage, part: int, per_byte_s: float) -> float:
    """Part ``part`` (0: optimizer step, 1: clipping passes) of the update of a stage's embedding and head."""
    total = 0.0
    for held, measured, parameter_bytes in (
        (stage.has_prefix, profile.prefix_update_s, profile.prefix_parameter_bytes),
        (stage.has_suffix, profile.suffix_update_s, profile.suffix_parameter_bytes),
    ):
        if held:
            total += measured[part] if measured is not None else per_byte_s * parameter_bytes
    return total


def _optimizer_s(layout: Layout, profile: ModelProfile, stage: _Stage, parameter_bytes: int) -> float:
    """Optimizer step of one stage: measured per block and on the embedding and head where profiled,
    per byte otherwise.
    """
    per_block = profile.block_optimizer_s.get(layout.tp)
    if per_block is None:
        return profile.optimizer_s_per_parameter_byte * parameter_bytes
    return stage.num_blocks * per_block + _outside_blocks_s(profile, stage, 0, profile.optimizer_s_per_parameter_byte)


def _clip_s(layout: Layout, profile: ModelProfile, network: NetworkProfile, stage: _Stage) -> float:
    """Clipping by the global norm on one stage: the passes over its gradients, and the norm's scalar all-reduces."""
    passes_s = (stage.num_blocks * profile.block_clip_s_at(layout.tp)
                + _outside_blocks_s(profile, stage, 1, profile.clip_s_per_parameter_byte))
    scalar_bytes = 8
    return passes_s + network.all_reduce_s(scalar_bytes, layout.pp) + network.all_reduce_s(scalar_bytes, layout.tp)


def _check_against_space(layout: Layout, profile: ModelProfile, space: SearchSpace) -> None:
    if layout.dp * layout.pp * layout.tp != space.world_size:
        raise ValueError(
            f"dp={layout.dp} x pp={layout.pp} x tp={layout.tp} != world_size={space.world_size}; "
            "choose degrees whose product is the world size"
        )
    if layout.pp > profile.num_blocks + 2:
        raise ValueError(
            f"pp={layout.pp} exceeds the {profile.num_blocks + 2} nodes (prefix, {profile.num_blocks} blocks, suffix); "
            f"use pp <= {profile.num_blocks + 2}"
        )


def predict(layout: Layout, model_profile: ModelProfile, network: NetworkProfile, space: SearchSpace) -> Prediction:
    """Step time (pipeline iteration + data-parallel gradient all-reduce + clipping + optimizer)
    and peak memory per rank.

    Where the profile holds measured real tensor-parallel blocks for the layout, they replace
    the simulated chain (the simulated compute stays the "compute" component, the rest is
    exposed communication and runtime overhead).
    The last stage adds the training loss once per micro-batch (never split into sub-batches).
    Recomputed blocks add their forward compute, never their collectives, to the backward,
    and keep only their input plus the post-collective outputs the runtime caches (those exist
    only with tp > 1). With ``space.sequence_parallel`` a tensor-parallel block saves its
    sequence-split activations (and a recomputed one its input) for 1/tp of the sequence.
    Prefix and suffix activations are not counted. With several stages every forward and
    backward chunk also pays the pipeline runtime's own time (``network.pipeline_action_s``), and
    the step its per-step time: the "pipeline_runtime" component.
    """
    _check_against_space(layout, model_profile, space)
    samples = micro_batch_samples(layout, space)
    sub = samples // layout.overlap
    hidden_bytes = model_profile.hidden_bytes_per_sample
    comm_s = network.all_reduce_s(hidden_bytes * sub, layout.tp)
    ratios = stage_aware_recompute_ratios(layout.recompute_ratio, layout.pp)
    stages = _stages(layout, model_profile, samples, comm_s, space.vocab_parallel)

    block_times = model_profile.block_times_at(layout.tp, sub)
    measured = _measured_blocks(layout, model_profile, samples)
    block_parameter_bytes = model_profile.block_parameter_bytes_at(layout.tp)
    prefix_parameter_bytes, suffix_parameter_bytes = _outside_parameter_bytes(model_profile, layout.tp,
                                                                              space.vocab_parallel)
    sequence_split = space.sequence_parallel and layout.tp > 1
    activation_bytes = model_profile.block_activation_bytes_at(layout.tp, sequence_split)
    recomputed_input_bytes = hidden_bytes // layout.tp if sequence_split else hidden_bytes
    # the recorded collective outputs a recomputed block replays: two all-reduces, or two
    # all-gathers (whole sequence) and two reduce-scatters (this rank's slice)
    recomputed_extra_bytes = (2 * hidden_bytes + 2 * hidden_bytes // layout.tp if sequence_split
                              else 2 * hidden_bytes if layout.tp > 1 else 0)
    action_s, pipeline_step_s = ((network.pipeline_action_s, network.pipeline_step_s) if layout.pp > 1
                                 else (0.0, 0.0))
    forward_s, backward_s, compute_s, exposed_s, memory_bytes, after_pipeline_s = [], [], [], [], [], []
    for index, stage in enumerate(stages):
        prefix_forward, prefix_backward = model_profile.prefix_times_at(sub) if stage.has_prefix else (0.0, 0.0)
        suffix_forward, suffix_backward = model_profile.suffix_times_at(sub) if stage.has_suffix else (0.0, 0.0)
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
            forward_total = outside_s + measured.forward_s(stage.num_blocks)
            outside_s = layout.overlap * (prefix_backward + suffix_backward)
            backward_total = outside_s + measured.backward_s(stage.num_blocks) + recompute_s
        else:
            forward_total, backward_total = forward.time_s, backward.time_s + recompute_s
        loss_forward, loss_backward = model_profile.loss_times_at(samples) if stage.has_suffix else (0.0, 0.0)
        forward_total += loss_forward
        backward_total += loss_backward
        local_s += loss_forward + loss_backward
        compute_s.append(local_s)
        exposed_s.append(max(0.0, forward_total + backward_total - local_s))
        forward_s.append(forward_total + action_s)
        backward_s.append(backward_total + action_s)

        parameter_bytes = (
            stage.has_prefix * prefix_parameter_bytes
            + stage.num_blocks * block_parameter_bytes
            + stage.has_suffix * suffix_parameter_bytes
        )
        kept_per_sample = (
            (stage.num_blocks - recomputed) * activation_bytes
            + recomputed * (recomputed_input_bytes + recomputed_extra_bytes)
        )
        in_flight = peak_inflight_microbatches(index, layout.pp, layout.micro_batches, space.schedule)
        memory_bytes.append(
            model_profile.bytes_per_parameter_state * parameter_bytes + in_flight * samples * kept_per_sample
        )
        after_pipeline_s.append(
            (
                network.gradient_sync_s(parameter_bytes, layout.dp),
                _clip_s(layout, model_profile, network, stage) if space.clip_gradients else 0.0,
                _optimizer_s(layout, model_profile, stage, parameter_bytes),
            )
        )

    p2p_s = network.p2p.send_s(hidden_bytes * samples)
    iteration_s = _iteration_s(tuple(forward_s), tuple(backward_s), layout.micro_batches, space.schedule, p2p_s)
    busiest = max(range(len(stages)), key=lambda stage: (forward_s[stage] + backward_s[stage], -stage))
    slowest_update = max(range(len(stages)), key=lambda stage: (sum(after_pipeline_s[stage]), -stage))
    dp_allreduce_s, clip_s, optimizer_s = after_pipeline_s[slowest_update]
    components = {
        "compute": layout.micro_batches * compute_s[busiest],
        "exposed_tp_comm": layout.micro_batches * exposed_s[busiest],
        "pipeline_runtime": layout.micro_batches * 2 * action_s + pipeline_step_s,
        "pipeline_bubble": max(
            0.0, iteration_s - layout.micro_batches * (forward_s[busiest] + backward_s[busiest])
        ),
        "dp_allreduce": dp_allreduce_s,
        "grad_clip": clip_s,
        "optimizer": optimizer_s,
    }
    peak_bytes = max(memory_bytes)
    return Prediction(
        layout=layout,
        step_time_s=iteration_s + pipeline_step_s + dp_allreduce_s + clip_s + optimizer_s,
        samples_per_step=samples * layout.micro_batches * layout.dp,
        memory_bytes=peak_bytes,
        components=components,
        fits=space.memory_limit_bytes is None or peak_bytes <= space.memory_limit_bytes,
    )
