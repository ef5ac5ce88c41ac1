"""``Trainer(strategy="merak3d")``: data × pipeline × tensor parallelism for unmodified models.

The LightningModule stays an ordinary module that also trains on one device. merak3d
relies on four things it provides (:class:`lightning_merak.models.CausalLMModule` has
them all):

* ``self.model`` — the network, called as ``self.model(inputs)`` and returning logits
  (a tensor, or an output with ``.logits`` such as transformers models return);
* ``split_batch(batch) -> (inputs, targets)``;
* ``loss_from_logits(logits, targets) -> loss`` — evaluated per micro-batch;
* ``compute_loss(batch)`` — called by its ``training_step``/``validation_step``;
  merak3d replaces it on the instance so that it drives the pipeline schedule.

The parallel layout is built on the first batch, when the real shapes are known: the
model is recorded once (:mod:`~lightning_merak.strategies.pipeline.trace`), every rank
agrees on rank 0's partition of the measured costs, each rank prunes its copy to its
stage, splits its blocks over the tensor-parallel group, wraps the blocks chosen for
recomputation, and the optimizers are rebuilt over the parameters the rank now owns.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from lightning_merak.plugins.moe.checkpoint import EXPERTS_KEY, split_expert_key
from lightning_merak.strategies import random_state
from lightning_merak.strategies.overlap import SubBatchForward, collective_replay_contexts
from lightning_merak.strategies.pipeline.schedules import (
    ScheduleShiftedCriticalPath,
    pipeline_stage_class,
    shifted_schedule_available,
)
from lightning_merak.strategies.pipeline.stage import RankStages, build_stage_module, tied_parameter_names
from lightning_merak.strategies.pipeline.trace import ModelTrace, find_trunk, trace_model
from lightning_merak.strategies.planner.step_check import BatchClock, StepTimeCheck
from lightning_merak.strategies.sequence_parallel import (
    SequenceParallelPlan,
    check_sequence_length,
    find_sequence_parallel_plan,
    sequence_partial_parameters,
    split_sequence_between,
)
from lightning_merak.strategies.tensor_parallel import (
    LayoutChange,
    TensorParallelPlan,
    apply_tensor_parallel,
    check_tensor_parallel_degree,
    find_tensor_parallel_plan,
    region_partial_parameters,
    verify_tensor_parallel_plan,
)
from lightning_merak.termination import install_termination_handler

__all__ = ["Merak3DStrategy"]

LIGHTNING_CHECKPOINT = "lightning.ckpt"
SCHEDULES = ("1f1b", "gpipe", "shifted_critical_path", "interleaved_1f1b", "interleaved_zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble")
RECOMPUTE_MODES = ("none", "full", "stage_aware", "auto")
PARTITION_METHODS = ("autopipe", "min_max", "parameters", "uniform")
PLANNER_REPEATS = 11
"""Timed repeats per profiled quantity (median). With 5, three planning runs on 2 shared cores
predicted the same layouts up to 25% apart; with 11, within about 8%."""
STEP_CHECK_WARMUP, STEP_CHECK_BATCHES = 2, 5
"""A planned run compares the median of batches 3–7 with the prediction (the first ones build and warm up)."""
Degree = Union[int, Literal["auto"]]


def _call_model(model: nn.Module, inputs: torch.Tensor) -> Any:
    return model(inputs)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=collective_replay_contexts, **kwargs)


def _check_stage_count(num_stages: int, num_blocks: int) -> None:
    nodes = num_blocks + 2
    if num_stages > nodes:
        raise ValueError(
            f"{num_stages} pipeline stages (pipeline_parallel × virtual_stages) exceed the {nodes} nodes of "
            f"the model (embedding, {num_blocks} blocks, head); use at most {nodes} stages"
        )


def _default_micro_batches(pipeline_parallel: int) -> int:
    """Two micro-batches per stage keep the pipeline's bubble small; without stages the batch stays whole."""
    return 2 * pipeline_parallel if pipeline_parallel > 1 else 1


def _schedule_problem(micro_batches: int, pipeline_parallel: int, schedule: str) -> Optional[str]:
    """Why ``schedule`` cannot run ``micro_batches`` micro-batches over ``pipeline_parallel`` stages, or None.

    Every schedule needs a micro-batch per stage; torch's interleaved schedules run them in
    ``micro_batches // pipeline_parallel`` rounds of equal size.
    """
    if pipeline_parallel == 1:
        return None
    if micro_batches < pipeline_parallel:
        return (f"micro_batches={micro_batches} is smaller than pipeline_parallel={pipeline_parallel}; "
                "pipeline schedules need at least one micro-batch per stage")
    rounds = micro_batches // pipeline_parallel
    if schedule in MULTI_STAGE_SCHEDULES and micro_batches % rounds:
        return (f"schedule={schedule!r} runs micro_batches={micro_batches} in {micro_batches} // "
                f"pipeline_parallel={pipeline_parallel} = {rounds} rounds of equal size, and {rounds} does not "
                f"divide {micro_batches}")
    return None


def _check_micro_batches(micro_batches: int, pipeline_parallel: int, schedule: str) -> None:
    """Refuse a micro-batch count the pipeline schedule cannot run; a multiple of the stages always runs."""
    problem = _schedule_problem(micro_batches, pipeline_parallel, schedule)
    if problem is not None:
        raise ValueError(f"{problem}; set micro_batches to a multiple of pipeline_parallel={pipeline_parallel} "
                         f"(the default is {_default_micro_batches(pipeline_parallel)})")


def _check_accumulation(accumulate_grad_batches: int) -> None:
    if accumulate_grad_batches != 1:
        raise ValueError(
            "merak3d splits each batch into micro-batches itself; set accumulate_grad_batches=1 "
            "and raise micro_batches (and the batch size) instead"
        )


def _check_module_members(module: pl.LightningModule) -> None:
    missing = [name for name in ("model", "split_batch", "loss_from_logits", "compute_loss")
               if not hasattr(module, name)]
    if missing:
        raise TypeError(
            f"merak3d needs {', '.join(missing)} on {type(module).__name__}: see "
            "lightning_merak.strategies.merak3d for the four members it relies on"
        )


def _divides_model(config: Any, tensor_parallel: int) -> bool:
    try:
        check_tensor_parallel_degree(config, tensor_parallel)
    except ValueError:
        return False
    return True


def _expert_parallel_group(group_name: Optional[str]) -> dist.ProcessGroup:
    """DeepSpeed's expert-parallel group of the expert weights named ``group_name``."""
    from deepspeed.utils import groups

    if group_name is None or group_name not in groups._get_expert_parallel_group_dict():
        raise RuntimeError(
            f"expert weights (allreduce=False) of group {group_name!r} have no DeepSpeed expert-parallel group; "
            "create the MoE layers' groups (lightning_merak.plugins.moe) before clipping gradients"
        )
    return groups._get_expert_parallel_group(group_name)


def average_gradients(grads: list[torch.Tensor], group: dist.ProcessGroup, replicas: int) -> None:
    """Average ``grads`` in place over ``replicas`` ranks with one all-reduce of their concatenation (1: the sum)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= replicas
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squares of ``grads``, accumulated in float64 so every layout sums to the same norm.

    ``vector_norm`` with a float64 ``dtype`` converts inside the reduction; squaring a float64
    copy of each gradient (``grad.double().pow(2).sum()``) gives the same figure several times
    slower, since it writes two gradient-sized temporaries per tensor.
    """
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        squares += torch.linalg.vector_norm(grad, dtype=torch.float64).square()
    return squares


def scale_gradients(grads: list[torch.Tensor], coefficient: float) -> None:
    """Multiply ``grads`` in place by ``coefficient`` (clipping's second pass)."""
    for grad in grads:
        grad.mul_(coefficient)


