"""Measure what the layout planner needs, on the machine and model at hand.

The thin, impure side of the planner (:mod:`lightning_merak.planning.planner` is the pure
core): it times one transformer block split as tensor parallelism would split it (rank 0's
shard, no communication) at every sub-batch size the search needs, with the block's time
cut at the points where its collectives go; the embedding and head from a profiled trace;
all-reduce and point-to-point latency and bandwidth over real process groups, and the
data-parallel gradient synchronisation as the runtime performs it; the optimizer step and
gradient clipping's passes over one block's parameters and over the embedding's and the head's.
With a process group, real tensor-parallel blocks (sharded layers,
their collectives, ``tp_overlap`` sub-batch turns) are timed too, as the runtime will run
them. Every rank measures at once (as they would compute during training); merak3d averages
the ranks' figures (:func:`~lightning_merak.planning.planner.average_profiles`), so every rank
plans the same layout from every core's timings.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
from typing import Any, Callable, ContextManager, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_merak.distributed.process_groups import new_group
from lightning_merak.distributed.sub_batches import SubBatchForward
from lightning_merak.parallel.data.gradients import average_gradients, scale_gradients, squared_norm
from lightning_merak.parallel.fast_blocks import FastBlocks
from lightning_merak.parallel.pipeline.meta_trace import materialized_copy
from lightning_merak.parallel.pipeline.schedules import pipeline_stage_class
from lightning_merak.parallel.pipeline.trace import ModelTrace, trace_model
from lightning_merak.parallel.regional_compile import compile_blocks
from lightning_merak.parallel.tensor.blocks import (
    TensorParallelPlan,
    _conv1d_to_linear,
    _features,
    _is_conv1d,
    apply_tensor_parallel,
)
from lightning_merak.parallel.tensor.head_counts import scale_attention_attributes
from lightning_merak.parallel.tensor.rows import rank_rows
from lightning_merak.parallel.tensor.sequence import SequenceParallelPlan, split_sequence_between
from lightning_merak.planning.measure.runs import (
    BlockRun,
    SavedBytes,
    forward_backward_times,
    loss_profile,
    sample_hidden,
    side_tensors_for,
)
from lightning_merak.planning.planner import (
    BlockTimes,
    CollectiveCost,
    MeasuredBlocks,
    ModelProfile,
    NetworkProfile,
    ProfileKeys,
    fit_collective_cost,
    fit_pipeline_runtime,
)
from lightning_merak.util import timing
from lightning_merak.util.timing import DeviceStamp, mean_call_time, median_call_time

__all__ = ["LARGEST_TIMED_ELEMENTS", "local_shard_of_block", "profile_model", "profile_network", "tensor_parallel_mesh",
           "time_outside_update", "time_parameter_update", "timing_copies"]


def local_shard_of_block(block: nn.Module, plan: Optional[TensorParallelPlan], tensor_parallel: int) -> nn.Module:
    """A copy of ``block`` holding one rank's shard of every split layer (whole shared key/value heads, as the split
    holds them), computing without collectives: one rank's compute; the values differ (no all-reduce). Without a
    ``plan`` (only at ``tensor_parallel=1``) the copy is whole."""
    shard = copy.deepcopy(block)
    if plan is None:
        assert tensor_parallel == 1, "a block is split by a plan"
        return shard
    for names, divide_output in ((plan.column, True), (plan.row, False)):
        for name in names:
            layer = shard.get_submodule(name)
            if _is_conv1d(layer):
                layer = _conv1d_to_linear(layer)
            in_features, out_features = _features(layer)
            units = plan.units.get(name)
            local_out = len(rank_rows(units, 0, tensor_parallel)) if units else out_features // tensor_parallel
            smaller = nn.Linear(in_features if divide_output else in_features // tensor_parallel,
                                local_out if divide_output else out_features,
                                bias=layer.bias is not None, dtype=layer.weight.dtype, device=layer.weight.device)
            shard.set_submodule(name, smaller)
    scale_attention_attributes(shard, plan.column, tensor_parallel)
    return shard


def _block_times(shard: nn.Module, plan: Optional[TensorParallelPlan], trace: ModelTrace, samples: int,
                 repeats: int) -> tuple[BlockTimes, int, int]:
    """Forward and backward time of ``shard`` cut at its collectives, the bytes it saves for backward, and
    how many of those are saved outside the span from a column layer to its row partner. Without a ``plan`` the
    block is one segment each way, all of it outside such a span.

    Sequence parallelism splits those along the sequence (norms, residuals, dropout, and the
    column layers' inputs); what is saved inside the span is split by heads already.
    """
    inputs = sample_hidden(trace, samples).clone().requires_grad_(True)
    args, kwargs = trace.block_arguments(side_tensors_for(trace, samples))
    device = inputs.device
    marks: dict[str, DeviceStamp] = {}
    handles = []
    inside_span = [False]
    if plan is not None:
        first_row = shard.get_submodule(plan.row[0])
        handles.append(first_row.register_forward_hook(lambda *_: marks.__setitem__("row", DeviceStamp(device))))
        for index, group in enumerate(plan.column_groups):
            def watch(module: nn.Module, args_: tuple, key: str = f"group{index}") -> None:
                if args_[0].requires_grad:
                    args_[0].register_hook(lambda grad: marks.__setitem__(key, DeviceStamp(device)))
            handles.append(shard.get_submodule(group[0]).register_forward_pre_hook(watch))
        for names, inside in ((plan.column, True), (plan.row, False)):
            for name in names:
                handles.append(shard.get_submodule(name).register_forward_hook(
                    lambda *_, inside=inside: inside_span.__setitem__(0, inside)))
    # per timed run: its start, the first row layer's end, the forward's end, the MLP's input gradient, its end
    runs: list[tuple[DeviceStamp, ...]] = []
    saved = SavedBytes(shard.parameters())  # by storage: a view of a parameter is no activation
    outside_span: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        for storage in saved.add(tensor):
            if not inside_span[0]:
                outside_span.add(storage)
        return tensor

    def run() -> None:
        shard.zero_grad(set_to_none=True)  # as every training step: backward allocates fresh gradients
        saved.by_storage.clear()
        outside_span.clear()
        inside_span[0] = False
        start = DeviceStamp(device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = trace.hidden_of(shard(inputs, *args, **kwargs))
        end_forward = DeviceStamp(device)
        output.backward(torch.ones_like(output))
        end_backward = DeviceStamp(device)
        if plan is None:
            runs.append((start, end_forward, end_backward))
        else:
            last_group = f"group{len(plan.column_groups) - 1}"
            runs.append((start, marks["row"], end_forward, marks.get(last_group, end_forward), end_backward))

    try:
        started = timing.budget_start()
        run()
        runs.clear()
        for _ in range(repeats):
            run()
            if timing.budget_spent(started, len(runs)):
                break
    finally:
        for handle in handles:
            handle.remove()
    if plan is None:
        forward_parts = [(end_forward.seconds_since(start),) for start, end_forward, _ in runs]
        backward_parts = [(end_backward.seconds_since(end_forward),) for _, end_forward, end_backward in runs]
    else:
        forward_parts = [(row.seconds_since(start), end_forward.seconds_since(row))
                         for start, row, end_forward, _, _ in runs]
        backward_parts = [(mlp_ready.seconds_since(end_forward), end_backward.seconds_since(mlp_ready))
                          for _, _, end_forward, mlp_ready, end_backward in runs]
    times = BlockTimes(forward_segments_s=tuple(map(statistics.fmean, zip(*forward_parts))),
                       backward_segments_s=tuple(map(statistics.fmean, zip(*backward_parts))))
    return times, saved.total, sum(saved.by_storage[storage] for storage in outside_span)


def _compiled_over_eager(shard: nn.Module, trace: ModelTrace, samples: int, repeats: int) -> tuple[float, float]:
    """(forward, backward) seconds of ``shard`` compiled over eager, on a copy: the factors its segments are
    scaled by (a compiled graph runs no hooks of the layers inside it, where the segments are cut)."""
    hidden = sample_hidden(trace, samples)
    args, kwargs = trace.block_arguments(side_tensors_for(trace, samples))
    compiled = copy.deepcopy(shard)
    compile_blocks([(f"{trace.trunk_path}.0", compiled)])
    eager_s = forward_backward_times(BlockRun([shard], trace), hidden, args, kwargs, repeats)
    compiled_s = forward_backward_times(BlockRun([compiled], trace), hidden, args, kwargs, repeats)
    return compiled_s[0] / max(eager_s[0], 1e-12), compiled_s[1] / max(eager_s[1], 1e-12)


def time_parameter_update(parameters: list[nn.Parameter],
                          optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                          repeats: int) -> tuple[float, float]:
    """Mean seconds of the optimizer step and of clipping's passes over ``parameters`` (plain or sharded).

    The planner prices a stage's update by these figures. Each trainable parameter is given a
    gradient of ones (overwriting any it had), so pass copies where the gradients matter.
    """
    trainable = [p for p in parameters if p.requires_grad]
    if not trainable:
        return 0.0, 0.0
    for parameter in trainable:
        parameter.grad = torch.ones_like(parameter)
    clip_s = _clip_passes_s(trainable, repeats)
    optimizer = optimizer_factory(trainable)
    return mean_call_time(optimizer.step, repeats, trainable[0].device), clip_s


def _clip_passes_s(parameters: list[nn.Parameter], repeats: int) -> float:
    """Clipping by norm over ``parameters``' gradients without its all-reduce: the norm's pass and the scaling pass.

    The coefficient is always below 1, as when clipping takes effect, and shrinks the
    gradients slowly enough that no repeat meets subnormal numbers.
    """
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters]
    device = grads[0].device

    def clip() -> None:
        scale_gradients(grads, 1.0 / (math.sqrt(squared_norm(grads, device).item()) + 1.0))

    return mean_call_time(clip, repeats, device)


LARGEST_TIMED_ELEMENTS = 1 << 25
"""A parameter outside the blocks with more elements is timed on a copy of this many of them, and
the time scaled by its size: a whole copy of a large embedding, with its gradient and optimizer
state, would need about four times the table's bytes at setup. Past a few megabytes an update
is bound by memory bandwidth, so its time grows with the elements."""


def timing_copies(parameters: list[nn.Parameter], largest: int) -> tuple[list[nn.Parameter], float]:
    """Detached copies of the trainable ``parameters``, each cut to its first ``largest`` elements,
    and the ratio of all their elements to those copied.

    Timing an update on the copies leaves the model untouched, and multiplying the time by the
    ratio prices the whole (see :data:`LARGEST_TIMED_ELEMENTS`). A meta parameter's copy is random.
    """
    trainable = [p for p in parameters if p.requires_grad]
    copies = [nn.Parameter(torch.randn(min(p.numel(), largest), dtype=p.dtype) if p.is_meta
                           else p.detach().reshape(-1)[:largest].clone() if p.numel() > largest else p.detach().clone())
              for p in trainable]
    copied = sum(c.numel() for c in copies)
    return copies, (sum(p.numel() for p in trainable) / copied if copied else 1.0)


def time_outside_update(model: nn.Module, trace: ModelTrace,
                        optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                        repeats: int, largest: int = LARGEST_TIMED_ELEMENTS,
                        ) -> tuple[tuple[float, float], tuple[float, float]]:
    """:func:`time_parameter_update` over copies of the embedding's and the head's parameters, grouped as the
    trace's costs group them (a tied weight belongs to the head): ``(prefix, suffix)``, each
    ``(optimizer_s, clip_s)``. The model's own parameters stay untouched.

    Parameters beyond ``largest`` elements are timed on a part and scaled (:func:`timing_copies`).
    """
    times = []
    for group in trace.outside_parameters(model):
        copies, scale = timing_copies(group, largest)
        optimizer_s, clip_s = time_parameter_update(copies, optimizer_factory, repeats)
        times.append((scale * optimizer_s, scale * clip_s))
    prefix_s, suffix_s = times
    return prefix_s, suffix_s


def _sharded_copy(block: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh,
                  sequence_plan: Optional[SequenceParallelPlan] = None,
                  overlap_weight_gradients: bool = True) -> nn.Module:
    """A copy of ``block`` with real tensor-parallel layers over ``mesh`` (collectives included)."""
    sharded = copy.deepcopy(block)
    apply_tensor_parallel(sharded, plan, mesh, sequence_plan, overlap_weight_gradients)
    return sharded


def tensor_parallel_mesh(device: torch.device, tensor_parallel: int) -> DeviceMesh:
    """The tensor-parallel groups merak3d uses (consecutive ranks); every rank must call this."""
    world = dist.get_world_size()
    return init_device_mesh(device.type, (world // tensor_parallel, tensor_parallel),
                            mesh_dim_names=("replica", "tp"))["tp"]


def _measure_real_blocks(block: nn.Module, plan: Optional[TensorParallelPlan], traces: dict[int, ModelTrace],
                         keys: ProfileKeys, meshes: dict[int, DeviceMesh], repeats: int,
                         max_blocks: int, sequence_plan: Optional[SequenceParallelPlan] = None,
                         overlap_weight_gradients: bool = True, fast_blocks: FastBlocks = FastBlocks(),
                         ) -> dict[tuple[int, int, int], MeasuredBlocks]:
    """Regions of one and of ``max_blocks`` real tensor-parallel blocks, at each (tp, overlap, samples) of ``keys``
    whose tp has a mesh.

    The per-block cost is the difference over ``max_blocks - 1`` blocks, so timing noise is
    divided by that many instead of landing whole on every further block. With a
    ``sequence_plan`` the blocks run sequence-parallel, as the runtime runs them: the region
    splits the sequence at its first block and gathers it after its last. ``overlap_weight_gradients``
    is the runtime's setting for the column groups' backward.
    """
    measured: dict[tuple[int, int, int], MeasuredBlocks] = {}
    counts = (1, max(2, max_blocks))
    for tp, overlap, samples in sorted(key for key in keys.measured_blocks if key[0] in meshes):
        trace = traces[samples]
        hidden = trace.sample_hidden[:samples]
        args, kwargs = trace.block_arguments(side_tensors_for(trace, samples))
        times = []
        for count in counts:
            blocks = [_sharded_copy(block, plan, meshes[tp], sequence_plan, overlap_weight_gradients)
                      for _ in range(count)]
            if sequence_plan is not None:
                split_sequence_between(blocks[0], blocks[-1], meshes[tp].get_group(), trace.block_output_index)
            fast_blocks.apply([(f"{trace.trunk_path}.{index}", copy_) for index, copy_ in enumerate(blocks)])
            run = BlockRun(blocks, trace)
            if overlap > 1:
                run.forward = SubBatchForward(run, overlap)
            dist.barrier()
            times.append(forward_backward_times(run, hidden, args, kwargs, repeats))
        (forward_one, backward_one), (forward_many, backward_many) = times
        further = counts[1] - 1
        measured[(tp, overlap, samples)] = MeasuredBlocks(
            forward_first_s=forward_one, forward_next_s=max(0.0, forward_many - forward_one) / further,
            backward_first_s=backward_one, backward_next_s=max(0.0, backward_many - backward_one) / further,
        )
    return measured


def _block_update_times(block: nn.Module, plan: Optional[TensorParallelPlan], keys: ProfileKeys,
                        optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                        meshes: dict[int, DeviceMesh], repeats: int) -> tuple[dict[int, float], dict[int, float]]:
    """Optimizer step and clipping passes over one block's parameters per tp: real shards where ``meshes`` has
    the tp, local shards else."""
    optimizer_s, clip_s = {}, {}
    for tp in sorted(keys.tp_degrees | {1}):
        sharded = _sharded_copy(block, plan, meshes[tp]) if tp in meshes else local_shard_of_block(block, plan, tp)
        optimizer_s[tp], clip_s[tp] = time_parameter_update(list(sharded.parameters()), optimizer_factory, repeats)
    return optimizer_s, clip_s


def profile_model(
    model: nn.Module,
    sample_inputs: torch.Tensor,
    call_model: Callable[[nn.Module, torch.Tensor], Any],
    plan_of: Callable[[nn.Module, ModelTrace], TensorParallelPlan],
    keys: ProfileKeys,
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    repeats: int = 5,
    process_group_device: Optional[torch.device] = None,
    loss_of: Optional[Callable[[Any, int], torch.Tensor]] = None,
    sequence_plan_of: Optional[Callable[[nn.Module, ModelTrace, TensorParallelPlan], SequenceParallelPlan]] = None,
    overlap_weight_gradients: bool = True,
    materialize_with: Optional[Callable[[nn.Module], Callable[..., None]]] = None,
    fast_blocks: FastBlocks = FastBlocks(),
    budget_s: Optional[float] = None,
) -> ModelProfile:
    """Time ``model``'s parts at every (tp, sub-batch samples) the search needs (``keys``).

    ``plan_of(block, trace)`` splits the first block as tensor parallelism will, and cuts its time where the
    collectives go; where ``keys`` hold no degree above 1, a block it refuses is timed whole (:func:`_block_plan`).

    With ``process_group_device`` (every rank of the default process group calling at once),
    real tensor-parallel blocks are timed at ``keys.measured_blocks`` and their optimizer step
    over sharded parameters; without it those stay unmeasured and the planner models them.
    With ``loss_of(logits, samples)`` (the training loss of the first ``samples`` samples'
    logits), the loss is timed at every micro-batch size of ``keys.loss_samples``. With
    ``sequence_plan_of(block, trace, plan)`` the real blocks are timed sequence-parallel; the
    sequence length must divide by every tp of ``keys``. ``overlap_weight_gradients`` is the
    runtime's setting for the real blocks' column groups (:func:`apply_tensor_parallel`). A model on the
    meta device stays there: ``materialize_with`` (see :func:`~lightning_merak.parallel.pipeline.trace.trace_model`)
    materialises one block (and the prefix, then the head, in the traces) at a time. Blocks are timed as
    ``fast_blocks`` makes them train: local shards and real blocks with fp8 layers (their time and saved
    activations measured so), real blocks compiled, and with compilation each local shard's segments scaled by its
    measured compiled-over-eager time (:func:`_compiled_over_eager`). With ``budget_s`` each quantity timed in
    this process alone takes fewer than ``repeats`` calls once its calls have taken that long
    (:func:`~lightning_merak.util.timing.repeat_budget`); those timed across ranks (real tensor-parallel blocks,
    their sharded update) keep every repeat, so that all ranks issue the same collectives.
    """

    def local() -> ContextManager[None]:  # the budget, where no collective is timed
        return timing.repeat_budget(budget_s) if budget_s is not None else contextlib.nullcontext()

    real_blocks = process_group_device is not None and dist.is_initialized() and dist.get_world_size() > 1
    measured_samples = {samples for _, _, samples in keys.measured_blocks} if real_blocks else set()
    needed_samples = sorted({samples for _, samples in keys.block_times} | set(keys.prefix_suffix_samples)
                            | measured_samples)
    traces: dict[int, ModelTrace] = {}
    for samples in needed_samples:
        inputs = sample_inputs[:samples] if samples <= sample_inputs.shape[0] else sample_inputs.repeat(
            -(-samples // sample_inputs.shape[0]), 1)[:samples]
        with local():
            traces[samples] = trace_model(model, inputs, call_model, profile=True, profile_repeats=repeats,
                                          materialize_with=materialize_with)
    largest = traces[needed_samples[-1]]
    trunk = model.get_submodule(largest.trunk_path)
    on_meta = any(p.is_meta for p in trunk[0].parameters())
    block = materialized_copy(trunk[0], f"{largest.trunk_path}.0", materialize_with) if on_meta else trunk[0]
    plan = _block_plan(plan_of, block, largest, split=any(tp > 1 for tp in keys.tp_degrees))
    block_times: dict[tuple[int, int], BlockTimes] = {}
    parameter_bytes: dict[int, int] = {}
    activation_bytes: dict[int, int] = {}
    sequence_split_bytes: dict[int, int] = {}
    block_bytes = _parameter_bytes(block.parameters())
    trainable_fraction = _parameter_bytes(block.parameters(), trainable_only=True) / max(1, block_bytes)
    adapter_bytes = 0
    with local():  # every tensor-parallel degree's local shard, in this process
        for tp in sorted(keys.tp_degrees | {1}):
            shard = local_shard_of_block(block, plan, tp)
            fast_blocks.convert_float8([(f"{largest.trunk_path}.0", shard)])  # a copy: converted in place
            shard_bytes = _parameter_bytes(shard.parameters())
            if tp == 1:  # the first: a shard's split layers are plain, so adapters inside them (LoRA) are counted apart
                adapter_bytes = max(0, block_bytes - shard_bytes)
            parameter_bytes[tp] = shard_bytes + adapter_bytes // tp
            for samples in sorted(s for t, s in keys.block_times if t == tp) or [needed_samples[-1]]:
                times, saved, outside = _block_times(shard, plan, traces[samples], samples, repeats)
                if fast_blocks.compile:
                    forward_ratio, backward_ratio = _compiled_over_eager(shard, traces[samples], samples, repeats)
                    times = BlockTimes(tuple(s * forward_ratio for s in times.forward_segments_s),
                                       tuple(s * backward_ratio for s in times.backward_segments_s))
                block_times[(tp, samples)] = times
                activation_bytes.setdefault(tp, saved // samples)
                sequence_split_bytes.setdefault(tp, outside // samples)
    hidden = largest.sample_hidden
    prefix, suffix = largest.costs[0], largest.costs[-1]
    prefix_parameters, suffix_parameters = largest.outside_parameters(model)
    # one mesh per tensor-parallel degree (creating one is collective), shared by both measurements
    meshes = ({tp: tensor_parallel_mesh(process_group_device, tp) for tp in sorted(keys.tp_degrees) if tp > 1}
              if real_blocks else {})
    sequence_plan = sequence_plan_of(block, largest, plan) if sequence_plan_of is not None and meshes else None
    block_optimizer_s, block_clip_s = _block_update_times(block, plan, keys, optimizer_factory, meshes, repeats)
    measured = _measure_real_blocks(block, plan, traces, keys, meshes, repeats, max_blocks=min(len(trunk), 4),
                                    sequence_plan=sequence_plan, overlap_weight_gradients=overlap_weight_gradients,
                                    fast_blocks=fast_blocks)
    with local():
        prefix_update_s, suffix_update_s = time_outside_update(model, largest, optimizer_factory, repeats)
        loss_times, loss_saved_bytes = loss_profile(model, sample_inputs, call_model, loss_of, keys.loss_samples,
                                                    repeats, largest.logits_shape if on_meta else None
                                                    ) if loss_of is not None else ({}, 0)
    return ModelProfile(
        num_blocks=len(trunk),
        hidden_bytes_per_sample=hidden[0].numel() * hidden.element_size(),
        block_times=block_times,
        prefix_times={s: (traces[s].costs[0].forward_s, traces[s].costs[0].backward_s) for s in needed_samples},
        suffix_times={s: (traces[s].costs[-1].forward_s, traces[s].costs[-1].backward_s) for s in needed_samples},
        block_parameter_bytes=parameter_bytes,
        prefix_parameter_bytes=prefix.param_bytes,
        suffix_parameter_bytes=suffix.param_bytes,
        block_trainable_bytes={tp: round(nbytes * trainable_fraction) for tp, nbytes in parameter_bytes.items()},
        prefix_trainable_bytes=min(prefix.param_bytes, _parameter_bytes(prefix_parameters, trainable_only=True)),
        suffix_trainable_bytes=min(suffix.param_bytes, _parameter_bytes(suffix_parameters, trainable_only=True)),
        block_activation_bytes_per_sample=activation_bytes,
        block_sequence_split_bytes_per_sample=sequence_split_bytes,
        optimizer_s_per_parameter_byte=block_optimizer_s[1] / max(1, parameter_bytes[1]),
        measured_blocks=measured,
        block_optimizer_s=block_optimizer_s,
        block_clip_s=block_clip_s,
        clip_s_per_parameter_byte=block_clip_s[1] / max(1, parameter_bytes[1]),
        prefix_update_s=prefix_update_s,
        suffix_update_s=suffix_update_s,
        carried_bytes_per_sample=largest.skip_bytes_per_sample(),
        loss_times=loss_times,
        loss_saved_bytes_per_sample=loss_saved_bytes,
    )


def _block_plan(plan_of: Callable[[nn.Module, ModelTrace], TensorParallelPlan], block: nn.Module, trace: ModelTrace,
                split: bool) -> Optional[TensorParallelPlan]:
    """``plan_of(block, trace)``; unless the block is ``split``, None where it refuses the block (a ValueError: no
    column/row linear pair, as in a hand-written MLP or a convolution), which is then timed whole: unsplit, the plan
    only cuts the block's time where the collectives would go, and such a model still plans stages and sharding."""
    if split:
        return plan_of(block, trace)
    try:
        return plan_of(block, trace)
    except ValueError:
        return None


def _parameter_bytes(parameters: Iterable[nn.Parameter], trainable_only: bool = False) -> int:
    """Bytes of ``parameters`` (only those that take gradients with ``trainable_only``)."""
    return sum(p.numel() * p.element_size() for p in parameters if p.requires_grad or not trainable_only)


def consecutive_group(size: int) -> dist.ProcessGroup:
    """This rank's group of ``size`` consecutive ranks; every rank creates every such group (collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, size):
        group = new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return mine


def _sizes(small_bytes: int, large_bytes: int) -> list[int]:
    """Message sizes from ``small_bytes`` to ``large_bytes``, a factor of about 4 apart."""
    sizes = [large_bytes]
    while sizes[-1] // 4 > small_bytes:
        sizes.append(sizes[-1] // 4)
    return sorted({small_bytes, *sizes[:3]})


PIPELINE_PROBE_MICRO_BATCHES = (2, 8)
"""Micro-batch counts of the pipeline runtime probe: its time per chunk comes from the difference."""


def _pipeline_runtime(device: torch.device, repeats: int, p2p: CollectiveCost) -> tuple[float, float]:
    """The pipeline runtime's time per chunk action and per step on ranks 0 and 1 (every rank must call).

    Two stages that compute nothing (an 8-wide linear layer on one row per micro-batch) run
    the runtime's 1F1B schedule, with the stage class merak3d uses on this backend, at two
    micro-batch counts; :func:`fit_pipeline_runtime` turns the steps into per-action and
    per-step times. Other ranks return zeros; the caller takes rank 0's figures.
    """
    from torch.distributed.pipelining import Schedule1F1B

    rank = dist.get_rank()
    group = new_group([0, 1])
    steps: dict[int, float] = {}
    if rank < 2:
        stage_class = pipeline_stage_class(dist.get_backend(group))
        for micro_batches in PIPELINE_PROBE_MICRO_BATCHES:
            stage = stage_class(nn.Linear(8, 8).to(device), rank, 2, device, group=group)
            schedule = Schedule1F1B(stage, micro_batches, loss_fn=lambda output, target: output.sum())
            rows = torch.zeros(micro_batches, 1, 8, device=device)
            dist.barrier(group=group)
            steps[micro_batches] = mean_call_time(
                (lambda: schedule.step(rows)) if rank == 0 else (lambda: schedule.step(target=rows)), repeats, device)
    dist.barrier()
    return fit_pipeline_runtime(steps, p2p.send_s(8 * 4)) if rank == 0 else (0.0, 0.0)


def profile_network(group_sizes: Iterable[int], device: torch.device, large_bytes: int,
                    small_bytes: int = 4096, repeats: int = 5, gradient_bytes: int = 0,
                    pipeline: bool = False) -> NetworkProfile:
    """All-reduce cost per group size (groups of consecutive ranks, all busy at once) and rank 0 ↔ 1 p2p.

    Each cost is fitted to several message sizes up to ``large_bytes``, from the median of a
    few transfers per size: one stalled transfer would move a fitted latency or bandwidth far
    more than it moves a run of many transfers (computation is timed by the mean). With
    ``gradient_bytes``, the data-parallel gradient synchronisation is fitted per group size
    too, at sizes up to that many bytes (the largest gradient a candidate layout syncs). With
    ``pipeline`` (some candidate layout has several stages) the pipeline runtime's own time is
    measured too (:func:`_pipeline_runtime`).
    Every rank must call this; the figures of rank 0's groups are returned on every rank.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return NetworkProfile(all_reduce={}, p2p=CollectiveCost(latency_s=0.0, bandwidth_bytes_per_s=1e30))
    all_reduce: dict[int, CollectiveCost] = {}
    gradient_sync: dict[int, CollectiveCost] = {}
    for size in sorted(set(group_sizes)):
        mine = consecutive_group(size)
        points = []
        for nbytes in _sizes(small_bytes, large_bytes):
            tensor = torch.ones(max(1, nbytes // 4), device=device)
            dist.barrier()
            points.append((nbytes, median_call_time(lambda: dist.all_reduce(tensor, group=mine), repeats, device)))
        all_reduce[size] = fit_collective_cost(points, 2.0 * (size - 1) / size)
        if gradient_bytes > 0:
            points = []
            for nbytes in _sizes(min(small_bytes, gradient_bytes // 2), gradient_bytes):
                grads = list(torch.ones(max(8, nbytes // 4), device=device).chunk(8))
                dist.barrier()
                points.append((nbytes, median_call_time(
                    lambda: average_gradients(grads, mine, size), repeats, device)))
            gradient_sync[size] = fit_collective_cost(points)
    points = []
    for nbytes in _sizes(small_bytes, large_bytes):
        tensor = torch.ones(max(1, nbytes // 4), device=device)

        def ping() -> None:
            if rank == 0:
                dist.send(tensor, 1)
                dist.recv(tensor, 1)
            elif rank == 1:
                dist.recv(tensor, 0)
                dist.send(tensor, 0)

        dist.barrier()
        points.append((nbytes, median_call_time(ping, repeats, device) / 2))
    p2p = fit_collective_cost(points)
    action_s, step_s = _pipeline_runtime(device, repeats, p2p) if pipeline else (0.0, 0.0)
    network = NetworkProfile(all_reduce=all_reduce, p2p=p2p, gradient_sync=gradient_sync,
                             pipeline_action_s=action_s, pipeline_step_s=step_s)
    holder = [network]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
