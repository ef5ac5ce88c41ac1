"""Lightning callback for swapped MoE layers: groups, DDP gradients, balance metrics, heatmap.

Under plain DDP the expert parameters differ per EP rank, so they must not be
averaged by DDP: ``setup`` (after the process group exists, before DDP wraps the
module) attaches the EP groups and tells DDP to ignore them, and
``on_before_optimizer_step`` sums their gradients over the expert-data-parallel group
and divides by the world size — the gradient of the mean loss, like DDP's dense
average. Under DeepSpeed's engine both are left to DeepSpeed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_merak.plugins.moe.layer import PlacementMOELayer
from lightning_merak.plugins.moe.placement import PlacementPlan, rank_loads
from lightning_merak.plugins.moe.swap import SwappedSparseBlock

__all__ = ["MoEPlacementCallback", "balance_metrics", "plot_load_heatmap"]


def balance_metrics(layer: PlacementMOELayer) -> dict[str, float]:
    """σ of per-rank compute load before/after the plan, RB, maxvio, dropped routes, exposed time."""
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
        "exposed_a2a_s": float(stats.get("exposed_a2a_s", 0.0)),
        "aux_loss": float(layer.l_aux.detach()),
    }


def _std(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def plot_load_heatmap(
    before: Sequence[Sequence[float]], after: Sequence[Sequence[float]], path: Path, title: str = ""
) -> Path:
    """Two heatmaps (steps × EP rank): compute load without and with the placement plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    vmax = max(max(map(max, before)), max(map(max, after)), 1)
    for ax, data, label in zip(axes, (before, after), ("before (DeepSpeed placement)", "after (plan)")):
        image = ax.imshow(list(map(list, data)), aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
        ax.set_title(label)
        ax.set_xlabel("EP rank")
    axes[0].set_ylabel("step")
    fig.colorbar(image, ax=axes, label="rows computed")
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class MoEPlacementCallback(pl.Callback):
    """Prepares swapped MoE layers for DDP and logs ``moe/layer<i>/<metric>`` every step."""

    def __init__(self, log_every_n_steps: int = 1, heatmap_path: str | None = None) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.heatmap_path = heatmap_path
        self.history: dict[int, tuple[list[list[int]], list[list[int]]]] = {}
        self._layers: list[PlacementMOELayer] = []
        self._uses_deepspeed = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uses_deepspeed = "deepspeed" in type(trainer.strategy).__name__.lower()
        for module in pl_module.modules():
            if isinstance(module, SwappedSparseBlock) and dist.is_initialized():
                module.materialize()
        self._layers = [m for m in pl_module.modules() if isinstance(m, PlacementMOELayer)]
        if not self._uses_deepspeed:
            ignored = [name for name, p in pl_module.named_parameters() if getattr(p, "allreduce", True) is False]
            existing = list(getattr(pl_module, "_ddp_params_and_buffers_to_ignore", []))
            pl_module._ddp_params_and_buffers_to_ignore = sorted(set(existing) | set(ignored))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._uses_deepspeed or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        world = dist.get_world_size()
        for layer in self._layers:
            grads = [p.grad for p in layer.experts.parameters() if p.grad is not None]
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            if layer.groups is not None and len(layer.groups.edp_ranks) > 1:
                dist.all_reduce(flat, group=layer.groups.edp_group)
            flat.div_(world)
            for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(piece.view_as(grad))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        for index, layer in enumerate(self._layers):
            if "counts" not in layer.stats:
                continue
            counts, plan, padding = layer.stats["counts"], layer.stats["plan"], layer.stats["padding"]
            before, after = self.history.setdefault(index, ([], []))
            empty = PlacementPlan(plan.num_experts, plan.ep_size)
            before.append(rank_loads(counts, empty, padding, layer.num_local_experts).computed)
            after.append(rank_loads(counts, plan, padding, layer.num_local_experts).computed)
            if trainer.global_step % self.log_every_n_steps == 0:
                for key, value in balance_metrics(layer).items():
                    pl_module.log(f"moe/layer{index}/{key}", value, on_step=True, on_epoch=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.heatmap_path and trainer.is_global_zero and self.history:
            before, after = self.history[0]
            plot_load_heatmap(before, after, Path(self.heatmap_path), "MoE layer 0")
