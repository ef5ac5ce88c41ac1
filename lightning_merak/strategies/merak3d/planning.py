"""Planning a merak3d layout: search space from the arguments → profile → plan → a new :class:`Layout`.

The impure orchestration around the pure planner (:mod:`lightning_merak.planning.planner`):
which tensor-parallel degrees split the model exactly, what this machine and model measure
(:mod:`~lightning_merak.planning.measure.layout`, averaged over the ranks), and the best
layout within the degrees the user fixed. Afterwards, :func:`check_step_time` puts the
measured step next to the prediction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_merak.callbacks.profiler.lightning_profiler import model_shape
from lightning_merak.distributed.store_gather import gather_through_store
from lightning_merak.distributed.watchdog import working_alone
from lightning_merak.modules.causal_lm import scores_next_token
from lightning_merak.parallel.context.model import attention_shape, check_context_parallel_model
from lightning_merak.parallel.data.buckets import DEFAULT_BUCKET_MB, check_shardable_optimizer
from lightning_merak.parallel.layout import Layout, default_micro_batches
from lightning_merak.parallel.materialize import has_meta
from lightning_merak.parallel.micro_batching.samples import VariableBatch
from lightning_merak.parallel.pipeline.trace import TraceError, find_trunk, trace_model
from lightning_merak.planning.measure.context import time_attention_kernels
from lightning_merak.planning.measure.experts import (
    expert_layers_of,
    experts_per_layer,
    grouped_experts,
    measure_all_to_all,
)
from lightning_merak.planning.measure.layout import profile_model, profile_network, tensor_parallel_mesh
from lightning_merak.planning.planner import (
    ContextAttention,
    SearchSpace,
    average_profiles,
    candidate_layouts,
    plan,
    predict,
    required_profile_keys,
    rerank,
)
from lightning_merak.planning.planner.profile import DATA_PARALLEL_SHARDING
from lightning_merak.planning.planner.step_check import BatchClock, StepTimeCheck
from lightning_merak.planning.replay.calibration import predictor_from_files
from lightning_merak.strategies.merak3d.arguments import (
    Merak3DArguments,
    check_fully_shardable,
    check_memory_limit,
    moe_layers,
)
from lightning_merak.strategies.merak3d.block_splits import (
    sequence_parallel_plan,
    tensor_parallel_plan,
    unsplittable_structure,
)
from lightning_merak.strategies.merak3d.build import Broadcast, call_model, meta_materializers, no_cache
from lightning_merak.strategies.merak3d.measure_precision import training_precision
from lightning_merak.strategies.merak3d.tensor_degrees import (
    describe_left_out,
    left_out_tensor_parallel,
    tensor_parallel_candidates,
    tensor_parallel_room,
)
from lightning_merak.strategies.merak3d.vocab_stages_build import embedding_splits_with_head
from lightning_merak.util.timing import repeat_budget

__all__ = ["NETWORK_PROBE_SHARE", "PLANNER_REPEATS", "PLANNER_REPEAT_BUDGET_S", "PLANNER_WAIT_FACTOR",
           "STEP_CHECK_BATCHES", "STEP_CHECK_WARMUP", "PlannedLayout", "allowed_predictions",
           "check_fixed_degrees_fit", "check_pipeline_search", "check_step_time", "first_training_batch",
           "largest_network_probe", "least_pipeline_stages", "plan_layout", "planned_arguments", "planning_batch",
           "search_batch"]

LossOf = Callable[[torch.Tensor, int], torch.Tensor]
"""``(logits, samples) -> loss`` of the planning batch's first ``samples``."""

PLANNER_REPEATS = 11
"""Timed repeats per profiled quantity (median). With 5, three planning runs on 2 shared cores
predicted the same layouts up to 25% apart; with 11, within about 8%."""

PLANNER_REPEAT_BUDGET_S = 2.0
"""Seconds after which a profiled quantity stops repeating (after one timed call at least; collectives excepted:
:func:`~lightning_merak.util.timing.repeat_budget`). Calls of milliseconds keep all :data:`PLANNER_REPEATS`; at
16k tokens, where one block's forward and backward take seconds on CPU, a rank profiled for over ten minutes
without it."""

PLANNER_WAIT_FACTOR = 3.0
"""A rank done profiling waits for the others up to this many times its own profiling time (and at least the
strategy's ``timeout_s``): ranks sharing cores profile at different speeds."""

