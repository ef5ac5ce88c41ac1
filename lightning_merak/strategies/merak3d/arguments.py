"""The arguments of ``Merak3DStrategy`` as the user gave them, checked in one place.

:class:`Merak3DArguments` refuses a bad argument when it is made (the strategy's constructor);
:meth:`~Merak3DArguments.validate` and :meth:`~Merak3DArguments.validate_model` refuse, before any
process starts, what the world size, the batches or the model rule out. Degrees may still be
``"auto"`` here; :meth:`~Merak3DArguments.layout` resolves fixed ones into a
:class:`~lightning_merak.parallel.layout.Layout`, the planner the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_merak.modules.causal_lm import scores_next_token
from lightning_merak.parallel.context.model import CONTEXT_ATTENTION_METHODS, check_context_parallel_model
from lightning_merak.parallel.context.sharding import check_sequence_divisible
from lightning_merak.parallel.context.variable import DEGREE_MODES
from lightning_merak.parallel.fast_blocks import FastBlocks
from lightning_merak.parallel.float8 import float8_layout_problem
from lightning_merak.parallel.layout import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    Layout,
    check_batch_split,
    check_micro_batches,
    check_overlap,
    default_micro_batches,
)
from lightning_merak.parallel.micro_batching.options import MicroBatching, check_packing_attention
from lightning_merak.parallel.pipeline.recording import declared_block_argument_problem
from lightning_merak.parallel.pipeline.schedules import shifted_schedule_available
from lightning_merak.parallel.pipeline.trace import find_trunk
from lightning_merak.parallel.pipeline.vocab_stages import check_vocab_stage_rows, vocab_stages_config_problem
from lightning_merak.parallel.tensor.adapters import check_adapter_split
from lightning_merak.parallel.tensor.blocks import check_tensor_parallel_degree
from lightning_merak.parallel.tensor.families import check_sequence_parallel_family
from lightning_merak.parallel.tensor.sequence import check_sequence_length
from lightning_merak.parallel.tensor.vocab import check_vocabulary_split
from lightning_merak.protocols.experts import ExpertParallelLayer
from lightning_merak.strategies.merak3d.backends import backend_problem
from lightning_merak.strategies.merak3d.context_degree import known_context_parallel, naming_auto_degree
from lightning_merak.strategies.merak3d.context_step import check_context_rounds_model
from lightning_merak.strategies.merak3d.network import module_view
from lightning_merak.strategies.merak3d.options import Degree, Merak3DOptions
from lightning_merak.strategies.merak3d.trainer_checks import accumulation_refusal
from lightning_merak.util.values import is_count, is_finite_number

__all__ = ["PARTITION_METHODS", "RECOMPUTE_MODES", "SHARDING_MODES", "Degree", "Merak3DArguments", "check_accumulation",
           "check_last_batch", "check_memory_limit", "check_scored_length", "checked_arguments",
           "least_parameter_bytes", "least_state_bytes", "moe_layers"]

RECOMPUTE_MODES = ("none", "full", "stage_aware", "auto")
PARTITION_METHODS = ("autopipe", "min_max", "parameters", "uniform")
SHARDING_MODES = ("none", "optimizer", "gradients", "full", "auto")
LONGEST_TIMEOUT_S = timedelta.max.days * 86400.0
"""The longest collective timeout a ``timedelta`` (which torch takes) can hold."""


def is_positive_finite(value: Any) -> bool:
    """Whether ``value`` is a finite number above 0."""
    return is_finite_number(value) and value > 0


def check_stage_count(num_stages: int, num_blocks: int, partition: str = "autopipe") -> None:
    """Refuse more stages than the model has nodes to cut (``partition='uniform'``: blocks, one per stage)."""
    nodes = num_blocks + 2
    if num_stages > nodes:
        raise ValueError(
            f"{num_stages} pipeline stages (pipeline_parallel × virtual_stages) exceed the {nodes} nodes of "
            f"the model (embedding, {num_blocks} blocks, head); use at most {nodes} stages"
        )
    if partition == "uniform" and num_stages > num_blocks:
        raise ValueError(
            f"partition='uniform' puts a transformer block on every stage, but {num_stages} pipeline stages "
            f"(pipeline_parallel × virtual_stages) exceed the model's {num_blocks} blocks; use at most {num_blocks} "
            "stages, or partition='autopipe'"
        )


def check_accumulation(accumulate_grad_batches: int, fitting: bool = True, pipeline_parallel: Optional[int] = None,
                       tp_overlap: Optional[int] = None) -> None:
    """Refuse gradient accumulation in a fit (evaluation has none), advising what fits the layout where known."""
    refusal = accumulation_refusal(accumulate_grad_batches, pipeline_parallel, tp_overlap) if fitting else None
    if refusal is not None:
        raise ValueError(refusal)


def check_scored_length(module: Any, sequence_length: Optional[int]) -> None:
    """Refuse sequences too short for ``module``'s next-token loss (before launch, or on the first batch when the
    data was not known then: a split traced on such a batch would be wrong)."""
    if sequence_length is not None and sequence_length < 2 and scores_next_token(module):
        raise ValueError(f"sequence length {sequence_length} leaves {type(module).__name__}'s next-token loss no "
                         "token to score (its loss would be NaN); use sequences of at least 2 tokens "
                         "(data.seq_len >= 2)")


def check_last_batch(loader: Any, layout: Layout, batches_run: Optional[float] = None,
                     max_steps: Optional[int] = None) -> None:
    """Refuse, before the first step, a training loader whose last batch of an epoch (a dataset that does not fill it,
    without ``drop_last``) the layout cannot split into its micro-batches and sub-batches: it would stop the run
    there. Not where the run ends each pass sooner: ``batches_run`` (the trainer's batches per epoch, after
    ``limit_*_batches``, ``overfit_batches`` or ``fast_dev_run``) or ``max_steps`` (≥ 0) short of the last batch."""
    sampler = getattr(loader, "batch_sampler", None)
    size = getattr(sampler, "batch_size", None)
    if not isinstance(loader, torch.utils.data.DataLoader) or not is_count(size) or sampler.drop_last:
        return
    try:
        samples = len(sampler.sampler)
    except TypeError:  # an iterable dataset: no length to tell the last batch by
        return
    last, full = samples % size, samples // size  # the partial batch is the pass's batch number ``full``
    reached = (batches_run is None or batches_run > full) and (max_steps is None or not 0 <= max_steps <= full)
    if not last or not reached:
        return
    ends = f"the training dataloader ends each epoch with a batch of {last} samples ({samples} in batches of {size})"
    if layout.pipeline_parallel > 1:
        raise ValueError(f"{ends}, which merak3d's pipeline stages cannot take: they take every batch in the shape "
                         "of the first (torch's stages receive micro-batches into buffers of that shape); pass "
                         "drop_last=True to the DataLoader")
    try:
        layout.check_batch(last)
    except ValueError as error:
        raise ValueError(f"{ends}, which merak3d cannot split: {error}; or pass drop_last=True to the DataLoader"
                         ) from None


def divides_model(config: Any, tensor_parallel: int) -> bool:
    try:
        check_tensor_parallel_degree(config, tensor_parallel)
    except ValueError:
        return False
    return True


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every MoE layer in ``model`` (the MoE plugin's, recognised by its protocol)."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, ExpertParallelLayer)]


def check_fully_shardable(model: nn.Module, tensor_parallel: Optional[int]) -> None:
    """Refuse a model FSDP2 cannot shard over the data-parallel ranks (``data_parallel_sharding="full"``)."""
    if moe_layers(model):
        raise ValueError(
            "data_parallel_sharding='full' cannot shard MoE layers: their experts are spread over the data-parallel "
            "ranks (expert parallelism), not copies FSDP2 may split; use data_parallel_sharding='none'")
    config = getattr(model, "config", None)
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    if tensor_parallel is not None and isinstance(heads, int) and tensor_parallel > heads:
        raise ValueError(
            f"data_parallel_sharding='full' cannot shard key/value heads that several tensor-parallel ranks share "
            f"(tensor_parallel={tensor_parallel} > {heads} key/value heads): their rows count once per copy in the "
            f"gradient norm, which a second split hides; choose tensor_parallel <= {heads} or "
            "data_parallel_sharding='optimizer'/'gradients'")


@dataclass(frozen=True)
class Merak3DArguments(Merak3DOptions):
    """``Merak3DStrategy``'s arguments (declared and described in
    :class:`~lightning_merak.strategies.merak3d.options.Merak3DOptions`), refused when made if any is out of range."""

    def __post_init__(self) -> None:
        for name, value in (("data_parallel", self.data_parallel), ("pipeline_parallel", self.pipeline_parallel),
                            ("tensor_parallel", self.tensor_parallel)):
            if value != "auto" and (not is_count(value) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer or 'auto'")
        tp_overlap, schedule = self.tp_overlap, self.schedule
        if tp_overlap != "auto" and (not is_count(tp_overlap) or tp_overlap < 1):
            raise ValueError(f"tp_overlap={tp_overlap!r} must be a positive integer (1 = no overlap) or 'auto'")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError(
                "sequence_parallel=True splits the sequence over the tensor-parallel ranks, but tensor_parallel=1; "
                "set tensor_parallel>1 (or 'auto') or sequence_parallel=False"
            )
        if tp_overlap != 1 and schedule == "interleaved_zero_bubble":
            raise ValueError(
                "tp_overlap>1 runs each stage's backward as a whole, which interleaved_zero_bubble splits into "
                "input and weight gradients; use schedule='interleaved_1f1b' or tp_overlap=1"
            )
        if self.tp_weight_grad_overlap and schedule == "interleaved_zero_bubble":
            raise ValueError(
                "tp_weight_grad_overlap=True computes weight gradients in the input-gradient pass, which "
                "interleaved_zero_bubble keeps apart; leave tp_weight_grad_overlap unset or use another schedule"
            )
        if self.float8 is not None:  # a planned degree is checked again once chosen (the build)
            problem = float8_layout_problem(self.float8, 1 if self.tensor_parallel == "auto" else self.tensor_parallel)
            if problem is not None:
                raise ValueError(problem)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not supported; choose one of {', '.join(SCHEDULES)}")
        self._check_vocab_stages()
        if schedule == "shifted_critical_path" and not shifted_schedule_available():
            raise ValueError(
                "schedule='shifted_critical_path' needs pipelining internals this torch does not have; "
                "use schedule='1f1b' or the tested torch 2.13"
            )
        if self.planner_calibration != "analytic":
            missing = [path for path in self.planner_calibration.split(",") if not Path(path.strip()).is_file()]
            if missing:
                raise ValueError(f"planner_calibration: no trace file at {', '.join(missing)}; give 'analytic' or the "
                                 "paths of traces MerakTraceProfiler wrote")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(
                f"recompute={self.recompute!r} is not supported; choose one of {', '.join(RECOMPUTE_MODES)}")
        if not is_finite_number(self.recompute_ratio) or not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio={self.recompute_ratio!r} must lie in [0, 1]")
        if self.partition not in PARTITION_METHODS:
            raise ValueError(
                f"partition={self.partition!r} is not supported; choose one of {', '.join(PARTITION_METHODS)}")
        self._check_virtual_stages()
        if self.data_parallel_sharding not in SHARDING_MODES:
            raise ValueError(f"data_parallel_sharding={self.data_parallel_sharding!r} is not supported; "
                             f"choose one of {', '.join(SHARDING_MODES)}")
        shard_size = self.data_parallel_shard_size
        if shard_size is not None:
            if not is_count(shard_size) or shard_size < 1:
                raise ValueError(f"data_parallel_shard_size={shard_size!r} must be a positive integer (None: all "
                                 "data-parallel ranks)")
            if self.data_parallel_sharding == "none":
                raise ValueError(f"data_parallel_shard_size={shard_size} shards over groups of ranks, but "
                                 "data_parallel_sharding='none'; choose a sharding mode or leave the size unset")
            if isinstance(self.data_parallel, int) and self.data_parallel % shard_size:
                raise ValueError(f"data_parallel_shard_size={shard_size} does not divide data_parallel="
                                 f"{self.data_parallel}; data_parallel = shard size × replicas")
        if self.overlap_param_gather is True and self.data_parallel_sharding != "optimizer":
            raise ValueError(
                f"overlap_param_gather=True gathers parameters into ZeRO-1's gradient buckets, but "
                f"data_parallel_sharding={self.data_parallel_sharding!r}; use 'optimizer' or overlap_param_gather=False"
            )
        if self.grad_bucket_mb is not None and not is_positive_finite(self.grad_bucket_mb):
            raise ValueError(f"grad_bucket_mb={self.grad_bucket_mb!r} must be a positive, finite number of MB (None: "
                             "25 MB, or less for a small model)")
        if self.data_parallel_sharding == "full":
            self._check_full_sharding()
        if self.micro_batches is not None and (not is_count(self.micro_batches) or self.micro_batches < 1):
            raise ValueError(f"micro_batches={self.micro_batches!r} must be a positive integer (None: 2 × pipeline "
                             "stages)")
        self._check_process_groups()
        self._check_context_parallel()
        self._check_context_parallel_degree()
        if self.micro_batches is not None and isinstance(self.pipeline_parallel, int):
            check_micro_batches(self.micro_batches, self.pipeline_parallel, schedule)

    def _check_virtual_stages(self) -> None:
        """Refuse a ``virtual_stages`` the schedule cannot run: the interleaved ones need 2 stages per rank or more,
        the others run one (and take any positive count, the default 2 included)."""
        stages, schedule = self.virtual_stages, self.schedule
        if schedule in MULTI_STAGE_SCHEDULES:
            if not is_count(stages) or stages < 2:
                raise ValueError(f"virtual_stages={stages!r} must be an integer of at least 2 with schedule="
                                 f"{schedule!r}, which runs several stages per rank; raise it or choose a "
                                 "one-stage schedule such as '1f1b'")
        elif not is_count(stages) or stages < 1:
            raise ValueError(f"virtual_stages={stages!r} must be a positive integer (schedule={schedule!r} runs one "
                             "stage per rank and does not use it)")

    def _check_process_groups(self) -> None:
        """Refuse a collective backend, timeout, memory limit or cost model that would fail (or be ignored)
        only once the processes run."""
        if self.process_group_backend is not None:
            problem = backend_problem(self.process_group_backend)
            if problem is not None:
                raise ValueError(problem)
        if not is_positive_finite(self.timeout_s) or self.timeout_s > LONGEST_TIMEOUT_S:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be a positive number of seconds, at most "
                             f"{LONGEST_TIMEOUT_S:.0f}")
        if self.memory_limit is not None and not is_positive_finite(self.memory_limit):
            raise ValueError(f"memory_limit={self.memory_limit!r} must be a positive, finite number of bytes per rank "
                             "(None: 90% of what the device offers)")
        cost = self.micro_batching_cost
        if cost is not None and not all(is_finite_number(value) for value in cost):
            raise ValueError(f"micro_batching_cost={cost!r} must be three finite numbers of seconds: [per token, per "
                             "token², per micro-batch]")

    def _check_context_parallel(self) -> None:
        """Refuse a context-parallel degree or method out of range, and a trace replay asked to rank its layouts."""
        cp = self.context_parallel
        if cp != "auto" and (not isinstance(cp, int) or isinstance(cp, bool) or cp < 1):
            raise ValueError(f"context_parallel={cp!r} must be a positive integer or 'auto'")
        if self.context_attention not in (*CONTEXT_ATTENTION_METHODS, "auto"):
            raise ValueError(f"context_attention={self.context_attention!r} is not supported; choose one of "
                             f"{', '.join(CONTEXT_ATTENTION_METHODS)} or 'auto'")
        if cp != 1 and self.needs_planning and self.planner_calibration != "analytic":
            raise ValueError("planner_calibration replays traces of runs without context parallelism, so it cannot "
                             f"rank context_parallel={cp!r} layouts; use planner_calibration='analytic', or fix "
                             "every degree")

    def _check_vocab_stages(self) -> None:
        """Refuse a ``vocab_stages`` value that is not one, before any work."""
        if self.vocab_stages not in ("off", "on", "auto"):
            raise ValueError(f"vocab_stages={self.vocab_stages!r} is not supported; choose 'off', 'on' or 'auto'")

    def _check_context_parallel_degree(self) -> None:
        """Refuse ``context_parallel_degree='per_micro_batch'`` where its rounds cannot run: they need a fixed group
        to split and one stage (each round's backward runs right after its forward, outside any schedule)."""
        if self.context_parallel_degree not in DEGREE_MODES:
            raise ValueError(f"context_parallel_degree={self.context_parallel_degree!r}; choose one of "
                             f"{', '.join(DEGREE_MODES)}")
        if self.context_parallel_degree == "fixed":
            return
        self._refuse_until("context_parallel_degree='per_micro_batch'",
                           {"pipeline_parallel": 1, "micro_batching": "none", "tp_overlap": 1},
                           "context_parallel_degree='fixed'")
        if self.data_parallel_sharding == "full":
            raise ValueError("context_parallel_degree='per_micro_batch' calls the model's forward once per round, "
                             "past FSDP2's hooks on the whole model; use data_parallel_sharding='optimizer' (or "
                             "'gradients', 'none') or context_parallel_degree='fixed'")
        if not isinstance(self.context_parallel, int) or self.context_parallel < 2:
            raise ValueError(f"context_parallel_degree='per_micro_batch' chooses degrees within a context-parallel "
                             f"group, but context_parallel={self.context_parallel!r}; set context_parallel to a fixed "
                             "degree of at least 2")

    def _refuse_until(self, option: str, needs: dict[str, Any], instead: str) -> None:
        """Refuse ``option`` while another option is not at the value it runs with yet, naming both ways out."""
        for name, needed in needs.items():
            value = getattr(self, name)
            if value != needed:
                raise ValueError(f"{option} runs with {name}={needed!r} for now, got {name}={value!r}; set "
                                 f"{name}={needed!r} or {instead}")

    def context_parallel_degrees(self, world_size: int) -> tuple[int, ...]:
        """The context-parallel degrees the planner searches on ``world_size`` ranks: the one given, or for 'auto'
        every divisor of the world size."""
        if self.context_parallel != "auto":
            return (int(self.context_parallel),)
        return tuple(degree for degree in range(1, world_size + 1) if world_size % degree == 0)

    @property
    def context_attention_methods(self) -> tuple[str, ...]:
        """The attention methods the planner searches: the one given, or every one for 'auto'."""
        return CONTEXT_ATTENTION_METHODS if self.context_attention == "auto" else (self.context_attention,)

    @property
    def unplanned_context_attention(self) -> str:
        """The method of a layout nothing is planned for: the one given, ring for 'auto' (any head count)."""
        return "ring" if self.context_attention == "auto" else self.context_attention

    def _check_full_sharding(self) -> None:
        """Refuse what FSDP2 (``data_parallel_sharding="full"``, :mod:`.fully_sharded`) cannot run."""
        other_modes = "or data_parallel_sharding='optimizer'/'gradients', which keep whole parameters"
        if self.schedule == "shifted_critical_path":
            raise ValueError(
                "data_parallel_sharding='full' cannot run schedule='shifted_critical_path': its cool-down forwards "
                "drop their activations and run again inside the backward, which FSDP2's forward and backward hooks "
                f"(gather, reduce-scatter) do not follow; choose schedule='1f1b' (or another), {other_modes}")
        if self.tp_overlap != 1:
            raise ValueError(
                f"data_parallel_sharding='full' cannot split micro-batches into tp_overlap={self.tp_overlap!r} "
                "sub-batches: they run in threads of their own, each through FSDP2's per-module gather and free; "
                f"set tp_overlap=1 (tp_weight_grad_overlap still hides tensor-parallel collectives), {other_modes}")

    # What the arguments decide ---------------------------------------------------------------

    @property
    def weight_grad_overlap(self) -> bool:
        """``tp_weight_grad_overlap`` with its default: on, except under ``interleaved_zero_bubble``."""
        if self.tp_weight_grad_overlap is None:
            return self.schedule != "interleaved_zero_bubble"
        return self.tp_weight_grad_overlap

    @property
    def fast_blocks(self) -> FastBlocks:
        """How each block trains (fp8 layers, compiled): the build applies it, the profilers time blocks so."""
        return FastBlocks(self.float8, self.compile)

    @property
    def stages_per_rank(self) -> int:
        """``virtual_stages`` where the schedule runs several stages per rank, 1 otherwise."""
        return self.virtual_stages if self.schedule in MULTI_STAGE_SCHEDULES else 1

    @property
    def degrees(self) -> dict[str, Degree]:
        """The three degrees as given, ``"auto"`` included, by mesh dimension name."""
        return {"dp": self.data_parallel, "pp": self.pipeline_parallel, "tp": self.tensor_parallel}

    def fixed_degrees(self, purpose: str) -> tuple[int, int, int]:
        """``(pp, dp, tp)`` as given, for ``purpose`` (words for the error), which cannot wait for a plan."""
        degrees = self.degrees
        if not all(isinstance(degrees[name], int) for name in ("pp", "dp", "tp")):
            raise ValueError(
                f"{purpose} needs fixed degrees to know which experts each rank holds, got {degrees}; "
                "pass the data_parallel, pipeline_parallel and tensor_parallel the plan chose"
            )
        return int(degrees["pp"]), int(degrees["dp"]), int(degrees["tp"])

    @property
    def needs_planning(self) -> bool:
        """Whether the layout planner chooses part of the layout (an ``"auto"`` beyond data_parallel, the sharding
        mode included)."""
        return "auto" in (self.pipeline_parallel, self.tensor_parallel, self.tp_overlap, self.recompute,
                          self.data_parallel_sharding, self.context_parallel)

    def resolve_degrees(self, world_size: int) -> tuple[int, int, int]:
        """``(dp, pp, tp)`` for ``world_size`` ranks, or a clear error when they cannot multiply to it.

        ``dp`` counts the context-parallel ranks too (batch replicas × ``context_parallel``), as the mesh does.
        """
        assert isinstance(self.context_parallel, int), "the planner chooses context_parallel"
        cp = self.context_parallel
        fixed = {name: value for name, value in self.degrees.items() if value != "auto"}
        product = math.prod(fixed.values()) * cp
        auto = [name for name in ("dp", "pp", "tp") if name not in fixed]
        if world_size % product:
            context = f" and context_parallel={cp}" if cp > 1 else ""
            raise ValueError(
                f"world size {world_size} is not divisible by the fixed degrees {fixed}{context}; "
                "choose data_parallel × pipeline_parallel × tensor_parallel × context_parallel = world size"
            )
        resolved = dict(fixed)
        for name in auto:
            resolved[name] = 1
        if auto:
            resolved["dp" if "dp" in auto else auto[0]] = world_size // product
        if math.prod(resolved.values()) * cp != world_size:
            context = f" × context_parallel={cp}" if cp > 1 else ""
            raise ValueError(
                f"data_parallel={resolved['dp']} × pipeline_parallel={resolved['pp']} × "
                f"tensor_parallel={resolved['tp']}{context} = {math.prod(resolved.values()) * cp} ≠ world size "
                f"{world_size}; make the product equal the number of processes (devices × num_nodes)"
            )
        return resolved["dp"] * cp, resolved["pp"], resolved["tp"]

    def layout(self, world_size: int) -> Layout:
        """The layout of a run whose arguments fix everything but perhaps data_parallel (no planning)."""
        assert not self.needs_planning, "the planner chooses this layout"
        dp, pp, tp = self.resolve_degrees(world_size)
        assert isinstance(self.tp_overlap, int)
        return Layout(
            data_parallel=dp, pipeline_parallel=pp, tensor_parallel=tp, virtual_stages=self.stages_per_rank,
            schedule=self.schedule, micro_batches=self.micro_batches or default_micro_batches(pp),
            micro_batches_by_default=self.micro_batches is None, tp_overlap=self.tp_overlap,
            recompute=self.recompute, recompute_ratio=self.recompute_ratio,
            data_parallel_sharding=self.data_parallel_sharding, data_parallel_shard_size=self.data_parallel_shard_size,
            context_parallel=int(self.context_parallel),
            context_attention=self.unplanned_context_attention,
        )

    def launch_degrees(self, world_size: int) -> tuple[Optional[int], Optional[int]]:
        """``(pp, tp)`` this run will use on ``world_size`` ranks; None for a degree the planner chooses."""
        if not self.needs_planning:
            _, pp, tp = self.resolve_degrees(world_size)
            return pp, tp
        fixed = [value for value in (*self.degrees.values(), self.context_parallel) if value != "auto"]
        if world_size % math.prod(fixed):
            raise ValueError(
                f"world size {world_size} is not divisible by the fixed degrees {fixed} (data, pipeline, tensor, "
                "context); choose degrees whose product divides the number of processes"
            )
        pp, tp = self.pipeline_parallel, self.tensor_parallel
        return (pp if isinstance(pp, int) else None), (tp if isinstance(tp, int) else None)

    # Refusals before launch ------------------------------------------------------------------

    def validate(self, world_size: int, *, batch_size: Optional[int] = None, sequence_length: Optional[int] = None,
                 accumulate_grad_batches: int = 1) -> None:
        """Refuse, before the model is even built, a layout that the world size or the batches rule out.

        ``batch_size`` is the batch each data-parallel replica's dataloader yields and
        ``sequence_length`` its tokens per sample; the checks that need them are skipped without
        them. Degrees left to the planner are checked once it has chosen them, at setup.
        """
        check_accumulation(accumulate_grad_batches)
        pp, tp = self.launch_degrees(world_size)
        if tp is not None:
            if isinstance(self.tp_overlap, int):
                check_overlap(self.tp_overlap, tp)
        context = known_context_parallel(self.context_parallel, self.degrees, world_size)
        if context > 1 and sequence_length is not None:
            with naming_auto_degree(self.context_parallel, context, self.degrees):
                check_sequence_divisible(sequence_length, context)
        if tp is not None and self.sequence_parallel and tp > 1 and sequence_length is not None:
            check_sequence_length(sequence_length // context, tp)  # each context rank's share is split over tp
        if self.micro_batching != "none" and pp is None:
            self._check_pipeline_room(world_size, tp)
        # micro-batching splits each global batch into micro-batches of any sample count (pad: uneven ones)
        fixed_split = self.micro_batching == "none" and (self.micro_batches is not None or not self.needs_planning)
        if batch_size is not None and fixed_split:
            overlap = self.tp_overlap if isinstance(self.tp_overlap, int) else 1
            check_batch_split(batch_size, pp or 1, self.micro_batches, overlap, self.schedule)

    def _check_pipeline_room(self, world_size: int, tensor_parallel: Optional[int]) -> None:
        """Refuse a planned ``pipeline_parallel`` under micro-batching where the world leaves no room for 2 stages
        beside the fixed tensor- and context-parallel degrees (micro-batching runs only through a pipeline)."""
        context = self.context_parallel if isinstance(self.context_parallel, int) else 1
        room = world_size // ((tensor_parallel or 1) * context)
        if room < 2:
            raise ValueError(f"micro_batching={self.micro_batching} runs its micro-batches through the pipeline "
                             f"schedule, but {world_size} processes with tensor_parallel={tensor_parallel or 1} and "
                             f"context_parallel={context} leave no room for pipeline_parallel>=2; use more processes, "
                             "lower those degrees, or set micro_batching=none")

    def validate_model(self, module: pl.LightningModule, world_size: int, sequence_length: Optional[int] = None
                       ) -> None:
        """Refuse a module merak3d cannot train at these degrees (no network to split, a pipeline loss it cannot
        infer, a loss per-sample context degrees cannot compute), degrees its network rules out, sequences too short
        for its next-token loss, or a planner memory limit its parameters alone exceed."""
        degrees = self.launch_degrees(world_size)
        check_scored_length(module, sequence_length)
        network = module_view(module, *degrees).network
        self.check_model(network, *degrees)
        if self.context_parallel_degree == "per_micro_batch":
            check_context_rounds_model(module, network)
        context = known_context_parallel(self.context_parallel, self.degrees, world_size)
        if self.context_parallel == "auto" and context > 1:  # the one degree 'auto' can take here
            with naming_auto_degree(self.context_parallel, context, self.degrees):
                check_context_parallel_model(network, context, self.unplanned_context_attention, degrees[1] or 1)
        if self.micro_batching == "pack" and self.context_parallel == "auto" and context == 1:  # may plan cp=1
            check_packing_attention(getattr(network, "config", None))
        if self.needs_planning and self.memory_limit is not None:
            check_memory_limit(self.memory_limit, network, world_size)

    def check_model(self, model: nn.Module, pipeline_parallel: Optional[int], tensor_parallel: Optional[int]) -> None:
        """Refuse degrees the unsplit model's config or structure rules out (None: not chosen yet)."""
        if tensor_parallel is not None:
            check_tensor_parallel_degree(getattr(model, "config", None), tensor_parallel)
            vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
            if self.vocab_parallel and tensor_parallel > 1 and isinstance(vocab_size, int):
                check_vocabulary_split(vocab_size, tensor_parallel)
            # LoRA on float bases splits with its layers; what does not (quantised bases, pooled adapters) is refused
            check_adapter_split(model, tensor_parallel)
        vocab_rows = getattr(getattr(model, "config", None), "vocab_size", None)
        if self.vocab_stages == "on" and pipeline_parallel and pipeline_parallel > 1 and isinstance(vocab_rows, int):
            check_vocab_stage_rows(vocab_rows, pipeline_parallel * (tensor_parallel or 1))
        if self.vocab_stages == "on" and pipeline_parallel and pipeline_parallel > 1:
            problem = vocab_stages_config_problem(model, self.schedule, tensor_parallel)
            if problem is not None:
                raise ValueError(problem)
        if self.sequence_parallel and tensor_parallel is not None and tensor_parallel > 1:
            check_sequence_parallel_family(getattr(model, "config", None), tensor_parallel)
            if moe_layers(model):
                raise ValueError("sequence_parallel does not support MoE layers; use sequence_parallel=False")
        if self.data_parallel_sharding == "full":
            check_fully_shardable(model, tensor_parallel)
        if self.context_parallel != "auto" and self.context_parallel > 1:
            check_context_parallel_model(model, self.context_parallel, self.unplanned_context_attention,
                                         tensor_parallel or 1)
        if pipeline_parallel is not None and pipeline_parallel > 1:
            check_stage_count(pipeline_parallel * self.stages_per_rank, len(find_trunk(model)[1]), self.partition)
        if (pipeline_parallel or 1) > 1 or (tensor_parallel or 1) > 1:  # both trace the blocks
            problem = declared_block_argument_problem(model)
            if problem is not None:
                raise ValueError(problem)
        if self.micro_batching == "pack" and self.context_parallel == 1:
            check_packing_attention(getattr(model, "config", None))


def least_state_bytes(model: nn.Module, world_size: int, *, at_most_16_bits: bool = True,
                      optimizer_bytes_per_parameter_byte: float = 0.0) -> dict[str, float]:
    """Bytes of ``model``'s state that some rank holds in any layout over ``world_size`` ranks, before activations:
    the share of every rank (the most any sharding splits them) of its parameters, the trainable ones' gradients
    and their optimizer state (``optimizer_bytes_per_parameter_byte`` of theirs), all held at the optimizer step.
    With ``at_most_16_bits`` floating parameters count at 16 bits (a 16-bit precision may convert them)."""
    def size(parameter: nn.Parameter) -> int:
        element = parameter.element_size()
        return parameter.numel() * (min(element, 2) if at_most_16_bits and parameter.is_floating_point() else element)

    trainable = sum(size(p) for p in model.parameters() if p.requires_grad) / world_size
    return {"parameters": sum(size(p) for p in model.parameters()) / world_size, "gradients": trainable,
            "optimizer state": optimizer_bytes_per_parameter_byte * trainable}


def least_parameter_bytes(model: nn.Module, world_size: int) -> int:
    """Bytes of ``model``'s parameters that some rank holds in any layout over ``world_size`` ranks (at 16 bits)."""
    return math.ceil(least_state_bytes(model, world_size)["parameters"])


def check_memory_limit(memory_limit: float, model: nn.Module, world_size: int, *, at_most_16_bits: bool = True,
                       optimizer_bytes_per_parameter_byte: float = 0.0) -> None:
    """Refuse a planner ``memory_limit`` below what ``model``'s state takes on some rank in every layout
    (:func:`least_state_bytes`): the planner would reject every layout, after profiling. Before launch the
    precision and the optimizer are unknown (16-bit parameters and gradients, no optimizer state); the planner
    checks again with both before it profiles."""
    state = least_state_bytes(model, world_size, at_most_16_bits=at_most_16_bits,
                              optimizer_bytes_per_parameter_byte=optimizer_bytes_per_parameter_byte)
    least = math.ceil(sum(state.values()))
    if memory_limit < least:
        parts = ", ".join(f"{name} {size:.0f}" for name, size in state.items() if size)
        raise ValueError(f"memory_limit={memory_limit:g} bytes per rank is below the {least} bytes every layout of "
                         f"{world_size} processes keeps on some rank before any activation ({parts}: their share "
                         f"of every rank); raise strategy.memory_limit well above {least}, or use more processes")


def checked_arguments(given: dict[str, Any]) -> tuple[Merak3DArguments, MicroBatching]:
    """The strategy's checked arguments from its constructor's ``locals()``, and its micro-batching options."""
    checked = Merak3DArguments(**{option.name: given[option.name] for option in fields(Merak3DOptions)})
    options = MicroBatching.of(checked.micro_batching, checked.micro_batch_tokens, checked.micro_batching_cost,
                               pipeline_parallel=checked.pipeline_parallel, tp_overlap=checked.tp_overlap,
                               schedule=checked.schedule, multi_stage_schedules=MULTI_STAGE_SCHEDULES,
                               context_rounds=checked.context_parallel_degree == "per_micro_batch")
    return checked, options