def _moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every MoE layer in ``model`` (none unless the MoE plugin was imported)."""
    moe_layer = sys.modules.get("lightning_merak.plugins.moe.layer")
    if moe_layer is None:
        return []
    return [(name, module) for name, module in model.named_modules() if isinstance(module, moe_layer.MoE)]


def _expert_layers(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Key prefix of each expert-parallel MoE layer's experts in ``model`` → (ep_size, experts per rank).

    Every EP rank numbers its experts from 0; checkpoints number them globally.
    """
    return {
        f"{name}.{EXPERTS_KEY}": (module.ep_size, module.num_local_experts)
        for name, module in _moe_layers(model)
        if module.ep_size > 1
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@contextlib.contextmanager
def _in_training_mode(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` in training mode meanwhile, then back in its own mode.

    The build records and times the model as a training batch runs it, whichever loop brought
    the batch (evaluation loops put the module in eval mode).
    """
    modes = {module: module.training for module in model.modules()}
    model.train()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """The random generators as they were before, whatever was drawn inside.

    Lightning restores them after its sanity check but not after a training batch, so a draw
    while building (dropout in the traced forwards, a layer's initialisation) moved the masks of
    a run whose layout was built on a training batch and not those of one built in the check.
    """
    states = random_state.capture()
    try:
        yield
    finally:
        random_state.restore(states)


class Merak3DStrategy(ParallelStrategy):
    """Automated 3D parallelism: ``data_parallel × pipeline_parallel × tensor_parallel`` ranks.

    When ``pipeline_parallel``, ``tensor_parallel``, ``tp_overlap`` or ``recompute`` is
    ``"auto"``, the layout planner profiles this machine and model at setup (one batch of the
    training dataloader gives the shapes) and picks the layout with the least predicted time
    per sample that fits ``memory_limit``; it logs its choice, the runner-up and the predicted
    step time (``layout_plan`` keeps the whole ranking, ``layout_choice`` the chosen layout's
    prediction, within the degrees fixed by the user). ``plan_only=True`` stops after that.

    Args:
        data_parallel: replicas of the model; ``"auto"`` takes what the other degrees leave.
        pipeline_parallel: pipeline stages the model is cut into (``"auto"``: planned).
        tensor_parallel: ranks each transformer block is split over (``"auto"``: planned).
        tp_overlap: sub-batches each micro-batch is split into so that one sub-batch's
            tensor-parallel all-reduce runs while the next computes, across blocks, in forward and
            backward (1 = no overlap; ``"auto"``: planned). It must divide the micro-batch size.
        tp_weight_grad_overlap: in backward, each column group (q/k/v, gate/up) all-reduces its
            input gradient (reduce-scatters it, with sequence parallelism) while it computes its
            weight gradients, so that collective is hidden without sub-batches too. Default: on,
            except with ``"interleaved_zero_bubble"``, which computes weight gradients in a pass of
            their own (``True`` is refused there).
        sequence_parallel: split the blocks' norms, dropout and residual stream along the sequence
            over the tensor-parallel ranks (:mod:`~lightning_merak.strategies.sequence_parallel`):
            each all-reduce becomes a reduce-scatter and an all-gather, activations between the
            split layers shrink by ``tensor_parallel``. The sequence length must divide by it. The
            planner times real sequence-parallel blocks, prices the activations they split over the
            sequence, and searches only tensor-parallel degrees dividing the sequence.
        micro_batches: micro-batches per batch in the pipeline schedule (default: 2 × stages).
        schedule: ``"1f1b"``, ``"gpipe"``, ``"shifted_critical_path"`` (Merak: cool-down forwards
            keep no activations and are recomputed while their gradients are in flight) or
            ``"interleaved_1f1b"`` / ``"interleaved_zero_bubble"`` (each rank runs ``virtual_stages``
            stages, round-robin; zero-bubble also splits backward into input and weight gradients).
        virtual_stages: stages per rank for the interleaved schedules.
        recompute: ``"none"``, ``"full"`` (every block) or ``"stage_aware"`` (Merak: stage i of
            S recomputes a fraction 1 − (1 − r)(S − 1)/(S − 1 − i) of its blocks, the last none),
            or ``"auto"`` (planned among ratios 0, 0.5 and 1).
        recompute_ratio: r above, the fraction recomputed on the first stage.
        partition: ``"autopipe"`` (min–max split refined by simulating the schedule),
            ``"min_max"``, ``"parameters"`` or ``"uniform"`` (equal blocks per stage).
        process_group_backend: ``gloo``/``nccl``; default from the device.
        timeout_s: collective timeout, so a failed rank ends every rank.
        memory_limit: bytes per rank the planner must fit (default: 90% of the device's memory,
            or of the host memory available per process on CPU).
        plan_only: plan the layout, log it, and stop before training.
    """

    strategy_name = "merak3d"

    def __init__(
        self,
        data_parallel: Degree = "auto",
        pipeline_parallel: Degree = 1,
        tensor_parallel: Degree = 1,
        tp_overlap: Degree = 1,
        tp_weight_grad_overlap: Optional[bool] = None,
        sequence_parallel: bool = False,
        micro_batches: Optional[int] = None,
        schedule: str = "1f1b",
        virtual_stages: int = 2,
        recompute: str = "none",
        recompute_ratio: float = 0.5,
        partition: str = "autopipe",
        process_group_backend: Optional[str] = None,
        timeout_s: float = 600.0,
        memory_limit: Optional[float] = None,
        plan_only: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("data_parallel", data_parallel), ("pipeline_parallel", pipeline_parallel),
                            ("tensor_parallel", tensor_parallel)):
            if value != "auto" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer or 'auto'")
        if tp_overlap != "auto" and (not isinstance(tp_overlap, int) or tp_overlap < 1):
            raise ValueError(f"tp_overlap={tp_overlap!r} must be a positive integer (1 = no overlap) or 'auto'")
        if sequence_parallel and tensor_parallel == 1:
            raise ValueError(
                "sequence_parallel=True splits the sequence over the tensor-parallel ranks, but tensor_parallel=1; "
                "set tensor_parallel>1 (or 'auto') or sequence_parallel=False"
            )
        if tp_overlap != 1 and schedule == "interleaved_zero_bubble":
            raise ValueError(
                "tp_overlap>1 runs each stage's backward as a whole, which interleaved_zero_bubble splits into "
                "input and weight gradients; use schedule='interleaved_1f1b' or tp_overlap=1"
            )
        if tp_weight_grad_overlap and schedule == "interleaved_zero_bubble":
            raise ValueError(
                "tp_weight_grad_overlap=True computes weight gradients in the input-gradient pass, which "
                "interleaved_zero_bubble keeps apart; leave tp_weight_grad_overlap unset or use another schedule"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not supported; choose one of {', '.join(SCHEDULES)}")
        if schedule == "shifted_critical_path" and not shifted_schedule_available():
            raise ValueError(
                "schedule='shifted_critical_path' needs pipelining internals this torch does not have; "
                "use schedule='1f1b' or the tested torch 2.13"
            )
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={recompute!r} is not supported; choose one of {', '.join(RECOMPUTE_MODES)}")
        if not 0.0 <= recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio={recompute_ratio} must lie in [0, 1]")
        if partition not in PARTITION_METHODS:
            raise ValueError(f"partition={partition!r} is not supported; choose one of {', '.join(PARTITION_METHODS)}")
        if virtual_stages < 1 or (schedule in MULTI_STAGE_SCHEDULES and virtual_stages < 2):
            raise ValueError(
                f"virtual_stages={virtual_stages} must be at least 2 with schedule={schedule!r} (1 otherwise)"
            )
        if micro_batches is not None and micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches} must be at least 1")
        if micro_batches is not None and isinstance(pipeline_parallel, int):
            _check_micro_batches(micro_batches, pipeline_parallel, schedule)
        self._degrees: dict[str, Degree] = {"dp": data_parallel, "pp": pipeline_parallel, "tp": tensor_parallel}
        self._micro_batches = micro_batches
        self.tp_overlap = tp_overlap
        self.tp_weight_grad_overlap = (schedule != "interleaved_zero_bubble" if tp_weight_grad_overlap is None
                                       else tp_weight_grad_overlap)
        self.sequence_parallel = sequence_parallel
        self.memory_limit = memory_limit
        self.plan_only = plan_only
        self.layout_plan: Optional[Any] = None
        self.layout_choice: Optional[Any] = None
        """The planner's prediction for the layout this run adopted (a ``planner.Prediction``)."""
        self.step_time_check: Optional[StepTimeCheck] = None
        """A planned run's measured step next to its prediction, once its first batches ran."""
        self._verified_tp_degrees: set[int] = set()
        """Tensor-parallel degrees whose split was already checked against the whole block (while planning)."""
        self._batch_clock: Optional[BatchClock] = None
        self.last_gradient_norm: Optional[float] = None
        """Total gradient norm (all stages, shards and experts) before the last clipping."""
        self._expert_prefixes: dict[str, tuple[int, int]] = {}
        self._reading_planning_batch = False
        self.schedule = schedule
        self.virtual_stages = virtual_stages if schedule in MULTI_STAGE_SCHEDULES else 1
        self.recompute = recompute
        self.recompute_ratio = recompute_ratio
        self.partition_method = partition
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(seconds=timeout_s)
        self._mesh: Optional[DeviceMesh] = None
        self._built = False
        self._built_in_evaluation = False
        self._schedule: Any = None
        self._tied_groups: list[tuple[Any, nn.Parameter, bool]] = []
        self._pending_gradients: list[tuple[nn.Parameter, Optional[torch.Tensor]]] = []
        self._layout_changes: dict[str, LayoutChange] = {}
        self._pending_optimizer_states: list[dict[str, Any]] = []
        self._local_blocks: dict[int, nn.Module] = {}
        self._tensor_partial: list[nn.Parameter] = []
        """Unsplit parameters of split blocks that see only this rank's heads or tokens: gradients summed over tp."""
        self.partition: Optional[Any] = None
        self.num_nodes = 1

    # Layout -------------------------------------------------------------------------------

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("the device mesh exists once processes have started (setup_environment)")
        return self._mesh

    @property
    def data_parallel(self) -> int:
        return self.device_mesh["dp"].size()

    @property
    def pipeline_parallel(self) -> int:
        return self.device_mesh["pp"].size()

    @property
    def tensor_parallel(self) -> int:
        return self.device_mesh["tp"].size()

    @property
    def micro_batches(self) -> int:
        return self._micro_batches or _default_micro_batches(self.pipeline_parallel)

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """The group gradients are averaged over; callbacks use it for their own communication."""
        return self.device_mesh["dp"].get_group()

    @property
    def layout_built(self) -> bool:
        """Whether the first batch has built the layout (stages cut, blocks sharded)."""
        return self._built

    @property
    def local_blocks(self) -> dict[int, nn.Module]:
        """This rank's transformer blocks by trunk index, once the layout is built.

        Callbacks that manage blocks (memory managers, profilers) use it: with
        ``pipeline_parallel>1`` a rank holds only its stages' blocks.
        """
        return dict(self._local_blocks)

    def resolve_layout(self, world_size: int) -> tuple[int, int, int]:
        """``(dp, pp, tp)`` for ``world_size`` ranks, or a clear error when they cannot multiply to it."""
        fixed = {name: value for name, value in self._degrees.items() if value != "auto"}
        product = math.prod(fixed.values())
        auto = [name for name in ("dp", "pp", "tp") if name not in fixed]
        if world_size % product:
            raise ValueError(
                f"world size {world_size} is not divisible by the fixed degrees {fixed}; "
                "choose data_parallel × pipeline_parallel × tensor_parallel = world size"
            )
        resolved = dict(fixed)
        for name in auto:
            resolved[name] = 1
        if auto:
            resolved["dp" if "dp" in auto else auto[0]] = world_size // product
        if math.prod(resolved.values()) != world_size:
            raise ValueError(
                f"data_parallel={resolved['dp']} × pipeline_parallel={resolved['pp']} × "
                f"tensor_parallel={resolved['tp']} = {math.prod(resolved.values())} ≠ world size {world_size}; "
                "make the product equal the number of processes (devices × num_nodes)"
            )
        return resolved["dp"], resolved["pp"], resolved["tp"]

    def validate_arguments(self, world_size: int, *, batch_size: Optional[int] = None,
                           sequence_length: Optional[int] = None, accumulate_grad_batches: int = 1) -> None:
        """Refuse, before the model is even built, a layout that the world size or the batches rule out.

        ``batch_size`` is the batch each data-parallel replica's dataloader yields and
        ``sequence_length`` its tokens per sample; the checks that need them are skipped without
        them. Degrees left to the planner are checked once it has chosen them, at setup.
        """
        _check_accumulation(accumulate_grad_batches)
        pp, tp = self._launch_degrees(world_size)
        if tp is not None:
            self._check_overlap(tp)
            if self.sequence_parallel and tp > 1 and sequence_length is not None:
                check_sequence_length(sequence_length, tp)
        if batch_size is not None and (self._micro_batches is not None or not self.needs_planning):
            self._check_batch_split(batch_size, pp or 1)

    def validate_before_launch(self, module: pl.LightningModule, world_size: int, *, batch_size: Optional[int] = None,
                               sequence_length: Optional[int] = None, accumulate_grad_batches: int = 1) -> None:
        """Refuse, before any process starts, a layout that the world size, the batches or the model rule out.

        Runs :meth:`validate_arguments` first. What is left for the first batch needs the traced
        model or the real batch: whether a block splits exactly over the tensor-parallel ranks, and
        the shape of each batch.
        """
        self.validate_arguments(world_size, batch_size=batch_size, sequence_length=sequence_length,
                                accumulate_grad_batches=accumulate_grad_batches)
        _check_module_members(module)
        self._check_model(module.model, *self._launch_degrees(world_size))

    def _launch_degrees(self, world_size: int) -> tuple[Optional[int], Optional[int]]:
        """``(pp, tp)`` this run will use on ``world_size`` ranks; None for a degree the planner chooses."""
        if not self.needs_planning:
            _, pp, tp = self.resolve_layout(world_size)
            return pp, tp
        fixed = [value for value in self._degrees.values() if value != "auto"]
        if world_size % math.prod(fixed):
            raise ValueError(
                f"world size {world_size} is not divisible by the fixed degrees {fixed}; "
                "choose degrees whose product divides the number of processes"
            )
        pp, tp = self._degrees["pp"], self._degrees["tp"]
        return (pp if isinstance(pp, int) else None), (tp if isinstance(tp, int) else None)

    def _check_model(self, model: nn.Module, pipeline_parallel: Optional[int], tensor_parallel: Optional[int]) -> None:
        """Refuse degrees the unsplit model's config or structure rules out (None: not chosen yet)."""
        if tensor_parallel is not None:
            check_tensor_parallel_degree(getattr(model, "config", None), tensor_parallel)
        if self.sequence_parallel and tensor_parallel is not None and tensor_parallel > 1 and _moe_layers(model):
            raise ValueError("sequence_parallel does not support MoE layers; use sequence_parallel=False")
        if pipeline_parallel is not None and pipeline_parallel > 1:
            _check_stage_count(pipeline_parallel * self.virtual_stages, len(find_trunk(model)[1]))

    def _check_batch_split(self, batch_size: int, pipeline_parallel: int) -> None:
        """Refuse a batch that does not split into the micro-batches, and those into tp_overlap sub-batches.

        The error lists the micro-batch counts that would split it.
        """
        micro_batches = self._micro_batches or _default_micro_batches(pipeline_parallel)
        overlap = self.tp_overlap if isinstance(self.tp_overlap, int) else 1

        def splits(count: int) -> bool:
            return batch_size % count == 0 and (batch_size // count) % overlap == 0

        if splits(micro_batches):
            return
        if batch_size % micro_batches:
            origin = "" if self._micro_batches else f" (the default, 2 × pipeline_parallel={pipeline_parallel})"
            problem = f"batch size {batch_size} is not divisible by micro_batches={micro_batches}{origin}"
        else:
            problem = (f"micro-batches of {batch_size // micro_batches} samples (batch size {batch_size} / "
                       f"micro_batches={micro_batches}) cannot be split into tp_overlap={overlap} sub-batches")
        fits = [count for count in range(1, batch_size + 1)
                if splits(count) and _schedule_problem(count, pipeline_parallel, self.schedule) is None]
        choices = f"set micro_batches to {' or '.join(map(str, fits))}, or " if fits else ""
        raise ValueError(f"{problem}; {choices}make the batch size a multiple of {micro_batches * overlap}")

    @property
    def needs_planning(self) -> bool:
        """Whether the layout planner chooses part of the layout (an ``"auto"`` beyond data_parallel)."""
        return "auto" in (self._degrees["pp"], self._degrees["tp"], self.tp_overlap, self.recompute)

    def _check_overlap(self, tensor_parallel: int) -> None:
        if isinstance(self.tp_overlap, int) and self.tp_overlap != 1 and tensor_parallel == 1:
            raise ValueError(
                f"tp_overlap={self.tp_overlap} overlaps tensor-parallel communication, but tensor_parallel=1; "
                "set tensor_parallel>1 or tp_overlap=1"
            )

    # Processes ----------------------------------------------------------------------------

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to reduce ``self.log(..., sync_dist=True)`` values over the ranks."""
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._reading_planning_batch:
            return {"num_replicas": 1, "rank": 0}
        mesh = self.device_mesh["dp"]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        # before the rendezvous, so a rank waiting for its peers also ends on SIGTERM/SIGINT
        install_termination_handler()
        super().setup_environment()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        self._process_group_backend = backend
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        # a layout built by an earlier validate/predict keeps its mesh: its shards and groups live on it
        if not self.needs_planning and self._mesh is None:
            self._create_mesh()

    def _create_mesh(self) -> None:
        dp, pp, tp = self.resolve_layout(self.world_size)
        self._mesh = init_device_mesh(self.root_device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        rank_zero_info(f"merak3d: data_parallel={dp} pipeline_parallel={pp} tensor_parallel={tp}, "
                       f"tp_overlap={self.tp_overlap}, sequence_parallel={self.sequence_parallel}, "
                       f"schedule={self.schedule}, micro_batches={self.micro_batches}, "
                       f"recompute={self.recompute}")

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        _check_module_members(module)
        _check_accumulation(trainer.accumulate_grad_batches)
        if self.needs_planning:
            self._check_model(module.model, *self._launch_degrees(self.world_size))
            self._plan_layout(trainer)
            self._create_mesh()
            if self.plan_only:
                trainer.should_stop = True
                trainer.num_sanity_val_steps = 0
        if not self._built:  # a layout built by an earlier validate or predict passed these and holds only its part
            _check_micro_batches(self.micro_batches, self.pipeline_parallel, self.schedule)
            self._check_overlap(self.tensor_parallel)
            self._check_model(module.model, self.pipeline_parallel, self.tensor_parallel)
        self.model_to_device()
        if not self._built:  # once built, ranks hold different stages and shards, synchronised when built
            for tensor in [*self._replicated_parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def barrier(self, name: Optional[str] = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Reduce a tensor (``self.log(..., sync_dist=True)``) over ``group`` in place, with one all-reduce.

        Lightning's DDP reduction puts a barrier before the all-reduce; the all-reduce
        synchronises the ranks by itself, and the barrier cost every synced metric another
        round trip per step (0.2 ms of 0.4 on 2 gloo ranks).
        """
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        group = dist.group.WORLD if group is None else group
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if reduce_op is None or mean:
            op = dist.ReduceOp.SUM
        elif isinstance(reduce_op, str):
            op = getattr(dist.ReduceOp, reduce_op.upper())
        else:
            op = reduce_op
        dist.all_reduce(tensor, op=op, group=group)
        if not mean:
            return tensor
        ranks = dist.get_world_size(group)
        return tensor.div_(ranks) if tensor.is_floating_point() else tensor.copy_(tensor / ranks)

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # Planning --------------------------------------------------------------------------

    def _planning_batch(self, trainer: pl.Trainer) -> tuple[torch.Tensor, Any]:
        """The inputs and targets of one training batch: the planner profiles at the real shapes.

        The layout (and so the data-parallel rank) does not exist yet: a dataloader built
        now sees one replica.
        """
        source = getattr(trainer.fit_loop, "_data_source", None)
        if source is None or not hasattr(source, "dataloader") or not source.is_defined():
            raise RuntimeError(
                "the layout planner reads one training batch for its shapes but found no train dataloader; "
                "fit with training data, or set pipeline_parallel, tensor_parallel, tp_overlap and recompute"
            )
        self._reading_planning_batch = True
        try:
            batch = next(iter(source.dataloader()))
        finally:
            self._reading_planning_batch = False
        return self.lightning_module.split_batch(super().batch_to_device(batch))

    def _plan_layout(self, trainer: pl.Trainer) -> None:
        """Profile this machine and model, search the layouts, and adopt the best one."""
        from lightning_merak.strategies.layout_profiler import profile_model, profile_network
        from lightning_merak.strategies.planner import (
            SearchSpace,
            average_profiles,
            candidate_layouts,
            plan,
            required_profile_keys,
        )

        module = self.lightning_module
        model: nn.Module = module.model
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False
        inputs, targets = self._planning_batch(trainer)
        world = self.world_size
        if self._degrees["tp"] != "auto":
            tp_degrees = (self._degrees["tp"],)
        else:
            sequence = inputs.shape[1] if inputs.ndim > 1 else 1
            tp_degrees = tuple(d for d in range(1, self.num_processes + 1)
                               if world % d == 0 and _divides_model(config, d)
                               and not (self.sequence_parallel and sequence % d))
        tp_degrees = self._splittable_degrees(model, inputs, tp_degrees)
        num_blocks = len(find_trunk(model)[1])
        fixed_pp = self._degrees["pp"] if self._degrees["pp"] != "auto" else None
        ratios = {"none": (0.0,), "full": (1.0,), "stage_aware": (self.recompute_ratio,),
                  "auto": (0.0, 0.5, 1.0)}[self.recompute]
        space = SearchSpace(
            world_size=world, global_batch_size=None, replica_batch_size=inputs.shape[0],
            tp_degrees_allowed=tp_degrees, max_pipeline_stages=fixed_pp or min(world, num_blocks + 2),
            micro_batch_choices=(self._micro_batches,) if self._micro_batches else None,
            overlap_choices=(1, 2, 4) if self.tp_overlap == "auto" else (self.tp_overlap,),
            recompute_ratios=ratios, memory_limit_bytes=self.memory_limit or self._default_memory_limit(),
            sequence_parallel=self.sequence_parallel,
            clip_gradients=bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm in (None, "norm"),
        )
        keys = required_profile_keys(space, num_blocks)
        optimizer = self.optimizers[0] if self.optimizers else None
        factory = (lambda params: type(optimizer)(params, **optimizer.defaults)) if optimizer is not None else (
            lambda params: torch.optim.AdamW(params))
        profile = profile_model(model, inputs, _call_model, self._tensor_parallel_plan, keys, factory,
                                repeats=PLANNER_REPEATS, process_group_device=self.root_device,
                                loss_of=lambda logits, samples: module.loss_from_logits(logits, targets[:samples]),
                                sequence_plan_of=self._sequence_parallel_plan if self.sequence_parallel else None,
                                overlap_weight_gradients=self.tp_weight_grad_overlap)
        every_rank: list[Any] = [None] * world
        dist.all_gather_object(every_rank, profile)
        profile = average_profiles(every_rank)
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        network = profile_network(keys.all_reduce_group_sizes, self.root_device,
                                  large_bytes=min(64 << 20, max(1 << 16, profile.hidden_bytes_per_sample
                                                                * inputs.shape[0])),
                                  gradient_bytes=min(256 << 20, gradient_bytes), repeats=PLANNER_REPEATS,
                                  pipeline=any(layout.pp > 1 for layout in candidate_layouts(space, num_blocks)))
        result = plan(space, profile, network)
        allowed = [p for p in result.ranked
                   if all(self._degrees[name] in ("auto", value) for name, value in
                          (("dp", p.layout.dp), ("pp", p.layout.pp), ("tp", p.layout.tp)))]
        if not allowed:
            raise ValueError(f"no planned layout matches the fixed degrees {self._degrees}; set more of them to 'auto'")
        best = allowed[0]
        self.layout_plan = result
        self.layout_choice = best
        layout = best.layout
        self._degrees = {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp}
        if layout.pp > 1:
            self._micro_batches = layout.micro_batches
        self.tp_overlap = layout.overlap
        if layout.recompute_ratio == 0.0:
            self.recompute = "none"
        elif layout.pp == 1:
            self.recompute = "full"
        else:
            self.recompute, self.recompute_ratio = "stage_aware", layout.recompute_ratio
        runner_up = allowed[1] if len(allowed) > 1 else None
        lines = [f"merak3d planner: chose {layout.describe()}, predicted step {best.step_time_s:.4g} s "
                 f"({best.samples_per_step} samples, {best.memory_bytes / 2**30:.3g} GiB per rank)"]
        if runner_up is not None:
            lines.append(f"merak3d planner: runner-up {runner_up.layout.describe()}, predicted step "
                         f"{runner_up.step_time_s:.4g} s ({runner_up.samples_per_step} samples)")
        lines.append(f"merak3d planner: {len(allowed)} layouts ranked, {len(result.rejected)} rejected for memory")
        rank_zero_info("\n".join(lines))

    def _splittable_degrees(self, model: nn.Module, inputs: torch.Tensor, degrees: tuple[int, ...]) -> tuple[int, ...]:
        """The degrees at which a split block computes what the whole block does; the planner searches only those.

        A degree the user fixed that fails is an error; an automatic one is left out and logged.
        """
        from lightning_merak.strategies.layout_profiler import tensor_parallel_mesh

        if all(degree == 1 for degree in degrees):
            return degrees
        trace = trace_model(model, inputs[:1], _call_model, profile=False)
        block = model.get_submodule(trace.trunk_path)[0]
        try:
            plan: Optional[TensorParallelPlan] = self._tensor_parallel_plan(block, trace)
            unsplittable = None
        except ValueError as error:
            plan, unsplittable = None, str(error)
        kept = []
        for degree in degrees:
            problem = None
            if degree > 1:
                problem = unsplittable if plan is None else self._split_block_problem(
                    block, trace, plan, tensor_parallel_mesh(self.root_device, degree))
            if problem is None:
                kept.append(degree)
                self._verified_tp_degrees.add(degree)
            elif self._degrees["tp"] != "auto":
                raise ValueError(f"tensor_parallel={degree}: {problem}")
            else:
                rank_zero_info(f"merak3d planner: leaves out tensor_parallel={degree}: {problem}")
        return tuple(kept)

    def _default_memory_limit(self) -> float:
        if self.root_device.type == "cuda":
            return 0.9 * torch.cuda.mem_get_info(self.root_device)[1]
        with open("/proc/meminfo") as meminfo:
            available_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
        return 0.9 * available_kib * 1024 / max(1, self.num_processes)

    # Building the layout on the first batch ----------------------------------------------

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if not self._built:
            # Evaluation loops bring their batch under no_grad or inference mode; the split check
            # needs a backward, and the parameters the build creates must not be inference tensors.
            with torch.inference_mode(False), torch.enable_grad(), _random_state_kept():
                self._build(batch)
        return batch

    def _micro_batch(self, inputs: torch.Tensor) -> torch.Tensor:
        """The first micro-batch of ``inputs``, once the batch is known to split into micro- and sub-batches."""
        self._check_batch_split(inputs.shape[0], self.pipeline_parallel)
        return inputs[: inputs.shape[0] // self.micro_batches]

    def _build(self, batch: Any) -> None:
        """Cut, split and wrap the model for this rank on the shapes of ``batch``;
        grad enabled, not in inference mode.
        """
        module = self.lightning_module
        model: nn.Module = module.model
        existing = set(module.modules())
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False
        inputs, _ = module.split_batch(batch)
        # a copy: an evaluation loop's batch may be an inference tensor, which autograd refuses
        micro = self._micro_batch(inputs).clone()
        pp, tp = self.pipeline_parallel, self.tensor_parallel
        self._expert_prefixes = _expert_layers(model)
        sequence_parallel = self.sequence_parallel and tp > 1
        if self.sequence_parallel and tp == 1:
            rank_zero_info("merak3d: tensor_parallel=1, so sequence_parallel has nothing to split")
        if sequence_parallel:
            check_sequence_length(micro.shape[1], tp)
        with _in_training_mode(model):
            # Every rank profiles: blocks may hold collectives (MoE all-to-alls) that need all their peers.
            trace = trace_model(model, micro, _call_model, profile=pp > 1)
            trunk: nn.ModuleList = model.get_submodule(trace.trunk_path)
            plan = self._tensor_parallel_plan(trunk[0], trace) if tp > 1 else None
            if plan is not None and tp not in self._verified_tp_degrees:
                problem = self._split_block_problem(trunk[0], trace, plan, self.device_mesh["tp"])
                if problem is not None:
                    raise ValueError(f"tensor_parallel={tp}: {problem}")
            sequence_plan = self._sequence_parallel_plan(trunk[0], trace, plan) if sequence_parallel else None
        if pp > 1:
            num_stages = pp * self.virtual_stages
            tied = tied_parameter_names(model)
            self.partition = self._agree_on_partition(trace, num_stages)
            stage_ids = [self.pipeline_rank + k * pp for k in range(self.virtual_stages)]
            copies = [copy.deepcopy(model) for _ in stage_ids[1:]] + [model]
            stage = RankStages([
                build_stage_module(copy_, trace, self.partition.boundaries, stage_id, _call_model)
                for copy_, stage_id in zip(copies, stage_ids)
            ])
            local_blocks = {
                index: part.net.get_submodule(trace.trunk_path)[index] for part in stage for index in part.block_indices
            }
            self._setup_tied_gradients(stage, tied)
        else:
            stage = None
            local_blocks = dict(enumerate(trunk))
        if plan is not None and local_blocks:
            self._shard_blocks(local_blocks, trace, plan, sequence_plan)
        if sequence_plan is not None:
            self._split_sequence(local_blocks, [part.block_indices for part in stage] if stage is not None
                                 else [list(local_blocks)], trace)
        self._wrap_recompute(list(local_blocks.values()))
        self._local_blocks = local_blocks
        if self.tp_overlap > 1:
            for part in stage if stage is not None else [model]:
                part.forward = SubBatchForward(part, self.tp_overlap)
        if stage is not None:
            module.model = stage
            self._start_pipeline(stage)
        for part in module.modules():
            if part not in existing:  # stage wrappers and pruned containers join the loop's mode
                part.training = module.training
        self._built = True
        self._built_in_evaluation = not module.training
        trainer = module.trainer
        if trainer.state.fn == TrainerFn.FITTING:
            # the schedulers Lightning restored from a checkpoint are replaced with the optimizers
            scheduler_states = [config.scheduler.state_dict() for config in self.lr_scheduler_configs]
            self.setup_optimizers(trainer)
            for config, state in zip(self.lr_scheduler_configs, scheduler_states, strict=True):
                config.scheduler.load_state_dict(state)
            self.setup_precision_plugin()
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
            for optimizer, state in zip(self.optimizers, self._pending_optimizer_states):
                self._load_consolidated_optimizer_state(optimizer, state)
            self._pending_optimizer_states = []

    def on_validation_end(self) -> None:
        """A layout built in a fit's sanity check trains afterwards.

        Lightning restores the modes of the modules it saw before the loop, by name; the build
        renamed and wrapped them, so they would start training in eval mode.
        """
        if self._built_in_evaluation and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self.lightning_module.model.train()
        self._built_in_evaluation = False

    def on_train_start(self) -> None:
        """Modules built in an evaluation loop (the sanity check, validate, predict) are still in eval mode."""
        if self._built:
            self.lightning_module.model.train()
        if self.layout_choice is not None and self.step_time_check is None:
            self._batch_clock = BatchClock(STEP_CHECK_WARMUP, STEP_CHECK_BATCHES)

    def on_validation_start(self) -> None:
        if self._batch_clock is not None:
            self._batch_clock.pause()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        clock = self._batch_clock
        if clock is None:
            return
        clock.batch_started(time.perf_counter())
        if clock.ready:
            self._batch_clock = None
            self._check_step_time(clock)

    def _check_step_time(self, clock: BatchClock) -> None:
        """Log the slowest rank's median step next to the plan's prediction; warn when they disagree."""
        slowest = torch.tensor(clock.median_s(), dtype=torch.float64, device=self.root_device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        assert self.layout_choice is not None
        check = StepTimeCheck(self.layout_choice.step_time_s, float(slowest), len(clock.durations_s))
        self.step_time_check = check
        rank_zero_info(check.describe())
        if check.suspect:
            rank_zero_warn(
                f"the planner's predicted step is {100 * check.error:+.0f}% off the measured one, so layouts it "
                "ranked close to this one may be faster; fix the degrees, or plan again on a quieter machine"
            )
        trainer = self.lightning_module.trainer
        for logger in trainer.loggers:
            logger.log_metrics({"planner/predicted_step_s": check.predicted_s,
                                "planner/measured_step_s": check.measured_s}, step=trainer.global_step)

    @property
    def pipeline_rank(self) -> int:
        return self.device_mesh["pp"].get_local_rank()

    def _agree_on_partition(self, trace: ModelTrace, num_stages: int) -> Any:
        """Rank 0 partitions its measured costs; every rank uses that partition."""
        from lightning_merak.strategies import pipeline

        partition = None
        if self.global_rank == 0:
            partitioners = {
                "autopipe": lambda: pipeline.partition_autopipe(trace.costs, num_stages, self.micro_batches),
                "min_max": lambda: pipeline.partition_min_max(trace.costs, num_stages),
                "parameters": lambda: pipeline.partition_by_parameters(trace.costs, num_stages),
                "uniform": lambda: pipeline.partition_uniform(trace.costs, num_stages),
            }
            partition = partitioners[self.partition_method]()
        partition = self.broadcast(partition, src=0)
        rank_zero_info(
            f"merak3d: {self.partition_method} partition, stage boundaries {partition.boundaries} over "
            f"{[cost.name for cost in trace.costs]}"
        )
        return partition

    @staticmethod
    def _tensor_parallel_plan(block: nn.Module, trace: ModelTrace) -> TensorParallelPlan:
        """Pair the linear layers of one block (all blocks of the trunk share a class)."""
        args, kwargs = trace.block_arguments(trace.sample_side_tensors)
        hidden = trace.sample_hidden
        plan = find_tensor_parallel_plan(block, lambda: block(hidden, *args, **kwargs), hidden.shape[-1])
        if not plan.column or not plan.row:
            raise ValueError(
                f"found no column/row linear pairs in {type(block).__name__}; tensor_parallel needs "
                "blocks built from nn.Linear (or transformers Conv1D) layers"
            )
        return plan

    @staticmethod
    def _sequence_parallel_plan(block: nn.Module, trace: ModelTrace, plan: TensorParallelPlan) -> SequenceParallelPlan:
        """Where each block gathers the sequence, found on the unsplit ``block``."""
        args, kwargs = trace.block_arguments(trace.sample_side_tensors)
        return find_sequence_parallel_plan(block, lambda: block(trace.sample_hidden, *args, **kwargs),
                                           plan.column_groups, plan.row)

    def _shard_blocks(self, blocks: dict[int, nn.Module], trace: ModelTrace, plan: TensorParallelPlan,
                      sequence_plan: Optional[SequenceParallelPlan]) -> None:
        """Split every local block (by trunk index) over the tensor-parallel group."""
        mesh = self.device_mesh["tp"]
        for index, block in blocks.items():
            changes = apply_tensor_parallel(block, plan, mesh, sequence_plan, self.tp_weight_grad_overlap)
            self._layout_changes.update({f"{trace.trunk_path}.{index}.{name}": c for name, c in changes.items()})
        # sequence-split blocks see only their tokens everywhere; plain TP blocks only their heads inside a region
        if sequence_plan is not None:
            self._tensor_partial = sequence_partial_parameters(list(blocks.values()))
        else:
            self._tensor_partial = [
                param for block in blocks.values() for param in region_partial_parameters(block, plan)
            ]

    def _split_block_problem(self, block: nn.Module, trace: ModelTrace, plan: TensorParallelPlan,
                             mesh: DeviceMesh) -> Optional[str]:
        """Why ``block`` split by ``plan`` over ``mesh`` would not compute the whole block,
        or None (rank 0's verdict).
        """
        args, kwargs = trace.block_arguments(trace.sample_side_tensors)
        try:
            verify_tensor_parallel_plan(block, plan, mesh, lambda module, hidden: trace.hidden_of(
                module(hidden, *args, **kwargs)), trace.sample_hidden)
            problem = None
        except ValueError as error:
            problem = str(error)
        return self.broadcast(problem, src=0)

    def _split_sequence(self, blocks: dict[int, nn.Module], segments: list[list[int]], trace: ModelTrace) -> None:
        """Each run of consecutive local blocks (one per stage) works on sequence slices."""
        group = self.device_mesh["tp"].get_group()
        for indices in segments:
            if indices:
                split_sequence_between(blocks[indices[0]], blocks[indices[-1]], group, trace.block_output_index)

    def _wrap_recompute(self, blocks: list[nn.Module]) -> None:
        if self.recompute == "none" or not blocks:
            return
        if self.recompute == "full":
            ratio = 1.0
        else:
            from lightning_merak.strategies.pipeline import stage_aware_recompute_ratios

            ratio = stage_aware_recompute_ratios(self.recompute_ratio, self.pipeline_parallel)[self.pipeline_rank]
        count = math.floor(len(blocks) * ratio + 1e-9)
        for block in blocks[:count]:
            block.forward = functools.partial(_checkpointed, block.forward)

    def _setup_tied_gradients(self, stage: RankStages, tied: list[tuple[str, ...]]) -> None:
        """Groups joining the first and last stage of each replica for every tied parameter."""
        if not tied:
            return
        mesh = self.device_mesh.mesh
        pp, dp, tp = mesh.shape
        my_group = None
        for d in range(dp):
            for t in range(tp):
                ranks = sorted({int(mesh[0, d, t]), int(mesh[pp - 1, d, t])})
                group = dist.new_group(ranks)
                if self.global_rank in ranks:
                    my_group = group
        params = {stage.original_name(name): param for name, param in stage.named_parameters()}
        for names in tied:
            for name in names:
                param = params.get(name)
                if param is not None:
                    self._tied_groups.append((my_group, param, stage.is_first))
                    break

    def _start_pipeline(self, stages: RankStages) -> None:
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
        )

        pp_group = self.device_mesh["pp"].get_group()
        stage_class = pipeline_stage_class(dist.get_backend(pp_group), self.virtual_stages)
        pipeline_stages = [
            stage_class(part, part.stage_index, part.num_stages, self.root_device, group=pp_group)
            for part in stages
        ]
        module = self.lightning_module
        if self.schedule in MULTI_STAGE_SCHEDULES:
            schedule_class = {"interleaved_1f1b": ScheduleInterleaved1F1B,
                              "interleaved_zero_bubble": ScheduleInterleavedZeroBubble}[self.schedule]
            self._schedule = schedule_class(pipeline_stages, self.micro_batches,
                                            loss_fn=module.loss_from_logits, scale_grads=True)
        else:
            schedule_class = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
                              "shifted_critical_path": ScheduleShiftedCriticalPath}[self.schedule]
            self._schedule = schedule_class(pipeline_stages[0], self.micro_batches,
                                            loss_fn=module.loss_from_logits, scale_grads=True)
        module.compute_loss = self._pipeline_loss
        module.forward = self._pipeline_forward

    # Steps ------------------------------------------------------------------------------

    def _pipeline_loss(self, batch: Any) -> torch.Tensor:
        """Run the schedule on ``batch``; every rank returns the mean micro-batch loss.

        The schedule computes gradients inside the training step, but Lightning zeroes
        gradients between ``training_step`` and ``backward``; they are held aside here and
        put back in :meth:`backward`.
        """
        module = self.lightning_module
        inputs, targets = module.split_batch(batch)
        self._micro_batch(inputs)
        stage: RankStages = module.model
        args = (inputs,) if stage.is_first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if stage.is_last else {}
        if module.training:
            parameters = [p for p in stage.parameters() if p.requires_grad]
            for param in parameters:
                param.grad = None
            self._schedule.step(*args, return_outputs=False, **kwargs)
            self._pending_gradients = [(param, param.grad) for param in parameters]
            for param in parameters:
                param.grad = None
        else:
            with torch.no_grad():
                self._schedule.eval(*args, return_outputs=False, **kwargs)
        loss = (torch.stack([l.detach() for l in losses]).mean() if stage.is_last
                else torch.zeros((), device=self.root_device))
        pp_group, last_rank = self._last_stage_source()
        dist.broadcast(loss, src=last_rank, group=pp_group)
        return loss

    def _last_stage_source(self) -> tuple[dist.ProcessGroup, int]:
        """This replica's pipeline group and the global rank of its last stage, which broadcasts results."""
        pp_group = self.device_mesh["pp"].get_group()
        return pp_group, dist.get_global_rank(pp_group, self.pipeline_parallel - 1)

    def _pipeline_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits of a whole batch through every stage (no gradients); the same on every rank.

        This is what ``module(inputs)`` runs once the model is pipelined, so ``predict_step``
        and inference code keep working; training goes through ``compute_loss``.
        """
        if torch.is_grad_enabled() and self.lightning_module.training:
            raise RuntimeError(
                "with pipeline_parallel>1 the module's forward runs only without gradients (predict, "
                "inference); training_step must call self.compute_loss(batch)"
            )
        stage: RankStages = self.lightning_module.model
        self._micro_batch(inputs)
        args = (inputs,) if stage.is_first else ()
        # The schedule scores every micro-batch on the last stage; the inputs stand in for the
        # targets and those losses are discarded.
        scoring = {"target": inputs, "losses": []} if stage.is_last else {}
        with torch.no_grad():
            output = self._schedule.eval(*args, **scoring)
        pp_group, last_rank = self._last_stage_source()
        header = [(tuple(output.shape), output.dtype) if stage.is_last else None]
        dist.broadcast_object_list(header, src=last_rank, group=pp_group)
        shape, dtype = header[0]
        logits = output if stage.is_last else torch.empty(shape, dtype=dtype, device=self.root_device)
        dist.broadcast(logits, src=last_rank, group=pp_group)
        return logits

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self.lightning_module.training_step(*args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Pipelined runs did their backward inside the schedule; hooks still fire, then grads sync."""
        if self._schedule is None:
            closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        else:
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
            for param, grad in self._pending_gradients:
                param.grad = grad
            self._pending_gradients = []
            closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
            self.post_backward(closure_loss)
        self._synchronize_gradients()
        return closure_loss

    def _replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every data-parallel replica holds a copy of.

        Parameters a plugin reduces itself are left out, by the conventions DDP and
        DeepSpeed use: names in ``_ddp_params_and_buffers_to_ignore`` on the module, or
        ``param.allreduce = False`` (expert-parallel weights).
        """
        module = self.lightning_module
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        return [
            param for name, param in module.named_parameters()
            if name not in ignored and getattr(param, "allreduce", True) is not False
        ]

    def _synchronize_gradients(self) -> None:
        partial = [_local(p.grad) for p in self._tensor_partial if p.grad is not None]
        if partial:
            average_gradients(partial, self.device_mesh["tp"].get_group(), replicas=1)
        for group, param, _ in self._tied_groups:
            if param.grad is not None:
                dist.all_reduce(_local(param.grad), group=group)
        if self.data_parallel == 1:
            return
        grads = [_local(p.grad) for p in self._replicated_parameters() if p.grad is not None]
        if grads:
            average_gradients(grads, self.data_parallel_group, self.data_parallel)

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
        """Clip by the norm over every stage and shard, counting replicated tensors once.

        Expert-parallel weights (``allreduce=False``, DeepSpeed's convention) differ between
        the ranks of their expert-parallel group, so their squares are summed over that group
        first; every other tensor is the same on all data-parallel replicas.
        """
        duplicated = {id(param) for _, param, is_first in self._tied_groups if not is_first}
        tp_rank = self.device_mesh["tp"].get_local_rank()
        grads, counted = [], []
        expert_grads: dict[str, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = _local(param.grad)
                grads.append(grad)
                replicated = not isinstance(param.grad, DTensor) or all(
                    isinstance(p, Replicate) for p in param.grad.placements
                )
                if id(param) in duplicated or (replicated and tp_rank != 0):
                    continue
                if getattr(param, "allreduce", True) is False:
                    expert_grads.setdefault(getattr(param, "group_name", None), []).append(grad)
                else:
                    counted.append(grad)
        squares = squared_norm(counted, self.root_device)
        for name in sorted(expert_grads, key=str):
            expert_squares = squared_norm(expert_grads[name], self.root_device)
            dist.all_reduce(expert_squares, group=_expert_parallel_group(name))
            squares += expert_squares
        for dim in ("pp", "tp"):
            if self.device_mesh[dim].size() > 1:
                dist.all_reduce(squares, group=self.device_mesh[dim].get_group())
        self.last_gradient_norm = math.sqrt(squares.item())
        coefficient = float(clip_val) / (self.last_gradient_norm + 1e-6)
        if coefficient < 1.0:
            scale_gradients(grads, coefficient)

    # Checkpoints ------------------------------------------------------------------------
    # Once the layout is built, a checkpoint is a directory written with torch distributed
    # checkpoint (each rank writes its own shards, replicas once) plus ``lightning.ckpt``
    # with the rest of Lightning's checkpoint. Tensors are keyed by the unsplit model's
    # names, and any layout can load them: on resume the whole model is still unsplit, so
    # the shards are read into full tensors and the new layout is cut from those.

    def to_original_layout(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """``full`` (a gathered parameter-shaped tensor) in the unsplit model's layout."""
        change = self._layout_changes.get(name)
        return change.to_original(full) if change else full

    def _original_names(self) -> dict[int, str]:
        model = self.lightning_module.model
        rename = model.original_name if isinstance(model, RankStages) else (lambda name: name)
        return {id(param): self._renumbered_expert(rename(name), to_global=True)
                for name, param in model.named_parameters()}

    def _checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Shards stay DTensors; a shard whose layout sharding changed is saved whole, as the original."""
        if isinstance(tensor, DTensor) and name in self._layout_changes:
            return self.to_original_layout(name, tensor.full_tensor()).detach()
        return tensor.detach()

    def _expert_rank(self, ep_size: int) -> int:
        """This rank's place in its expert-parallel group, carved from its data-parallel ranks as the MoE layers do."""
        from lightning_merak.plugins.moe.groups import carve_expert_groups, data_parallel_groups_from_mesh

        degrees = self._degrees
        if self._built:
            pp, dp, tp = self.pipeline_parallel, self.data_parallel, self.tensor_parallel
        elif all(isinstance(degrees[name], int) for name in ("pp", "dp", "tp")):
            pp, dp, tp = degrees["pp"], degrees["dp"], degrees["tp"]
        else:
            raise ValueError(
                f"resuming expert-parallel MoE layers needs fixed degrees to know which experts each rank holds, "
                f"got {degrees}; pass the data_parallel, pipeline_parallel and tensor_parallel the plan chose"
            )
        mesh = torch.arange(pp * dp * tp).reshape(pp, dp, tp).tolist()  # the layout of merak3d's device mesh
        rank = self.global_rank
        data_parallel_ranks = next(group for group in data_parallel_groups_from_mesh(mesh, ("pp", "dp", "tp"))
                                   if rank in group)
        ep_groups, _ = carve_expert_groups(data_parallel_ranks, ep_size)
        return next(group.index(rank) for group in ep_groups if rank in group)

    def _renumbered_expert(self, name: str, to_global: bool) -> str:
        """``name`` of the unsplit model with an expert's local number made global, or (``to_global=False``)
        a global number of this rank's expert made local again; other names unchanged."""
        for prefix, (ep_size, per_rank) in self._expert_prefixes.items():
            found = split_expert_key(name, prefix)
            if found is not None:
                number, rest = found
                first = self._expert_rank(ep_size) * per_rank
                return f"{prefix}{number + first if to_global else number - first}.{rest}"
        return name

    def _renumbered_state(self, state: dict[str, Any], to_global: bool) -> dict[str, Any]:
        """A module state (keys ``model.<name>``) with expert numbers renumbered as :meth:`_renumbered_expert` does."""
        prefix = "model."
        return {prefix + self._renumbered_expert(key[len(prefix):], to_global) if key.startswith(prefix) else key: value
                for key, value in state.items()}

    def _gather_objects(self, local: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        return gathered

    def lightning_module_state_dict(self) -> dict[str, Any]:
        module = self.lightning_module
        if not self._built:
            return module.state_dict()
        model = module.model
        state = {}
        for key, value in module.state_dict().items():
            rest = key[len("model."):]
            name = model.original_name(rest) if isinstance(model, RankStages) else rest
            state["model." + self._renumbered_expert(name, to_global=True)] = self._checkpoint_tensor(name, value)
        return state

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if not self._built:
            return optimizer.state_dict()
        names = self._original_names()
        state = {
            names[id(param)]: {key: self._checkpoint_tensor(names[id(param)], value)
                               if isinstance(value, torch.Tensor) else value
                               for key, value in optimizer.state[param].items()}
            for group in optimizer.param_groups for param in group["params"] if param in optimizer.state
        }
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [names[id(param)] for param in group["params"]]} for group in optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if not self._built:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        import torch.distributed.checkpoint as dcp

        path = Path(filepath)
        optimizer_states = checkpoint.pop("optimizer_states", [])
        tensors = {"model": checkpoint.pop("state_dict"), "optim": {}}
        layouts = []
        for index, saved in enumerate(optimizer_states):
            entries = {}
            for name, values in saved["state"].items():
                for key, value in values.items():
                    tensors["optim"][f"{index}/{name}/{key}"] = value
                    entries[f"{index}/{name}/{key}"] = (tuple(value.shape), value.dtype) if isinstance(
                        value, torch.Tensor) else value
            stage_groups = self._gather_objects((self.pipeline_rank, saved["param_groups"], entries))
            by_stage = {stage: groups for stage, groups, _ in stage_groups}
            per_stage = [by_stage[stage] for stage in sorted(by_stage)]
            layouts.append({
                "param_groups": [
                    {**per_stage[0][g], "params": list(dict.fromkeys(
                        name for groups in per_stage for name in groups[g]["params"]))}
                    for g in range(len(per_stage[0]))
                ],
                "entries": {key: value for _, _, part in stage_groups for key, value in part.items()},
            })
        dcp.save(tensors, checkpoint_id=path)
        if self.global_rank == 0:
            torch.save({**checkpoint, "merak3d_optimizers": layouts}, path / LIGHTNING_CHECKPOINT)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if not (path.is_dir() and (path / LIGHTNING_CHECKPOINT).is_file()):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        import torch.distributed.checkpoint as dcp

        if self._built:
            raise RuntimeError(
                f"{path} is a sharded merak3d checkpoint; load it before the first batch "
                "(Trainer.fit/validate/predict with ckpt_path=...)"
            )
        checkpoint = torch.load(path / LIGHTNING_CHECKPOINT, map_location="cpu", weights_only=False)
        self._expert_prefixes = _expert_layers(self.lightning_module.model)
        model_state = self._renumbered_state(
            {key: value.detach().clone() for key, value in self.lightning_module.state_dict().items()}, to_global=True)
        optim_state: dict[str, Any] = {}
        for layout in checkpoint["merak3d_optimizers"]:
            for key, entry in layout["entries"].items():
                if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], torch.dtype):
                    optim_state[key] = torch.empty(entry[0], dtype=entry[1])
                else:
                    optim_state[key] = entry
        tensors = {"model": model_state, "optim": optim_state}
        dcp.load(tensors, checkpoint_id=path)
        checkpoint["state_dict"] = self._renumbered_state(tensors["model"], to_global=False)
        checkpoint["optimizer_states"] = []
        for index, layout in enumerate(checkpoint.pop("merak3d_optimizers")):
            state: dict[str, dict[str, Any]] = {}
            for key in layout["entries"]:
                _, name, field_name = key.split("/", 2)
                if key.startswith(f"{index}/"):
                    state.setdefault(name, {})[field_name] = tensors["optim"][key]
            checkpoint["optimizer_states"].append(
                {"merak3d_consolidated": True, "state": state, "param_groups": layout["param_groups"]}
            )
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if self._built:
            for optimizer, state in zip(self.optimizers, states):
                self._load_consolidated_optimizer_state(optimizer, state)
        else:
            self._pending_optimizer_states = list(states)

    def _load_consolidated_optimizer_state(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        if not saved.get("merak3d_consolidated"):
            optimizer.load_state_dict(saved)
            return
        names = self._original_names()
        state: dict[int, Any] = {}
        groups = []
        index = 0
        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
            ids = []
            for param in group["params"]:
                entry = saved["state"].get(names[id(param)])
                if entry is not None:
                    state[index] = {
                        key: self._local_like(param, names[id(param)], value) for key, value in entry.items()
                    }
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def _local_like(self, param: nn.Parameter, name: str, value: Any) -> Any:
        """A saved full optimizer-state entry placed like ``param`` (sharded, in its layout)."""
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            return value
        change = self._layout_changes.get(name)
        full = change.from_original(value) if change else value
        if full.shape != param.shape:
            return value
        if isinstance(param, DTensor):
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(full.to(param.device), param.device_mesh, param.placements)
        return full.to(param.device)