STEP_CHECK_WARMUP, STEP_CHECK_BATCHES = 2, 5
"""A planned run compares the median of batches 3–7 with the prediction (the first ones build and warm up)."""


@dataclass(frozen=True)
class PlannedLayout:
    """The planner's answer: the layout to adopt, the whole ranking, the chosen layout's prediction
    (a ``planner.Prediction``) and the tensor-parallel degrees whose split was checked on the way."""

    layout: Layout
    plan: Any
    choice: Any
    verified_tp_degrees: frozenset[int]


def first_training_batch(trainer: Any) -> Any:
    """One batch of the training dataloader, read before the layout (and the data-parallel rank) exists."""
    source = getattr(trainer.fit_loop, "_data_source", None)
    if source is None or not hasattr(source, "dataloader") or not source.is_defined():
        raise RuntimeError(
            "the layout planner reads one training batch for its shapes but found no train dataloader; "
            "fit with training data, or set pipeline_parallel, tensor_parallel, tp_overlap and recompute"
        )
    return next(iter(source.dataloader()))


def planning_batch(batch: Any) -> tuple[Any, bool]:
    """The batch the planner profiles, and whether its samples are the whole global batch (every replica reads it and
    trains on its share) rather than one replica's. A variable-length global batch
    (:class:`~lightning_merak.parallel.micro_batching.VariableBatch`) is profiled as all its samples at the longest
    one's padded length, the longest row of its micro-batches but packed ones: iterated, it yields only a 64-token
    probe block, whose activations understate the real ones."""
    if not isinstance(batch, VariableBatch):
        return batch, False
    return batch.tokens, True


def search_batch(samples: int, global_batch: bool) -> dict[str, Optional[int]]:
    """The batch of the planner's ``SearchSpace``: the planning batch's ``samples`` per replica (a dataloader per
    replica), or with ``global_batch`` per step, each of dp replicas training ``samples / dp`` of them."""
    return {"global_batch_size": samples if global_batch else None,
            "replica_batch_size": None if global_batch else samples}


def least_pipeline_stages(arguments: Merak3DArguments) -> int:
    """The fewest pipeline stages a planned layout may have: 2 with ``micro_batching`` on, which runs its
    micro-batches through the pipeline schedule (at one stage nothing would run them), else 1."""
    return 1 if arguments.micro_batching == "none" else 2


def check_pipeline_search(arguments: Merak3DArguments, layouts: Sequence[Any]) -> None:
    """Refuse, before any profiling, a search whose candidate ``layouts`` (``planner.Layout``) all have fewer stages
    than :func:`least_pipeline_stages` allows."""
    least = least_pipeline_stages(arguments)
    if least > 1 and not any(layout.pp >= least for layout in layouts):
        raise ValueError(
            f"micro_batching={arguments.micro_batching} runs its micro-batches through the pipeline schedule, but no "
            f"layout the planner may choose (degrees {arguments.degrees}, the batch and the model's blocks) has "
            f"pipeline_parallel>={least}; use more processes, fix pipeline_parallel>={least} with degrees whose "
            "product divides the world size, or set micro_batching=none")


def allowed_predictions(arguments: Merak3DArguments, ranked: Sequence[Any],
                        fully_shardable: Callable[[int], bool]) -> list[Any]:
    """The ``ranked`` predictions (``planner.Prediction``) merak3d may adopt: at the degrees the user fixed, with at
    least :func:`least_pipeline_stages` stages, and fully sharded only at a tensor-parallel degree
    ``fully_shardable`` accepts."""
    return [p for p in ranked if _at_fixed_degrees(arguments, p.layout)
            and (p.layout.sharding != "full" or fully_shardable(p.layout.tp))]


def _at_fixed_degrees(arguments: Merak3DArguments, layout: Any) -> bool:
    """Whether ``layout`` (``planner.Layout``) has the degrees the user fixed and enough pipeline stages."""
    degrees = arguments.degrees
    return (all(degrees[name] in ("auto", value) for name, value in
                (("dp", layout.dp), ("pp", layout.pp), ("tp", layout.tp)))
            and layout.pp >= least_pipeline_stages(arguments))


