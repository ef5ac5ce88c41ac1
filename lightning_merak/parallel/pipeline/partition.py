"""Split the proxy graph into contiguous pipeline stages (spec 1.2 and 1.3).

Every partitioner first merges skip connections into groups that must share a stage,
then cuts only between groups. The baselines balance layer counts or parameter bytes;
:func:`partition_min_max` is the exact bottleneck-optimal split, and
:func:`partition_autopipe` refines it against the 1F1B simulator under a memory limit.

Every partitioner gives each stage a node whose parameters take gradients (:attr:`~.costs.BlockCost.trainable`)
where the model has enough of them, so no rank's optimizer is left an empty parameter list by frozen embeddings,
adapters on some layers or a noisy measurement; where it has not, it cuts as if every node trained.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from itertools import accumulate

from lightning_merak.parallel.pipeline.costs import (
    DEFAULT_BACKWARD_RATIO,
    BlockCost,
    Partition,
    VocabularyShare,
    boundary_bytes,
    build_partition,
    optimizer_delays_s,
    split_vocabulary_head,
)
from lightning_merak.parallel.pipeline.recompute import blocks_to_recompute
from lightning_merak.parallel.pipeline.simulate import (
    SimulationResult,
    peak_inflight_microbatches,
    simulate_schedule,
)

CARRY_FAN_OUT_THRESHOLD = 5
"""A node output read by more than this many nodes is carried forward through stages, not merged."""

_LAYER_NAME = re.compile(r"^(?P<container>.+)\.\d+$")
_RELATIVE_IMPROVEMENT = 1e-12
"""AutoPipe keeps a move only if it shortens the iteration by more than float noise."""

StageCost = Callable[[int, int, int], float]
"""(stage, first unit, end unit) -> cost of that stage; ``math.inf`` marks a stage that does not fit."""


def _validate_graph(blocks: Sequence[BlockCost]) -> None:
    if not blocks:
        raise ValueError("the proxy graph has no blocks")
    for consumer, block in enumerate(blocks):
        for producer in block.consumes:
            if not 0 <= producer < consumer:
                raise ValueError(
                    f"block {consumer} ({block.name!r}) consumes node {producer}; "
                    f"consumes must name earlier nodes (0..{consumer - 1})"
                )


def high_fan_out_nodes(blocks: Sequence[BlockCost]) -> frozenset[int]:
    """Nodes whose output more than :data:`CARRY_FAN_OUT_THRESHOLD` nodes read (the next node included).

    Merging every reader of a mask or rotary table into one stage would collapse the whole
    model, so these outputs are carried forward as extra stage outputs instead.
    """
    _validate_graph(blocks)
    readers: list[set[int]] = [{index + 1} if index + 1 < len(blocks) else set() for index in range(len(blocks))]
    for consumer, block in enumerate(blocks):
        for producer in block.consumes:
            readers[producer].add(consumer)
    return frozenset(index for index, nodes in enumerate(readers) if len(nodes) > CARRY_FAN_OUT_THRESHOLD)


def merge_skip_connections(blocks: Sequence[BlockCost]) -> list[list[int]]:
    """Groups of block indices that must stay in one stage (Merak's "farthest_min_deps" rule).

    A node reading the output of node i (not its predecessor) pins nodes i..consumer-1 into
    one group, so the value crosses at most the one boundary in front of the consumer and
    every stage feeds only its successor. Outputs of :func:`high_fan_out_nodes` and the
    named ``fan_out_values`` are carried forward instead and never merge anything.
    """
    carried = high_fan_out_nodes(blocks)
    joined_to_next = [False] * len(blocks)
    for consumer, block in enumerate(blocks):
        for producer in block.consumes:
            if producer not in carried:
                for index in range(producer, consumer - 1):
                    joined_to_next[index] = True
    groups = [[0]]
    for index in range(1, len(blocks)):
        if joined_to_next[index - 1]:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def _check_stage_count(num_stages: int, num_units: int, num_blocks: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_units:
        merged = ""
        if num_units < num_blocks:
            merged = f" (skip connections tie the {num_blocks} blocks into {num_units} groups)"
        raise ValueError(
            f"pipeline_parallel={num_stages} exceeds the {num_units} blocks that can be placed in separate "
            f"stages{merged}; use pipeline_parallel<={num_units}"
        )


def _min_max_split(num_units: int, num_stages: int, stage_cost: StageCost) -> tuple[list[int], float]:
    """Exact contiguous split of units into stages minimising the largest stage cost (DP over split points).

    Returns the first unit of each stage and the bottleneck cost (``math.inf`` when no split
    has every stage finite). Among equally good splits the later stages take as much as allowed.
    """
    best = [math.inf] + [stage_cost(0, 0, end) for end in range(1, num_units + 1)]
    stage_starts: list[list[int]] = [[0] * (num_units + 1)]
    for stage in range(1, num_stages):
        stage_best = [math.inf] * (num_units + 1)
        stage_start = [0] * (num_units + 1)
        for end in range(stage + 1, num_units - (num_stages - 1 - stage) + 1):
            for start in range(stage, end):
                if best[start] == math.inf:
                    continue
                bottleneck = max(best[start], stage_cost(stage, start, end))
                if bottleneck < stage_best[end]:
                    stage_best[end], stage_start[end] = bottleneck, start
        best = stage_best
        stage_starts.append(stage_start)
    starts = []
    end = num_units
    for stage in reversed(range(num_stages)):
        end = stage_starts[stage][end]
        starts.append(end)
    return starts[::-1], best[num_units]


class _Units:
    """The merged groups as cuttable units, with block-level prefix sums for O(1) stage totals."""

    def __init__(self, blocks: Sequence[BlockCost], backward_ratio: float) -> None:
        self.groups = merge_skip_connections(blocks)
        self.block_starts = [group[0] for group in self.groups] + [len(blocks)]
        compute_s = (block.forward_s + block.resolved_backward_s(backward_ratio) for block in blocks)
        self.compute_s = list(accumulate(compute_s, initial=0.0))
        self.optimizer_s = list(accumulate((block.optimizer_s for block in blocks), initial=0.0))
        self.param_bytes = list(accumulate((block.param_bytes for block in blocks), initial=0))
        self.trainable = list(accumulate((int(block.trainable) for block in blocks), initial=0))

    def __len__(self) -> int:
        return len(self.groups)

    def holds_trainable(self, start_unit: int, end_unit: int) -> bool:
        """Whether a stage of these units holds a node whose parameters take gradients."""
        start, end = self.block_range(start_unit, end_unit)
        return self.trainable[end] > self.trainable[start]

    def needs_trainable_stages(self, num_stages: int, rows_trainable: bool = False) -> bool:
        """Whether a split must give every stage a trainable node: some unit holds none, the stages' vocabulary
        rows (``rows_trainable``) do not train, and enough units hold one for every stage to get one. Where
        none can, the split ignores it: an optimizer built from all the model's parameters still runs."""
        trainable_units = sum(self.holds_trainable(unit, unit + 1) for unit in range(len(self)))
        return not rows_trainable and num_stages <= trainable_units < len(self)

    def block_range(self, start_unit: int, end_unit: int) -> tuple[int, int]:
        return self.block_starts[start_unit], self.block_starts[end_unit]

    def block_boundaries(self, unit_starts: Sequence[int]) -> list[int]:
        return [self.block_starts[unit] for unit in unit_starts]


def _split_keeping_trainable(units: _Units, num_stages: int, stage_cost: StageCost, rows_trainable: bool = False
                             ) -> tuple[list[int], float, bool]:
    """:func:`_min_max_split` of ``units`` allowing only stages with a trainable node where
    :meth:`_Units.needs_trainable_stages`, else (or where no such split is finite) unconstrained: (first unit
    of each stage, bottleneck, whether the constraint holds)."""
    if units.needs_trainable_stages(num_stages, rows_trainable):
        def trainable_cost(stage: int, start_unit: int, end_unit: int) -> float:
            return stage_cost(stage, start_unit, end_unit) if units.holds_trainable(start_unit, end_unit) else math.inf

        starts, bottleneck = _min_max_split(len(units), num_stages, trainable_cost)
        if bottleneck < math.inf:
            return starts, bottleneck, True
    starts, bottleneck = _min_max_split(len(units), num_stages, stage_cost)
    return starts, bottleneck, False


class _MemoryModel:
    """Peak bytes of a stage under 1F1B: parameters, gradients and optimizer state, plus activations.

    Activations: the stage holds ``min(S - s, M)`` micro-batches; a checkpointed block keeps
    only its input instead of its saved tensors, and one checkpointed block at a time is
    replayed during backward. A model, meant to rank splits, not to replace a measurement.
    """

    def __init__(
        self,
        blocks: Sequence[BlockCost],
        num_microbatches: int,
        optimizer_bytes_per_param_byte: float,
        recompute_ratios: Sequence[float],
        vocabulary: VocabularyShare | None = None,
    ) -> None:
        if optimizer_bytes_per_param_byte < 0:
            raise ValueError(f"optimizer_bytes_per_param_byte must be >= 0, got {optimizer_bytes_per_param_byte}")
        self.num_stages = len(recompute_ratios)
        self.num_microbatches = num_microbatches
        self.state_bytes_per_param_byte = 2.0 + optimizer_bytes_per_param_byte
        self.recompute_ratios = recompute_ratios
        self.saved_bytes = [block.saved_bytes for block in blocks]
        self.param_prefix = list(accumulate((block.param_bytes for block in blocks), initial=0))
        self.saved_prefix = list(accumulate(self.saved_bytes, initial=0))
        input_bytes = [0] + [block.output_bytes for block in blocks[:-1]]
        self.input_prefix = list(accumulate(input_bytes, initial=0))
        self.vocabulary = vocabulary

    def stage_bytes(self, stage: int, start: int, end: int) -> int:
        checkpoint_end = start + blocks_to_recompute(end - start, self.recompute_ratios[stage])
        checkpointed_inputs = self.input_prefix[checkpoint_end] - self.input_prefix[start]
        kept_per_microbatch = checkpointed_inputs + self.saved_prefix[end] - self.saved_prefix[checkpoint_end]
        replay = max(self.saved_bytes[start:checkpoint_end], default=0)
        in_flight = peak_inflight_microbatches(stage, self.num_stages, self.num_microbatches, "1f1b")
        params = self.param_prefix[end] - self.param_prefix[start]
        if self.vocabulary is not None:  # the head's rows; its logits are freed before the next micro-batch's
            params += self.vocabulary.param_bytes
            replay = max(replay, self.vocabulary.saved_bytes)
        state = math.ceil(params * self.state_bytes_per_param_byte)
        return state + in_flight * kept_per_microbatch + replay


def _checked_ratios(recompute_ratios: Sequence[float] | None, num_stages: int) -> list[float]:
    if recompute_ratios is None:
        return [0.0] * num_stages
    if len(recompute_ratios) != num_stages or not all(0.0 <= ratio <= 1.0 for ratio in recompute_ratios):
        raise ValueError(f"recompute_ratios needs {num_stages} values in [0, 1], one per stage, got {recompute_ratios}")
    return list(recompute_ratios)


def _recompute_s(blocks: Sequence[BlockCost], stage: int, start: int, end: int, ratios: Sequence[float]) -> float:
    checkpointed = blocks_to_recompute(end - start, ratios[stage])
    return sum((block.forward_s for block in blocks[start : start + checkpointed]), 0.0)


def _stage_ends(boundaries: Sequence[int], num_blocks: int) -> list[tuple[int, int]]:
    return list(zip(boundaries, [*boundaries[1:], num_blocks]))


def estimate_stage_recompute_s(
    blocks: Sequence[BlockCost], boundaries: Sequence[int], recompute_ratios: Sequence[float] | None
) -> tuple[float, ...]:
    """Recompute time per micro-batch of each stage: the forward of its first floor(n * r_s) blocks."""
    ratios = _checked_ratios(recompute_ratios, len(boundaries))
    ranges = _stage_ends(boundaries, len(blocks))
    return tuple(_recompute_s(blocks, stage, start, end, ratios) for stage, (start, end) in enumerate(ranges))


def estimate_stage_memory_bytes(
    blocks: Sequence[BlockCost],
    boundaries: Sequence[int],
    num_microbatches: int,
    optimizer_bytes_per_param_byte: float = 3.0,
    recompute_ratios: Sequence[float] | None = None,
    vocabulary: VocabularyShare | None = None,
) -> tuple[int, ...]:
    """Peak bytes per stage under 1F1B (see :class:`_MemoryModel`); gradients are as large as the parameters.

    With ``vocabulary`` every stage also holds its rows of the split head."""
    ratios = _checked_ratios(recompute_ratios, len(boundaries))
    memory = _MemoryModel(blocks, num_microbatches, optimizer_bytes_per_param_byte, ratios, vocabulary)
    ranges = _stage_ends(boundaries, len(blocks))
    return tuple(memory.stage_bytes(stage, start, end) for stage, (start, end) in enumerate(ranges))


def _repeated_layer_predicate(blocks: Sequence[BlockCost]) -> Callable[[BlockCost], bool]:
    """Transformer blocks are the children of the most common numbered container (``model.layers.<i>``).

    Without numbered names every non-embedding block counts as a layer.
    """
    containers = Counter(
        match["container"] for block in blocks if not block.is_embedding and (match := _LAYER_NAME.match(block.name))
    )
    if not containers:
        return lambda block: not block.is_embedding
    layer_container = containers.most_common(1)[0][0]

    def is_layer(block: BlockCost) -> bool:
        match = _LAYER_NAME.match(block.name)
        return not block.is_embedding and match is not None and match["container"] == layer_container

    return is_layer


def partition_uniform(
    blocks: Sequence[BlockCost],
    num_stages: int,
    backward_ratio: float = DEFAULT_BACKWARD_RATIO,
    is_layer: Callable[[BlockCost], bool] | None = None,
) -> Partition:
    """The "uniform by layer" baseline: equal transformer-block counts per stage, extras to the first stages.

    Other nodes ride with the layer before them, so the embedding goes with the first stage
    and the final norm and head with the last. ``is_layer`` overrides the name-based detection.
    """
    units = _Units(blocks, backward_ratio)
    _check_stage_count(num_stages, len(units), len(blocks))
    layer_test = is_layer or _repeated_layer_predicate(blocks)
    layer_counts = [sum(layer_test(blocks[index]) for index in group) for group in units.groups]
    layer_units = [unit for unit, count in enumerate(layer_counts) if count]
    if num_stages > len(layer_units):
        raise ValueError(
            f"partition_uniform needs a transformer block per stage: {len(layer_units)} found for "
            f"pipeline_parallel={num_stages}; use pipeline_parallel<={len(layer_units)} or partition_min_max"
        )
    cumulative_layers = list(accumulate((layer_counts[unit] for unit in layer_units), initial=0))
    base, extra = divmod(cumulative_layers[-1], num_stages)
    first_layer_units = [0]
    for stage in range(1, num_stages):
        target = stage * base + min(stage, extra)
        highest = len(layer_units) - (num_stages - stage)
        candidates = range(first_layer_units[-1] + 1, highest + 1)
        first_layer_units.append(next((unit for unit in candidates if cumulative_layers[unit] >= target), highest))
    unit_starts = [0] + [layer_units[unit] for unit in first_layer_units[1:]]
    stage_ranges = zip(unit_starts, [*unit_starts[1:], len(units)])
    if units.needs_trainable_stages(num_stages) and not all(units.holds_trainable(*stage) for stage in stage_ranges):
        layers_before = list(accumulate(layer_counts, initial=0))

        def stage_layers(_stage: int, start_unit: int, end_unit: int) -> float:
            layers = layers_before[end_unit] - layers_before[start_unit]
            return layers if layers and units.holds_trainable(start_unit, end_unit) else math.inf

        balanced, most_layers = _min_max_split(len(units), num_stages, stage_layers)
        if most_layers < math.inf:  # the most even layer counts with a trainable node on every stage
            unit_starts = balanced
    return build_partition(blocks, units.block_boundaries(unit_starts), "uniform", backward_ratio)


def partition_by_parameters(
    blocks: Sequence[BlockCost], num_stages: int, backward_ratio: float = DEFAULT_BACKWARD_RATIO
) -> Partition:
    """The common baseline: the contiguous split minimising the largest stage parameter bytes."""
    units = _Units(blocks, backward_ratio)
    _check_stage_count(num_stages, len(units), len(blocks))

    def stage_params(_stage: int, start_unit: int, end_unit: int) -> float:
        start, end = units.block_range(start_unit, end_unit)
        return units.param_bytes[end] - units.param_bytes[start]

    unit_starts, _, _ = _split_keeping_trainable(units, num_stages, stage_params)
    return build_partition(blocks, units.block_boundaries(unit_starts), "parameters", backward_ratio)


def partition_min_max(
    blocks: Sequence[BlockCost], num_stages: int, backward_ratio: float = DEFAULT_BACKWARD_RATIO,
    vocab_stages: bool = False, split_embedding: bool = True,
) -> Partition:
    """The contiguous split minimising the largest stage forward+backward time; exact (AutoPipe step 1).

    ``vocab_stages``: the LM head (the last node), and with ``split_embedding`` the input embedding (the first),
    are split by vocabulary rows over every stage (:func:`~.costs.split_vocabulary_head`), so their time and
    parameters no longer weigh on the last and first stage alone.
    """
    vocabulary = None
    if vocab_stages:
        blocks, vocabulary = split_vocabulary_head(blocks, num_stages, backward_ratio,
                                                   split_embedding=split_embedding)
    units = _Units(blocks, backward_ratio)
    _check_stage_count(num_stages, len(units), len(blocks))

    def stage_compute(_stage: int, start_unit: int, end_unit: int) -> float:
        start, end = units.block_range(start_unit, end_unit)
        return units.compute_s[end] - units.compute_s[start]

    unit_starts, _, _ = _split_keeping_trainable(units, num_stages, stage_compute,
                                                 vocabulary is not None and vocabulary.trainable)
    return build_partition(blocks, units.block_boundaries(unit_starts), "min_max", backward_ratio,
                           vocabulary=vocabulary)


def _moves_off_stage(unit_starts: list[int], stage: int, num_units: int) -> list[list[int]]:
    """Splits that hand the critical stage's first unit to its predecessor or its last unit to its successor."""
    stage_end = unit_starts[stage + 1] if stage + 1 < len(unit_starts) else num_units
    if stage_end - unit_starts[stage] < 2:
        return []
    moves = []
    if stage > 0:
        moves.append(unit_starts[:stage] + [unit_starts[stage] + 1] + unit_starts[stage + 1 :])
    if stage + 1 < len(unit_starts):
        moves.append(unit_starts[: stage + 1] + [stage_end - 1] + unit_starts[stage + 2 :])
    return moves


def partition_autopipe(
    blocks: Sequence[BlockCost],
    num_stages: int,
    num_microbatches: int,
    p2p_s: float = 0.0,
    memory_limit_bytes: int | None = None,
    optimizer_bytes_per_param_byte: float = 3.0,
    recompute_ratios: Sequence[float] | None = None,
    max_iterations: int = 100,
    backward_ratio: float = DEFAULT_BACKWARD_RATIO,
    p2p_s_per_byte: float = 0.0,
    vocab_stages: bool = False,
    split_embedding: bool = True,
) -> Partition:
    """AutoPipe: the min-max split, refined one boundary unit at a time against the simulated 1F1B iteration.

    Each cut's send takes ``p2p_s`` plus ``p2p_s_per_byte`` per byte it carries (the ``output_bytes`` of the
    node in front of it: the hidden state, side tensors and skip values crossing it), so with a priced link a
    cut where long skips cross costs more than one where they do not.

    Stage time per micro-batch is forward + backward + recompute (``recompute_ratios[s]`` of the
    stage's leading blocks). Splits whose stage memory (:func:`estimate_stage_memory_bytes`, with
    ``optimizer_bytes_per_param_byte`` of optimizer state per parameter byte) exceeds
    ``memory_limit_bytes`` are never chosen; if none fits, the error names the memory needed.

    ``vocab_stages``: the LM head (the last node) is split by vocabulary rows over every stage; each stage is
    priced with its share of the head and the hidden state's exchange (``p2p_s`` and ``p2p_s_per_byte``, each
    way; :func:`~.costs.split_vocabulary_head`), so the last stage takes layers again; with ``split_embedding``
    the input embedding splits alike, so the first stage does too.

    Nodes' ``optimizer_s`` (Muon's Newton–Schulz work) run after the flush: the refinement minimises the
    iteration plus the largest of :func:`~.costs.optimizer_delays_s`, moving blocks off the stage whose
    optimizer step delays the next step as well as off the critical stage, and the min-max start counts each
    stage's optimizer seconds spread over its micro-batches.

    Neither the start nor a move leaves a stage without a trainable node (:meth:`_Units.needs_trainable_stages`),
    unless only such splits fit ``memory_limit_bytes``.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if max_iterations < 0:
        raise ValueError(f"max_iterations must be >= 0, got {max_iterations}")
    if p2p_s_per_byte < 0:
        raise ValueError(f"p2p_s_per_byte must be >= 0, got {p2p_s_per_byte}")
    vocabulary = None
    if vocab_stages:
        blocks, vocabulary = split_vocabulary_head(blocks, num_stages, backward_ratio, p2p_s, p2p_s_per_byte,
                                                   split_embedding)
    share = vocabulary or VocabularyShare(0.0, 0.0, 0, 0, 0)
    units = _Units(blocks, backward_ratio)
    _check_stage_count(num_stages, len(units), len(blocks))
    ratios = _checked_ratios(recompute_ratios, num_stages)
    memory = _MemoryModel(blocks, num_microbatches, optimizer_bytes_per_param_byte, ratios, vocabulary)

    def stage_memory(stage: int, start_unit: int, end_unit: int) -> float:
        return memory.stage_bytes(stage, *units.block_range(start_unit, end_unit))

    def fits(stage: int, start_unit: int, end_unit: int) -> bool:
        return memory_limit_bytes is None or stage_memory(stage, start_unit, end_unit) <= memory_limit_bytes

    def stage_time(stage: int, start_unit: int, end_unit: int) -> float:
        if not fits(stage, start_unit, end_unit):
            return math.inf
        start, end = units.block_range(start_unit, end_unit)
        compute_s = units.compute_s[end] - units.compute_s[start] + share.forward_s + share.backward_s
        optimizer_s = (units.optimizer_s[end] - units.optimizer_s[start]) / num_microbatches
        return compute_s + optimizer_s + _recompute_s(blocks, stage, start, end, ratios)

    unit_starts, bottleneck, trainable_stages = _split_keeping_trainable(units, num_stages, stage_time,
                                                                         share.trainable)
    if bottleneck == math.inf:
        _, needed = _min_max_split(len(units), num_stages, stage_memory)
        raise ValueError(
            f"no split into {num_stages} stages fits memory_limit_bytes={memory_limit_bytes}: the best split "
            f"needs {int(needed)} bytes on its fullest stage; raise the limit to >= {int(needed)}, "
            f"recompute more (recompute_ratios) or use more stages"
        )

    def simulate(starts: Sequence[int]) -> tuple[float, SimulationResult, int]:
        """(step seconds: the iteration and the optimizer tail, the simulation, the stage of the tail's
        slowest optimizer step)."""
        block_starts = units.block_boundaries(starts)
        ranges = _stage_ends(block_starts, len(blocks))
        forward_s = [share.forward_s + sum(block.forward_s for block in blocks[start:end]) for start, end in ranges]
        backward_s = [share.backward_s + sum(block.resolved_backward_s(backward_ratio)
                                             for block in blocks[start:end]) for start, end in ranges]
        result = simulate_schedule(
            forward_s, backward_s, num_microbatches, "1f1b",
            [p2p_s + p2p_s_per_byte * sent for sent in boundary_bytes(blocks, block_starts)],
            [_recompute_s(blocks, stage, start, end, ratios) for stage, (start, end) in enumerate(ranges)],
        )
        delays = optimizer_delays_s(forward_s, backward_s,
                                    [sum(block.optimizer_s for block in blocks[start:end]) for start, end in ranges])
        slowest = max(range(len(delays)), key=delays.__getitem__)
        return result.iteration_s + delays[slowest], result, slowest

    step_s, result, optimizer_stage = simulate(unit_starts)
    for _ in range(max_iterations):
        best_move, best = None, (step_s, result, optimizer_stage)
        stages = {result.critical_stage} | ({optimizer_stage} if step_s > result.iteration_s else set())
        for move in [move for stage in sorted(stages) for move in _moves_off_stage(unit_starts, stage, len(units))]:
            stage_ends = [*move[1:], len(units)]
            if not all(fits(stage, start, end) and (units.holds_trainable(start, end) or not trainable_stages)
                       for stage, (start, end) in enumerate(zip(move, stage_ends))):
                continue
            candidate = simulate(move)
            if candidate[0] < best[0] * (1.0 - _RELATIVE_IMPROVEMENT):
                best_move, best = move, candidate
        if best_move is None:
            break
        unit_starts, (step_s, result, optimizer_stage) = best_move, best

    boundaries = units.block_boundaries(unit_starts)
    return build_partition(
        blocks,
        boundaries,
        "autopipe",
        backward_ratio,
        stage_recompute_s=estimate_stage_recompute_s(blocks, boundaries, ratios),
        stage_memory_bytes=estimate_stage_memory_bytes(
            blocks, boundaries, num_microbatches, optimizer_bytes_per_param_byte, ratios, vocabulary
        ),
        vocabulary=vocabulary,
    )


def predicted_step_s(partition: Partition, num_microbatches: int) -> float:
    """The simulated 1F1B step of ``partition``: its iteration plus, where optimizer work was priced, the delay the
    slowest stage's optimizer step adds after the flush (:func:`~.costs.optimizer_delays_s`)."""
    iteration = simulate_schedule(partition.stage_forward_s, partition.stage_backward_s, num_microbatches).iteration_s
    if partition.stage_optimizer_s is None:
        return iteration
    return iteration + max(optimizer_delays_s(partition.stage_forward_s, partition.stage_backward_s,
                                              partition.stage_optimizer_s))
