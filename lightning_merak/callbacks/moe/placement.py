"""Lightning callback for swapped MoE layers: groups, DDP gradients, checkpoints, balance metrics, heatmap.

Under plain DDP the expert parameters differ per EP rank, so they must not be
averaged by DDP: ``setup`` (after the process group exists, before DDP wraps the
module) attaches the EP groups and tells DDP to ignore them, and after each backward DDP
synchronises (``on_after_backward``) their gradients are summed over the expert-data-parallel group
and divides by the data-parallel size — the gradient of the mean loss, like DDP's dense
average — and clipping by norm sums the experts' squares over their EP group
(:func:`~lightning_merak.distributed.gradient_norm.clip_over_groups`). Under merak3d the EP groups are carved
from each stage's data-parallel ranks.
Under DeepSpeed's engine groups are attached here too, and gradients are left to DeepSpeed.
DDP checkpoints get every rank's experts and expert optimizer state (DeepSpeed writes
per-rank expert files itself; merak3d's sharded checkpoints are not handled here); a
``weights_only`` save skips callbacks in Lightning and so keeps only rank 0's experts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch.distributed as dist

from lightning_merak.callbacks.moe.heatmap import (
    HEATMAP_FILE,
    LoadLogging,
    load_heatmap_figure,
    plot_load_heatmap,
)
from lightning_merak.checkpoint.expert_optimizer import (
    EXPERT_OPTIMIZER_KEY,
    expert_parallel_size,
    saved_expert_parallel_size,
)
from lightning_merak.distributed.collectives import average_gradients
from lightning_merak.distributed.gradient_norm import clip_over_groups
from lightning_merak.plugins.moe.block_replacement import SwappedSparseBlock
from lightning_merak.plugins.moe.checkpoint import EXPERTS_KEY, expert_param_positions, gather_expert_state
from lightning_merak.plugins.moe.core.placement import PlacementPlan, rank_loads
from lightning_merak.plugins.moe.core.step_planner import PLAN_KINDS
from lightning_merak.plugins.moe.layer import MoE, PlacementMOELayer
from lightning_merak.protocols.layout_aware import data_parallel_groups_from_mesh, layout_aware
from lightning_merak.util.optimizer_state import entry_slots

__all__ = ["MoEPlacementCallback", "balance_metrics", "load_heatmap_figure", "plot_load_heatmap"]
# load_heatmap_figure and plot_load_heatmap live in .heatmap, shared with merak_ep's callback


def balance_metrics(layer: PlacementMOELayer) -> dict[str, float]:
    """σ of per-rank compute load before/after the plan, RB, maxvio, dropped routes, exposed time, plan kind.

    ``plan_kind`` is the kind the step planner ran, as its index in ``PLAN_KINDS`` (none 0, dropless 1,
    shadowing 2, pro_prophet 3: loggers take numbers); ``plan_from_previous_step`` is 1 where it ran a
    prefetched plan made from the previous step's counts. ``predicted_ms`` is the cost model's time for
    the plan run, ``corrected_ms`` the online check's correction of it (the prediction where the check is
    off), ``measured_ms`` this rank's exchange forward + backward time (0 before the backward has run),
    ``explored`` 1 where the check ran the runner-up to measure it.
    """
    stats = layer.stats
    counts, plan, padding = stats["counts"], stats["plan"], stats["padding"]
    per_rank = layer.num_local_experts
    before = rank_loads(counts, PlacementPlan(plan.num_experts, plan.ep_size), padding, per_rank).computed
    after = rank_loads(counts, plan, padding, per_rank).computed
    sigma_before, sigma_after = _std(before), _std(after)
    mean_after = sum(after) / len(after)
    return {
        "sigma_before": sigma_before,
        "sigma_after": sigma_after,
        "rb": sigma_before / sigma_after if sigma_after > 0 else float(sigma_before > 0) or 1.0,
        "maxvio": max(after) / mean_after - 1 if mean_after > 0 else 0.0,
        "max_over_mean": max(after) / mean_after if mean_after > 0 else 1.0,
        "replicas": float(plan.num_replicas),
        "dropped_routes": float(stats["dropped_routes"]),
        "exposed_a2a_s": float(stats.get("exposed_a2a_forward_s", 0.0) + stats.get("exposed_a2a_backward_s", 0.0)),
        "exposed_a2a_backward_s": float(stats.get("exposed_a2a_backward_s", 0.0)),
        "aux_loss": float(stats.get("aux_loss", layer.l_aux.detach())),  # block-scope Lancet: sum of shares
        "plan_kind": float(PLAN_KINDS.index(stats.get("plan_kind", "none"))),
        "plan_from_previous_step": float(stats.get("plan_timing") == "predicted"),
        "predicted_ms": 1000.0 * float(stats.get("predicted_s", 0.0)),
        "corrected_ms": 1000.0 * float(stats.get("corrected_s") or stats.get("predicted_s", 0.0)),
        "measured_ms": 1000.0 * float(stats.get("exchange_forward_s", 0.0) + stats.get("exchange_backward_s", 0.0))
        if "exchange_backward_s" in stats else 0.0,
        "explored": float(bool(stats.get("explored"))),
    }


def _std(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


class MoEPlacementCallback(LoadLogging):
    """Prepares swapped MoE layers for DDP and logs ``moe/layer<i>/<metric>`` (global rank 0's layers).

    The metrics go to the loggers every ``log_every_n_steps`` optimizer steps (``None``: the trainer's
    ``log_every_n_steps``) and at the last step, at Lightning's step numbering
    (:mod:`~lightning_merak.callbacks.metrics.steps`), and to ``trainer.callback_metrics``.

    At the end of training rank 0 writes the load heatmap of its first MoE layer (steps × EP rank,
    before and after the placement plan) to ``heatmap_path``, or, with ``heatmap_in_log_dir=True``,
    to ``<trainer.log_dir>/moe_load_heatmap.png``: the directory of the first logger (for
    ``merak-train``, ``<output dir>/csv/`` next to ``metrics.csv``); a trainer without loggers
    keeps no log files, so it gets no heatmap either. The ``moe`` Hydra options use the latter,
    as the log dir is only known once the trainer exists (:mod:`~.heatmap`).
    """

    HEATMAP_FILE = HEATMAP_FILE

    def __init__(self, log_every_n_steps: Optional[int] = None, heatmap_path: str | Path | None = None,
                 heatmap_in_log_dir: bool = False) -> None:
        super().__init__(log_every_n_steps, heatmap_path, heatmap_in_log_dir)
        self._layers: list[PlacementMOELayer] = []
        self._uses_deepspeed = False
        self._data_parallel_group: Any = None
        self._data_parallel_size = 1
        self._uses_mesh = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Attach every layer's expert groups, on every rank in model order, before any layout change.

        Under a layout-aware strategy (:class:`~lightning_merak.protocols.layout_aware.LayoutAwareStrategy`,
        merak3d; its ``device_mesh`` has a "dp" dimension) EP groups are
        carved from each pipeline/tensor position's data-parallel ranks; this runs while every
        rank still holds the whole model, so the collective group creation matches across
        pipeline stages.
        """
        strategy = trainer.strategy
        self._uses_deepspeed = "deepspeed" in type(strategy).__name__.lower()
        self._layers = [m for m in pl_module.modules() if isinstance(m, PlacementMOELayer)]
        layout = layout_aware(strategy) if dist.is_initialized() else None
        dp_groups = None
        if layout is not None:
            mesh = layout.device_mesh
            dp_groups = data_parallel_groups_from_mesh(mesh.mesh.tolist(), list(mesh.mesh_dim_names))
            self._data_parallel_group = layout.data_parallel_group
            self._data_parallel_size = len(dp_groups[0])
            self._uses_mesh = True
        elif dist.is_initialized():
            self._data_parallel_group, self._data_parallel_size = None, dist.get_world_size()
        for layer in self._layers:
            if dp_groups is not None:
                if layer.groups is not None and layer.data_parallel_groups != dp_groups:
                    raise ValueError(
                        "an MoE layer attached its expert groups before the 3D layout was known; build the model "
                        "before the trainer runs it, without calling it first")
                layer.data_parallel_groups = dp_groups
            if dist.is_initialized():
                layer._attach()
        for module in pl_module.modules():
            if isinstance(module, SwappedSparseBlock) and dist.is_initialized():
                module.materialize()
        if not self._uses_deepspeed:
            ignored = [name for name, p in pl_module.named_parameters() if getattr(p, "allreduce", True) is False]
            existing = list(getattr(pl_module, "_ddp_params_and_buffers_to_ignore", []))
            pl_module._ddp_params_and_buffers_to_ignore = sorted(set(existing) | set(ignored))
        if not (self._uses_deepspeed or self._uses_mesh):
            for layer in self._layers:
                if layer.groups is not None and len(layer.groups.ep_ranks) > 1:
                    clip_over_groups(trainer, layer.experts.parameters(), layer.groups.ep_group)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Under DDP, on a backward that synchronises (not one under ``no_sync``, gradient accumulation): the
        experts' gradients averaged (:meth:`_average_expert_gradients`) as soon as DDP has averaged the rest, so
        every later hook (metrics, user callbacks, clipping, the optimizer) sees them averaged whatever the
        callbacks' order."""
        if not self._uses_mesh and getattr(trainer.strategy.model, "require_backward_grad_sync", True):
            self._average_expert_gradients()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._uses_mesh:
            self._average_expert_gradients()

    def _average_expert_gradients(self) -> None:
        """Expert gradients: sum over the ranks holding the same experts, divide by the data-parallel size.

        Every data-parallel rank's tokens reach an expert through the all-to-all, so the summed
        gradient over its expert-data-parallel group counts each rank's loss once; dividing by
        the data-parallel size gives the gradient of the mean loss, like the dense average.
        """
        if self._uses_deepspeed or not dist.is_initialized() or self._data_parallel_size == 1:
            return
        for layer in self._layers:
            grads = [p.grad for p in layer.experts.parameters() if p.grad is not None]
            if layer.groups is None:
                group = self._data_parallel_group
            else:
                group = layer.groups.edp_group if len(layer.groups.edp_ranks) > 1 else None
            average_gradients(grads, group, self._data_parallel_size)

    def _expert_layers(self, pl_module: pl.LightningModule) -> list[tuple[str, MoE]]:
        return [(name, m) for name, m in pl_module.named_modules() if isinstance(m, MoE) and m.ep_size > 1]

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Every rank's experts and their optimizer state into the checkpoint (collective, all ranks).

        DeepSpeed's engine writes per-rank expert files itself, so its checkpoints are left alone;
        so are merak3d's, which it writes sharded with its own naming.
        """
        if self._uses_deepspeed or self._uses_mesh or not dist.is_initialized():
            return
        layers = self._expert_layers(pl_module)
        for name, moe in layers:
            layer = moe.deepspeed_moe
            layer._attach()
            gather_expert_state(checkpoint["state_dict"], f"{name}.{EXPERTS_KEY}", layer.num_local_experts,
                                layer.ep_size, layer.ep_group)
        if layers and "optimizer_states" in checkpoint:
            group = layers[0][1].deepspeed_moe.ep_group
            saved = []
            for optimizer, state in zip(trainer.optimizers, checkpoint["optimizer_states"]):
                slots = entry_slots(state)
                local = {i: slots[i][0][slots[i][1]] for i in expert_param_positions(optimizer.param_groups)
                         if slots[i][1] in slots[i][0]}
                gathered: list[Any] = [None] * dist.get_world_size(group)
                dist.all_gather_object(gathered, local, group=group)
                saved.append(gathered)
            checkpoint[EXPERT_OPTIMIZER_KEY] = {"ep_size": layers[0][1].ep_size, "states": saved}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Put this EP rank's expert optimizer state in place of rank 0's before the optimizers load; another
        ``ep_size`` merak-train refuses before launch (:mod:`lightning_merak.checkpoint.compatible`)."""
        saved_ep_size = saved_expert_parallel_size(checkpoint)
        if saved_ep_size is None:
            return
        ep_size = expert_parallel_size(pl_module)
        if ep_size != saved_ep_size:
            raise ValueError(
                f"checkpoint's expert optimizer state was saved with ep_size={saved_ep_size}, this run uses "
                f"ep_size={ep_size}; resume with the same ep_size (weights alone load with any)")
        layer = self._expert_layers(pl_module)[0][1].deepspeed_moe
        layer._attach()
        for state, per_rank in zip(checkpoint["optimizer_states"], checkpoint[EXPERT_OPTIMIZER_KEY]["states"]):
            slots = entry_slots(state)
            for position, entry in per_rank[layer.ep_rank].items():
                entries, key = slots[position]
                entries[key] = entry

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        for index, layer in enumerate(self._layers):
            if "counts" not in layer.stats:
                continue
            counts, plan, padding = layer.stats["counts"], layer.stats["plan"], layer.stats["padding"]
            before, after = self.history.setdefault(index, ([], []))
            empty = PlacementPlan(plan.num_experts, plan.ep_size)
            before.append(rank_loads(counts, empty, padding, layer.num_local_experts).computed)
            after.append(rank_loads(counts, plan, padding, layer.num_local_experts).computed)
        if self._stepped(trainer):  # None while gradients accumulate: the optimizer step comes with a later batch
            metrics = self._metrics()
            for name, value in metrics.items():
                pl_module.log(name, value, on_step=True, on_epoch=False, logger=False)
            self._log_metrics(trainer, metrics)

    def _metrics(self) -> dict[str, float]:
        """Every layer's :func:`balance_metrics` of its last call, as ``moe/layer<i>/<metric>``."""
        return {f"moe/layer{index}/{key}": value for index, layer in enumerate(self._layers) if "counts" in layer.stats
                for key, value in balance_metrics(layer).items()}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The last step's metrics where its interval was cut short, and the heatmaps."""
        self._log_metrics(trainer, self._metrics())
        self._draw_heatmaps(trainer)