def check_fixed_degrees_fit(arguments: Merak3DArguments, rejected: Sequence[Any],
                            fully_shardable: Callable[[int], bool], memory_limit_bytes: float) -> None:
    """Refuse naming the memory where the layouts merak3d may adopt (:func:`allowed_predictions`) were all among the
    ``rejected`` predictions (``planner.Prediction``, over ``memory_limit_bytes``), with the least any of them needs."""
    unfit = allowed_predictions(arguments, rejected, fully_shardable)
    if unfit:
        smallest = min(unfit, key=lambda prediction: (prediction.memory_bytes, *prediction.layout.tie_break_key))
        raise ValueError(f"no planned layout at the fixed degrees {arguments.degrees} fits memory_limit_bytes="
                         f"{memory_limit_bytes:.0f}: the smallest of them needs {smallest.memory_bytes:.0f} bytes "
                         f"({smallest.layout.describe()}); raise strategy.memory_limit, use more processes, or set "
                         "more degrees to 'auto'")


def dropped_context_layouts(arguments: Merak3DArguments, layouts: Sequence[Any],
                            context: Optional[ContextAttention]) -> list[str]:
    """Why the planner left out the context-parallel ``layouts`` (the candidates, ``planner.Layout``) at the
    user's fixed degrees that the attention shape ``context`` does not run: what a refusal names."""
    if context is None:  # no context-parallel layout was searched
        return []
    problems = [context.method_problem(layout.cp, layout.tp, layout.context_attention)
                for layout in layouts if layout.cp > 1 and _at_fixed_degrees(arguments, layout)]
    return list(dict.fromkeys(problem for problem in problems if problem is not None))


