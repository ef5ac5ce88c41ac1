"""Lightning glue for ``merak_ep``: enable it in every process, keep DDP off the experts, log the load and draw it.

Thin: :func:`~lightning_merak.plugins.moe.experts.enable.enable_expert_parallel` does the work. The
callback runs it in ``setup`` (processes and the process group exist, DDP and the optimizer do not
yet), over expert groups of ``ep_size`` consecutive ranks; every rank holding the same experts forms
an expert-data-parallel group. After each backward DDP synchronises an expert gradient is summed over that
group and divided by the world size, the gradient of the mean loss that DDP's average gives the rest; clipping
by norm sums the experts' squares over the expert group
(:func:`~lightning_merak.distributed.gradient_norm.clip_over_groups`).
Under merak3d the groups are carved from each stage's data-parallel ranks instead
(:mod:`lightning_merak.parallel.experts`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy, XLAStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_merak.callbacks.moe.heatmap import LoadLogging
from lightning_merak.checkpoint.sharded import ExpertParallelCheckpointIO, ExpertSlices
from lightning_merak.distributed.collectives import average_gradients
from lightning_merak.distributed.gradient_norm import clip_over_groups
from lightning_merak.distributed.process_groups import new_group
from lightning_merak.parallel.data.agreed_overflow import agree_on_overflow
from lightning_merak.parallel.experts import Merak3DExperts
from lightning_merak.plugins.moe.core.placement import Padding, PlacementPlan, rank_loads
from lightning_merak.plugins.moe.experts.enable import add_loads, enable_expert_parallel, expert_load, experts_modules
from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE
from lightning_merak.plugins.moe.experts.replanning import ReplicaPlanner
from lightning_merak.protocols.layout_aware import layout_aware

__all__ = ["ExpertParallelCallback"]

_NOT_BUILT_UNDER = (DeepSpeedStrategy, XLAStrategy)
"""Subclasses of Lightning's ``DDPStrategy`` that do not wrap the model in torch's DDP: merak_ep is not built there."""


def _ignore_in_ddp(module: torch.nn.Module, names: list[str]) -> None:
    """Have torch's DDP leave ``module``'s parameters ``names`` alone (each rank's experts differ; the callback
    reduces their gradients itself): torch has no public API for it, only this documented workaround, which sets
    the ``_ddp_params_and_buffers_to_ignore`` attribute DDP reads when it wraps the module."""
    ignore = getattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None)
    if ignore is None:
        raise RuntimeError(
            "moe.experts=merak_ep needs DDP to skip the expert parameters, through torch's "
            "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model, which this torch "
            f"({torch.__version__}) does not have; use strategy=merak3d or moe.experts=deepspeed")
    ignore(module, names)


class ExpertParallelCallback(LoadLogging):
    """Run a transformers MoE model's experts expert-parallel (``merak_ep``) under Lightning's DDP.

    ``ep_size`` defaults to the world size. Logs ``moe_ep/max_over_mean`` (the most loaded expert over
    the mean, worst layer, routes since the last log) every ``log_every_n_steps`` optimizer steps (``None``: the
    trainer's ``log_every_n_steps``) and at the last step, at Lightning's step numbering
    (:mod:`~lightning_merak.callbacks.metrics.steps`). ``placement``
    ``"pro_prophet"`` or ``"shadowing"`` re-plans replicas of hot experts every ``replan_every`` training batches
    from the routes since the last plan (:class:`~.replanning.ReplicaPlanner`, under DDP; ``moe_ep/replicas``
    logged). At the end the expert-load heatmap of each layer rank 0 holds (steps × EP rank, without and with
    the replicas) goes where ``heatmap_path`` / ``heatmap_in_log_dir`` say and to the loggers, as
    :class:`~.placement.MoEPlacementCallback`'s does (:mod:`~.heatmap`).
    """

    def __init__(self, ep_size: int | None = None, log_every_n_steps: Optional[int] = None, placement: str = "none",
                 replan_every: int = 1, heatmap_path: str | Path | None = None,
                 heatmap_in_log_dir: bool = False) -> None:
        super().__init__(log_every_n_steps, heatmap_path, heatmap_in_log_dir)
        self.ep_size = ep_size
        self._planner = None if placement == "none" else ReplicaPlanner(placement, replan_every)  # type: ignore[arg-type]
        self._since_log: dict[str, torch.Tensor] = {}
        self._expert_params: list[torch.nn.Parameter] = []
        self._edp_group: Any = None
        self._edp_size = 1
        self._world = 1
        self._merak3d: Any = None
        self._slices: Any = None

    def _groups(self) -> Any:
        world, rank = dist.get_world_size(), dist.get_rank()
        ep = self.ep_size or world
        if ep < 1 or world % ep:
            raise ValueError(f"moe.ep_size={ep} does not divide the world size {world}; choose a divisor of {world}")
        ep_groups = [new_group(list(range(i * ep, (i + 1) * ep))) for i in range(world // ep)]
        edp_groups = [new_group(list(range(j, world, ep))) for j in range(ep)]
        self._edp_group, self._edp_size, self._world = edp_groups[rank % ep], world // ep, world
        return None if ep == world else ep_groups[rank // ep]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        merak3d = layout_aware(strategy) is not None
        ddp = isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)) and not isinstance(strategy, _NOT_BUILT_UNDER)
        if not merak3d and not ddp:
            raise ValueError(f"moe.experts=merak_ep runs under DDP (strategy=ddp) or merak3d, not "
                             f"{type(strategy).__name__}: expert parallelism under DeepSpeed is not built; use "
                             "strategy=ddp, strategy=merak3d or moe.experts=deepspeed")
        if self._expert_params or self._merak3d is not None or not (dist.is_available() and dist.is_initialized()):
            return
        if merak3d and self._planner is not None:
            raise ValueError(f"placement={self._planner.policy!r} for merak_ep replicas runs under DDP; under merak3d "
                             "it is not built (each stage's experts have their own group): use placement=none")
        if merak3d:
            self._merak3d = Merak3DExperts(trainer.strategy, self.ep_size)
            if getattr(pl_module, "model", None) is not None:  # else built by configure_model: on_fit_start
                self._merak3d.enable(pl_module)
            return
        group = self._groups()
        report = enable_expert_parallel(pl_module, group)
        params = dict(pl_module.named_parameters())
        self._expert_params = [params[name] for name in report.expert_parameters]
        if dist.get_world_size(group) > 1:  # each rank of the expert group holds other experts
            clip_over_groups(trainer, self._expert_params, group)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # an overflow in one rank's experts skips the step on every rank
            agree_on_overflow(scaler)
        ignored = (set(getattr(pl_module, "_ddp_params_and_buffers_to_ignore", [])) | set(report.expert_parameters)
                   | set(report.expert_buffers))
        _ignore_in_ddp(pl_module, sorted(ignored))
        # rank 0's file holds every expert and expert adapter factor (on_save_checkpoint); it, and a merak3d
        # checkpoint, resume at any ep
        self._slices = ExpertSlices.of(pl_module)
        if not isinstance(trainer.strategy.checkpoint_io, ExpertParallelCheckpointIO):  # merak-train's may be one
            trainer.strategy.checkpoint_io = ExpertParallelCheckpointIO(trainer.strategy.checkpoint_io, pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Under merak3d, a model ``configure_model`` built (on meta) after ``setup``: switched before its build."""
        if self._merak3d is not None and self._merak3d.report is None:
            self._merak3d.enable(pl_module)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Under DDP, on a backward that synchronises (not one under ``no_sync``, gradient accumulation): the experts'
        gradients averaged as soon as DDP has averaged the rest, so every later hook (metrics, user callbacks,
        clipping, the optimizer) sees them averaged whatever the callbacks' order."""
        if self._merak3d is not None or not getattr(trainer.strategy.model, "require_backward_grad_sync", True):
            return
        grads = [p.grad for p in self._expert_params if p.grad is not None]
        if not grads or self._world == 1:
            return
        average_gradients(grads, self._edp_group if self._edp_size > 1 else None, self._world)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._merak3d is not None:
            self._merak3d.reduce_gradients(pl_module)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if self._slices is not None:  # every rank: experts and their adapters' factors gathered whole for rank 0
            self._slices.whole_checkpoint(checkpoint, pl_module, trainer.optimizers)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not (self._expert_params or self._merak3d):
            return
        self._record_rows(pl_module)
        loads = expert_load(pl_module)
        self._since_log = add_loads(self._since_log, loads)
        if self._planner is not None:
            self._planner.step(pl_module, loads)
            pl_module.log("moe_ep/replicas", float(self._planner.replicas_planned), rank_zero_only=True)
        if self._stepped(trainer):  # None while gradients accumulate: the optimizer step comes with a later batch
            worst = self._worst_over_mean()
            pl_module.log("moe_ep/max_over_mean", worst, rank_zero_only=True, logger=False)
            self._log_metrics(trainer, {"moe_ep/max_over_mean": worst})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The routes since the last log where the run ended inside an interval, and the heatmaps."""
        if self._has_unlogged_step:
            self._log_metrics(trainer, {"moe_ep/max_over_mean": self._worst_over_mean()})
        self._draw_heatmaps(trainer)

    def _record_rows(self, pl_module: pl.LightningModule) -> None:
        """This batch's rows computed per EP rank of each layer, without and with its replicas (before
        :func:`expert_load` resets the counts)."""
        for position, (name, module) in enumerate(experts_modules(pl_module)):
            shard = getattr(module, SHARD_ATTRIBUTE, None)
            if shard is None or shard.load.numel() == 0:
                continue
            counts = shard.load.tolist()
            per_rank = shard.num_experts // shard.ep_size
            owners = PlacementPlan(shard.num_experts, shard.ep_size)
            before, after = self.history.setdefault(_layer_index(name, position), ([], []))
            before.append(rank_loads(counts, owners, Padding(), per_rank).computed)
            after.append(rank_loads(counts, shard.plan or owners, Padding(), per_rank).computed)

    def _worst_over_mean(self) -> float:
        """The most loaded expert over the mean, worst layer, of the routes since the last log (then forgotten)."""
        worst = 0.0
        for counts in self._since_log.values():
            per_expert = counts.sum(0).double()
            if per_expert.sum() > 0:
                worst = max(worst, float(per_expert.max() / per_expert.mean()))
        self._since_log = {}
        return worst


def _layer_index(name: str, position: int) -> int:
    """The decoder layer an experts module belongs to: the last number in its qualified name
    (``model.layers.3.mlp.experts``: 3), else its position among the model's experts modules."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    return numbers[-1] if numbers else position