def plan_layout(arguments: Merak3DArguments, module: Any, inputs: torch.Tensor, loss_of: LossOf, *, world_size: int,
                num_processes: int, device: torch.device, optimizer: Optional[torch.optim.Optimizer],
                clip_gradients: bool, broadcast: Broadcast, merak_ep: bool = False,
                ep_size: Optional[int] = None, global_batch: bool = False) -> PlannedLayout:
    """Profile this machine and ``module``'s network (a :class:`~.network.ModuleView`) on one batch, scored by
    ``loss_of``, search the layouts, and return the best one. ``inputs`` are one replica's samples, or with
    ``global_batch`` the whole global batch each of the dp replicas trains a share of (:func:`planning_batch`).

    With ``merak_ep`` the model's MoE layers run expert parallel over ``ep_size`` of each stage's data-parallel
    ranks (None: planned, every size dividing dp and the experts searched; the choice's ``layout.ep``): the profile
    describes them and measures their all-to-all, the search prices the exchange and the experts kept and keeps the
    data-parallel ranks unsharded. Rank 0's choice is every rank's.
    """
    model: nn.Module = module.network
    config = getattr(model, "config", None)
    trainer = getattr(module.module, "_trainer", None)
    precision = getattr(trainer, "precision_plugin", None)
    factory: Callable[[Any], torch.optim.Optimizer] = (
        (lambda params: type(optimizer)(params, **optimizer.defaults)) if optimizer is not None
        else (lambda params: torch.optim.AdamW(params)))
    state_ratios = state_bytes_per_parameter_byte(model, precision, factory)
    if arguments.memory_limit is not None:  # before any profiling: the state the planner prices in every layout
        converted = str(getattr(precision, "precision", "")) in ("16-true", "bf16-true")  # to 16 bits after planning
        check_memory_limit(arguments.memory_limit, model, world_size, at_most_16_bits=converted,
                           optimizer_bytes_per_parameter_byte=state_ratios["optimizer_bytes_per_parameter_byte"])
    no_cache(model)
    # a model on the meta device is profiled one materialised piece at a time, seeded alike on every rank
    materialize_with = meta_materializers(model, inputs.device, broadcast) if has_meta(model) else None
    exchange_key = f"merak3d/planner/{broadcast(uuid.uuid4().hex, 0)}"  # new in the store in every run
    world = world_size
    sequence = inputs.shape[1] if inputs.ndim > 1 else 1
    tp_degrees = tensor_parallel_candidates(arguments, config, world, num_processes, sequence)
    router_aux = bool(getattr(config, "output_router_logits", False))  # the aux loss needs every token's routing
    verified: set[int] = set()
    left_out = left_out_tensor_parallel(arguments, config, world, num_processes, sequence)
    tp_degrees = _splittable_degrees(model, inputs, tp_degrees, arguments.tensor_parallel != "auto", device,
                                     broadcast, verified, materialize_with, left_out)
    fixed_pp = arguments.pipeline_parallel if arguments.pipeline_parallel != "auto" else None
    try:
        num_blocks = len(find_trunk(model)[1])
    except TraceError as error:
        if fixed_pp != 1 or tp_degrees != (1,):
            raise
        rank_zero_info(f"merak3d planner: plain data parallelism, nothing to plan ({error})")
        return PlannedLayout(_data_parallel_layout(arguments, world), None, None, frozenset())
    modes = ("none",) if merak_ep else sharding_modes(arguments, model, precision, optimizer)
    only_sharding_planned = "auto" not in (arguments.pipeline_parallel, arguments.tensor_parallel,
                                           arguments.tp_overlap, arguments.recompute)
    micro_batches = arguments.micro_batches
    if only_sharding_planned and micro_batches is None and isinstance(fixed_pp, int):
        micro_batches = default_micro_batches(fixed_pp)  # the layout is fixed but for its sharding
    ratios = {"none": (0.0,), "full": (1.0,), "stage_aware": (arguments.recompute_ratio,),
              "auto": (0.0, 0.5, 1.0)}[arguments.recompute]
    space = SearchSpace(
        world_size=world, **search_batch(inputs.shape[0], global_batch),
        tp_degrees_allowed=tp_degrees, max_pipeline_stages=fixed_pp or min(world, num_blocks + 2),
        # micro-batching splits a global batch into any count (pad's may be uneven): the planner prices divisors
        micro_batch_choices=(micro_batches,) if micro_batches and arguments.micro_batching == "none" else None,
        overlap_choices=(((1,) if router_aux else (1, 2, 4)) if arguments.tp_overlap == "auto"
                         else (arguments.tp_overlap,)),  # unsplit, sub-batched calls each have their own aux loss
        recompute_ratios=ratios,
        memory_limit_bytes=arguments.memory_limit or default_memory_limit(device, num_processes),
        sequence_parallel=arguments.sequence_parallel,
        clip_gradients=clip_gradients,
        vocab_parallel=arguments.vocab_parallel,
        sharding_modes=modes,
        shard_size=arguments.data_parallel_shard_size,
        overlap_grad_reduce=arguments.overlap_grad_reduce,
        grad_bucket_bytes=(arguments.grad_bucket_mb or DEFAULT_BUCKET_MB) * 2**20,
        ep_size=ep_size if merak_ep else 1,
        context_parallel_degrees=context_parallel_degrees(arguments, model, world),
        context_attention_methods=arguments.context_attention_methods,
        context_with_stages=context_runs_in_stages(module),
        vocab_stages_choices=_vocab_stages_choices(arguments),
        embedding_splits_with_head=embedding_splits_with_head(model, arguments.schedule),
    )
    num_experts = experts_per_layer(model) if merak_ep else None  # with ep_size unset, each ep dividing them is planned
    check_pipeline_search(arguments, candidate_layouts(space, num_blocks, num_experts))
    keys = required_profile_keys(space, num_blocks, num_experts)
    # on its own until the profiles are exchanged: minutes at long sequences, which the watchdog must not take for a
    # hang (working_alone); the exchange's own deadline is sized to the work
    with working_alone("profiling the model for the layout planner"):
        started = time.monotonic()
        with (training_precision(precision, device),  # what the step computes and saves under it
              grouped_experts(model) if merak_ep else contextlib.nullcontext()):  # the expert compute merak_ep runs
            profile = profile_model(model, inputs, call_model, tensor_parallel_plan, keys, factory,
                                    repeats=PLANNER_REPEATS, process_group_device=device,
                                    loss_of=loss_of,
                                    sequence_plan_of=sequence_parallel_plan if arguments.sequence_parallel else None,
                                    overlap_weight_gradients=arguments.weight_grad_overlap,
                                    materialize_with=materialize_with, fast_blocks=arguments.fast_blocks,
                                    budget_s=PLANNER_REPEAT_BUDGET_S)
        if keys.context_parallel:  # the attention a split sequence exchanges, and what a context rank computes of it
            context = context_attention_of(model, inputs, precision)
            with repeat_budget(PLANNER_REPEAT_BUDGET_S), training_precision(precision, device):
                whole, split = time_attention_kernels(context, keys.context_kernels, inputs.device, PLANNER_REPEATS)
            profile = dataclasses.replace(profile, context=context, attention_kernel_times=whole,
                                          context_kernel_times=split)
        # in the store, not a collective: ranks finish minutes apart at long sequences
        every_rank = gather_through_store(
            profile, exchange_key, max(arguments.timeout_s, PLANNER_WAIT_FACTOR * (time.monotonic() - started)),
            "profiling the model for the layout planner", "strategy.timeout_s (Merak3DStrategy(timeout_s=...))")
    profile = dataclasses.replace(average_profiles(every_rank), **state_ratios)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    probe_bytes = largest_network_probe(space.memory_limit_bytes)
    network = profile_network(keys.all_reduce_group_sizes, device,
                              large_bytes=min(probe_bytes, 64 << 20, max(1 << 16, profile.hidden_bytes_per_sample
                                                                          * inputs.shape[0])),
                              gradient_bytes=min(probe_bytes, 256 << 20, gradient_bytes), repeats=PLANNER_REPEATS,
                              pipeline=any(layout.pp > 1 for layout in candidate_layouts(space, num_blocks,
                                                                                         num_experts)))
    if merak_ep:
        sequence = inputs.shape[1] if inputs.ndim > 1 else 1
        profile = dataclasses.replace(profile, experts=expert_layers_of(model, sequence,
                                                                        profile.hidden_bytes_per_sample))
    if merak_ep or keys.all_to_all_group_sizes:  # the expert groups' token exchange, or all-to-all attention's
        exchange_bytes = (inputs.shape[0] * (profile.experts.top_k if merak_ep else 1)
                          * profile.hidden_bytes_per_sample)
        network = dataclasses.replace(network, all_to_all=measure_all_to_all(
            keys.all_to_all_group_sizes, device, large_bytes=min(probe_bytes, 64 << 20, max(1 << 16, exchange_bytes)),
            repeats=PLANNER_REPEATS))
    result = plan(space, profile, network)
    if arguments.planner_calibration != "analytic":  # rank by replaying the traced runs (memory stays the model's)
        result = replay_ranked(result, arguments.planner_calibration, model, inputs, arguments.partition)
    degrees = arguments.degrees
    allowed = allowed_predictions(arguments, result.ranked, lambda tp: _fully_shardable(model, tp))
    if not allowed:
        check_fixed_degrees_fit(arguments, [predict(layout, profile, network, space) for layout, _ in result.rejected],
                                lambda tp: _fully_shardable(model, tp), space.memory_limit_bytes)
        full_only = " (data_parallel_sharding='full' needs tensor_parallel <= key/value heads)" if modes == (
            "full",) else ""
        stages = (f" with pipeline_parallel>={least_pipeline_stages(arguments)} (micro_batching="
                  f"{arguments.micro_batching})" if least_pipeline_stages(arguments) > 1 else "")
        dropped = dropped_context_layouts(arguments, candidate_layouts(space, num_blocks, num_experts),
                                          profile.context)
        dropped_text = f" (the context-parallel layouts they leave do not run: {'; '.join(dropped)})" if dropped else ""
        room_left_out = {d: why for d, why in left_out.items() if d in tensor_parallel_room(arguments, world)}
        tensor_text = f" ({describe_left_out(room_left_out)})" if room_left_out else ""
        raise ValueError(f"no planned layout matches the fixed degrees {degrees}{stages}{full_only}{dropped_text}"
                         f"{tensor_text}; set more of them to 'auto'")
    best = allowed[0]
    chosen = best.layout
    runner_up = allowed[1] if len(allowed) > 1 else None
    lines = [f"merak3d planner: chose {chosen.describe()}, predicted step {best.step_time_s:.4g} s "
             f"({best.samples_per_step} samples, {best.memory_bytes / 2**30:.3g} GiB per rank, "
             f"data_parallel_sharding={chosen.sharding})"]
    if runner_up is not None:
        lines.append(f"merak3d planner: runner-up {runner_up.layout.describe()}, predicted step "
                     f"{runner_up.step_time_s:.4g} s ({runner_up.samples_per_step} samples)")
    lines.append(f"merak3d planner: {len(allowed)} layouts ranked, {len(result.rejected)} rejected for memory")
    lines += [f"merak3d planner: rejected {layout.describe()}: {why}" for layout, why in result.rejected[:4]]
    layout, best = broadcast((_adopted_layout(arguments, chosen), best), 0)  # rank 0's, whatever each measured
    rank_zero_info("\n".join(lines))
    return PlannedLayout(layout, result, best, frozenset(verified))


def replay_ranked(ranked: Any, paths: str, model: nn.Module, inputs: torch.Tensor, partition: str = "autopipe") -> Any:
    """``ranked`` re-ranked by the replay predictor calibrated from the comma-separated trace ``paths``; pipelines
    at the split the run's ``partition`` method gives them."""
    shape = model_shape(model, inputs.shape[1] if inputs.ndim > 1 else 1)
    if shape is None:
        raise ValueError("planner_calibration needs a model with a list of blocks; use 'analytic'")
    predictor = predictor_from_files([p.strip() for p in paths.split(",")], shape, inputs.shape[0], partition)
    return rerank(ranked, lambda layout: predictor.planner_step_time(layout, inputs.shape[0]))


def sharding_modes(arguments: Merak3DArguments, model: nn.Module, precision: Any,
                   optimizer: Optional[torch.optim.Optimizer]) -> tuple[str, ...]:
    """The data-parallel sharding modes the planner searches: the one the user fixed, or with ``"auto"`` every
    mode this run can use (the strategy refuses the others): no sharded mode under a loss-scaling precision
    (16-mixed), ``"optimizer"``/``"gradients"`` only with an optimizer that steps element by element (when it
    is known already), ``"full"`` not with MoE layers, the shifted critical-path schedule or sub-batches."""
    if arguments.data_parallel_sharding != "auto":
        return (arguments.data_parallel_sharding,)
    if getattr(precision, "scaler", None) is not None:
        return ("none",)
    modes = list(DATA_PARALLEL_SHARDING)
    if optimizer is not None:
        try:
            check_shardable_optimizer(optimizer, "auto")
        except ValueError:
            modes = [mode for mode in modes if mode not in ("optimizer", "gradients")]
    if moe_layers(model) or arguments.schedule == "shifted_critical_path" or arguments.tp_overlap not in (1, "auto"):
        modes.remove("full")
    return tuple(modes)


def context_runs_in_stages(view: Any) -> bool:
    """Whether a split sequence can also run in pipeline stages for this module (a
    :class:`~.network.ModuleView`): the last stage scores its rows with ``CausalLMModule``'s next-token loss, and
    a router aux loss carried across stages would see each context rank's tokens only."""
    module = view.module
    scored = view.contract and scores_next_token(module)
    router_aux = getattr(getattr(view.network, "config", None), "output_router_logits", False)
    return bool(scored and not router_aux)


def context_parallel_degrees(arguments: Merak3DArguments, model: nn.Module, world_size: int) -> tuple[int, ...]:
    """The context-parallel degrees to search: :meth:`Merak3DArguments.context_parallel_degrees`, only 1 for
    'auto' where the model rules splitting sequences out (logged with the reason)."""
    degrees = arguments.context_parallel_degrees(world_size)
    if arguments.context_parallel != "auto" or world_size == 1:
        return degrees
    problem = None
    if moe_layers(model):
        problem = "its cost model does not price expert-parallel MoE layers under context parallelism; set it"
    if problem is None:
        try:
            check_context_parallel_model(model, 2, "ring")
        except ValueError as error:
            problem = str(error)
    if problem is None and attention_shape(model) is None:
        problem = "its config names no hidden_size and num_attention_heads"
    if problem is not None:
        rank_zero_info(f"merak3d planner: plans context_parallel=1 only ({problem})")
        return (1,)
    return degrees


def context_attention_of(model: nn.Module, inputs: torch.Tensor, precision: Any) -> ContextAttention:
    """The attention shape of ``model`` at ``inputs``' sequence length that context parallelism exchanges; its
    elements are 16-bit under a 16-bit precision, else the parameters' size."""
    shape = attention_shape(model)
    if shape is None:
        raise ValueError(f"context parallelism needs the attention's shape from {type(model).__name__}'s config "
                         "(hidden_size, num_attention_heads); use context_parallel=1")
    hidden, heads, key_value_heads, head_dim = shape
    parameter = next((p for p in model.parameters() if p.is_floating_point()), None)
    sixteen_bit = str(getattr(precision, "precision", "")).startswith(("16", "bf16"))
    element_bytes = 2 if sixteen_bit else (parameter.element_size() if parameter is not None else 4)
    return ContextAttention(sequence_length=inputs.shape[1] if inputs.ndim > 1 else 1, hidden_size=hidden,
                            heads=heads, key_value_heads=key_value_heads, head_dim=head_dim,
                            element_bytes=element_bytes)


def _fully_shardable(model: nn.Module, tensor_parallel: int) -> bool:
    try:
        check_fully_shardable(model, tensor_parallel)
    except ValueError:
        return False
    return True


def state_bytes_per_parameter_byte(model: nn.Module, precision: Any,
                                   optimizer_factory: Callable[[Any], torch.optim.Optimizer]) -> dict[str, float]:
    """What each byte of ``model``'s parameters brings with it in this run, for the planner's memory model:
    the optimizer's state (counted on a small parameter it steps once: Adam's two moments are 2.0) and, under
    ``*-mixed`` precision, the 16-bit copies autocast makes of the fp32 parameters (the master weights) in use.
    The optimizer steps only what trains (the planner charges its state to the trainable bytes alone), so the
    probe takes a trainable parameter's dtype: adapters may train in another dtype than a frozen base."""
    floating = [p for p in model.parameters() if p.is_floating_point()]
    dtype = next((p.dtype for p in floating if p.requires_grad), floating[0].dtype if floating else torch.float32)
    probe = nn.Parameter(torch.zeros(64, dtype=dtype))
    probe.grad = torch.ones_like(probe)
    optimizer = optimizer_factory([probe])
    optimizer.step()
    state = sum(value.numel() * value.element_size() for value in optimizer.state[probe].values()
                if isinstance(value, torch.Tensor) and value.numel() == probe.numel())
    parameter_bytes = probe.numel() * probe.element_size()
    mixed = str(getattr(precision, "precision", "")).endswith("-mixed")
    copy = 2 / probe.element_size() if mixed and probe.element_size() > 2 else 0.0
    return {"optimizer_bytes_per_parameter_byte": state / parameter_bytes,
            "compute_copy_bytes_per_parameter_byte": copy}


def _data_parallel_layout(arguments: Merak3DArguments, world_size: int) -> Layout:
    """Every rank a whole replica: what is left for a model without a trunk of blocks to split or recompute
    (unprofiled, so ``data_parallel_sharding="auto"`` keeps whole replicas too)."""
    return Layout(
        data_parallel=world_size, pipeline_parallel=1, tensor_parallel=1, virtual_stages=arguments.stages_per_rank,
        schedule=arguments.schedule, micro_batches=arguments.micro_batches or default_micro_batches(1),
        micro_batches_by_default=arguments.micro_batches is None, tp_overlap=1, recompute="none",
        recompute_ratio=arguments.recompute_ratio,
        **_sharding_fields(arguments, "none" if arguments.data_parallel_sharding == "auto"
                           else arguments.data_parallel_sharding),
    )


def _sharding_fields(arguments: Merak3DArguments, mode: str) -> dict[str, Any]:
    """The adopted layout's sharding: the mode, and the user's shard size where a mode shards at all."""
    return {"data_parallel_sharding": mode,
            "data_parallel_shard_size": None if mode == "none" else arguments.data_parallel_shard_size}


def _vocab_stages_choices(arguments: Merak3DArguments) -> tuple[bool, ...]:
    """Whether the search may split the LM head over the stages: as asked (the build refuses what cannot run it)."""
    return {"off": (False,), "on": (True,), "auto": (False, True)}[arguments.vocab_stages]


def planned_arguments(arguments: Merak3DArguments, choice: Any) -> Merak3DArguments:
    """``arguments`` with ``vocab_stages='auto'`` off where the planner's ``choice`` (a ``planner.Prediction``, None
    when nothing was planned) keeps the head whole; where it priced the split faster, the build still checks that
    the model and layout run it (and AutoPipe's own simulation agrees) before splitting."""
    if choice is None or arguments.vocab_stages != "auto" or choice.layout.vocab_stages:
        return arguments
    return dataclasses.replace(arguments, vocab_stages="off")


def _adopted_layout(arguments: Merak3DArguments, chosen: Any) -> Layout:
    """The run's :class:`Layout` for the planner's ``chosen`` one (a ``planner.Layout``).

    Micro-batches are the count the planner priced (the user's; without one, one without stages and the planner's
    choice with them), but the user's under micro-batching, which plans each batch's own split. A
    recomputed ratio becomes ``"full"`` without stages and ``"stage_aware"`` with them. The planner's sharding mode
    is what ``layout.data_parallel_sharding`` reads.
    """
    micro_batches = (arguments.micro_batches if arguments.micro_batching != "none" and arguments.micro_batches
                     else chosen.micro_batches)
    by_default = chosen.pp == 1 and arguments.micro_batches is None
    if chosen.recompute_ratio == 0.0:
        recompute, ratio = "none", arguments.recompute_ratio
    elif chosen.pp == 1:
        recompute, ratio = "full", arguments.recompute_ratio
    else:
        recompute, ratio = "stage_aware", chosen.recompute_ratio
    return Layout(
        data_parallel=chosen.dp * chosen.cp, pipeline_parallel=chosen.pp, tensor_parallel=chosen.tp,
        virtual_stages=arguments.stages_per_rank, schedule=arguments.schedule, micro_batches=micro_batches,
        micro_batches_by_default=by_default, tp_overlap=chosen.overlap, recompute=recompute, recompute_ratio=ratio,
        context_parallel=chosen.cp, context_attention=chosen.context_attention,
        **_sharding_fields(arguments, chosen.sharding),
    )


def _splittable_degrees(model: nn.Module, inputs: torch.Tensor, degrees: tuple[int, ...], fixed: bool,
                        device: torch.device, broadcast: Broadcast, verified: set[int],
                        materialize_with: Optional[Callable[[nn.Module], Any]], left_out: dict[int, str]
                        ) -> tuple[int, ...]:
    """The degrees at which a split block computes what the whole block does; the planner searches only those.

    A degree the user fixed that fails is an error; an automatic one is left out, logged and added to ``left_out``
    with why. Those that pass are added to ``verified``.
    """
    if all(degree == 1 for degree in degrees):
        return degrees
    trace = trace_model(model, inputs[:1], call_model, profile=False, materialize_with=materialize_with)
    trunk = model.get_submodule(trace.trunk_path)
    kept = []
    for degree in degrees:
        problem = None
        if degree > 1:
            problem = unsplittable_structure(trunk, trace.trunk_path, trace, tensor_parallel_mesh(device, degree),
                                             broadcast, materialize_with)
        if problem is None:
            kept.append(degree)
            verified.add(degree)
        elif fixed:
            raise ValueError(f"tensor_parallel={degree}: {problem}")
        else:
            rank_zero_info(f"merak3d planner: leaves out tensor_parallel={degree}: {problem}")
            left_out[degree] = problem
    return tuple(kept)


NETWORK_PROBE_SHARE = 1 / 32
"""The planner's network probes are at most this share of the memory limit (64 KiB at least). Their costs are fitted
as latency + bytes / bandwidth and extrapolated to larger messages, while a probe as large as the whole gradient
set the peak of a run planned near its limit: its worst rank at 607 MiB above start on 4 ranks where the layout the
planner chose, set by hand, peaks at 366 MiB (``benchmarks.sharding``'s largest-model search at 68 layers, a 218 MiB
gradient; 411 MiB with the bound)."""


def largest_network_probe(memory_limit_bytes: float) -> int:
    """Bytes of the largest message :func:`profile_network` and :func:`measure_all_to_all` may time under
    ``memory_limit_bytes`` (each also keeps its own bound: 64 MiB, and 256 MiB for the gradient synchronisation)."""
    return max(1 << 16, int(memory_limit_bytes * NETWORK_PROBE_SHARE))


def default_memory_limit(device: torch.device, num_processes: int) -> float:
    """90% of the device's memory, or of the host memory available per process on CPU."""
    if device.type == "cuda":
        return 0.9 * torch.cuda.mem_get_info(device)[1]
    with open("/proc/meminfo") as meminfo:
        available_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    return 0.9 * available_kib * 1024 / max(1, num_processes)


def check_step_time(clock: BatchClock, choice: Any, device: torch.device, trainer: Any) -> StepTimeCheck:
    """Log the slowest rank's median step next to the plan's prediction; warn when they disagree."""
    slowest = torch.tensor(clock.median_s(), dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    check = StepTimeCheck(choice.step_time_s, float(slowest), len(clock.durations_s))
    rank_zero_info(check.describe())
    if check.suspect:
        rank_zero_warn(
            f"the planner's predicted step is {100 * check.error:+.0f}% off the measured one, so layouts it "
            "ranked close to this one may be faster; fix the degrees, or plan again on a quieter machine"
        )
    for logger in trainer.loggers:
        logger.log_metrics({"planner/predicted_step_s": check.predicted_s,
                            "planner/measured_step_s": check.measured_s}, step=trainer.global_step)
    return check
