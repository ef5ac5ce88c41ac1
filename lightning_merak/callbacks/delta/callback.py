"""``DeltaMemory``: DELTA-style swap and recompute of activations as a Lightning callback.

No model edits: blocks are found in the module Lightning trains (or in whatever module a
strategy hands over, such as a pipeline stage, through :meth:`DeltaMemory.manage`), their
``forward`` is switched on the instance before the strategy wraps the model, and all the
rest happens through hooks. See :mod:`lightning_merak.callbacks.delta.runtime`.

Strategies that cut and shard the model on the first batch (layout-aware ones,
:class:`~lightning_merak.protocols.layout_aware.LayoutAwareStrategy`: merak3d) are handled per
rank: the selection is checked on the whole model at ``setup``, and on the first training
batch, once the layout exists, each rank manages the blocks of its own pipeline stages under
its own budget. Blocks the strategy already recomputes are left alone and logged, like user
checkpointing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import Any, Callable, Mapping, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_merak.callbacks.delta.blocks import SELECTOR_FORMS, BlockSelector, describe_blocks, discover_blocks
from lightning_merak.callbacks.delta.budget import Budget, BudgetLike, parse_budget
from lightning_merak.callbacks.delta.memory_planner import Action, Plan
from lightning_merak.callbacks.delta.options import DeltaOptions
from lightning_merak.callbacks.delta.plot import save_timeline_plot
from lightning_merak.callbacks.delta.profiler import agree_profile
from lightning_merak.callbacks.delta.recompute_switch import (
    strategy_recompute,
    turn_off_kv_caches,
    user_checkpointing,
)
from lightning_merak.callbacks.delta.runtime import ManagerOptions, MemoryManager, StepReport, iter_tensors
from lightning_merak.distributed.process_groups import collective_device
from lightning_merak.protocols.layout_aware import layout_aware

__all__ = ["DeltaMemory"]

log = logging.getLogger(__name__)

PLOT_NAME = "delta_memory_timeline.png"
_DEFAULTS = DeltaOptions()


def _parse_overrides(overrides: Optional[Mapping[str, str]]) -> dict[str, Action]:
    parsed = {}
    for name, action in (overrides or {}).items():
        try:
            parsed[name] = Action(action)
        except ValueError:
            raise ValueError(
                f"override for block {name!r} is {action!r}; choose one of {[a.value for a in Action]}"
            ) from None
    return parsed


def _resolve_overrides(overrides: Mapping[str, Action], blocks: list[str]) -> dict[str, Action]:
    """``overrides`` keyed by the block names of the managed root: a name that is no such block but names one
    relative to the root's ``model`` (``model.layers.0`` for a LightningModule's ``model.model.layers.0``, as the
    Hugging Face model calls it) is taken as that block. Names that are no block either way are kept, for the
    caller's refusal to list the blocks; two names of one block are refused."""
    resolved: dict[str, Action] = {}
    spelled: dict[str, str] = {}
    for name, action in overrides.items():
        block = f"model.{name}" if name not in blocks and f"model.{name}" in blocks else name
        if block in spelled:
            raise ValueError(f"DeltaMemory overrides name block {block} twice, as {spelled[block]!r} and {name!r}; "
                             "keep one of them")
        spelled[block] = name
        resolved[block] = action
    return resolved


class DeltaMemory(pl.Callback):
    """Keep saved activations under ``budget`` by swapping or recomputing whole blocks.

    Args:
        budget: bytes of saved activations (``int`` or ``"2GiB"``), a fraction of device
            memory for the whole process (``0.5``, ``"50%"``), or ``"auto"`` (90%).
        blocks: which submodules to manage; default finds the repeated blocks.
        overrides: fixed actions per block name, relative to the LightningModule (``{"model.model.layers.0":
            "recompute"}`` for ``CausalLMModule``) or to its ``model`` (``{"model.layers.0": "recompute"}``).
        swap_tier, swap_dir, warmup_steps, director, prefetch_depth, min_offload_bytes, stash_depth,
            host_pool_bytes, replan_on_shape_change, plot: see
            :class:`~lightning_merak.callbacks.delta.options.DeltaOptions`.

    The defaults, descriptions and checks of every setting but ``budget``, ``blocks`` and ``overrides`` live in
    :class:`~lightning_merak.callbacks.delta.options.DeltaOptions`.
    """

    fully_sharded_refusal = "it resizes storage that FSDP2's parameters own"
    """Why ``data_parallel_sharding="full"`` is refused with it (:mod:`lightning_merak.protocols.callbacks`)."""

    def __init__(
        self,
        budget: BudgetLike | Budget = "auto",
        *,
        swap_tier: Optional[str] = _DEFAULTS.swap_tier,
        swap_dir: Optional[str] = _DEFAULTS.swap_dir,
        warmup_steps: int = _DEFAULTS.warmup_steps,
        director: str = _DEFAULTS.director,
        prefetch_depth: int = _DEFAULTS.prefetch_depth,
        blocks: BlockSelector = None,
        overrides: Optional[Mapping[str, str]] = None,
        min_offload_bytes: int = _DEFAULTS.min_offload_bytes,
        stash_depth: int = _DEFAULTS.stash_depth,
        host_pool_bytes: Optional[int] = _DEFAULTS.host_pool_bytes,
        replan_on_shape_change: bool = _DEFAULTS.replan_on_shape_change,
        plot: bool = _DEFAULTS.plot,
    ) -> None:
        settings = DeltaOptions(
            swap_tier=swap_tier, swap_dir=swap_dir, warmup_steps=warmup_steps, director=director,
            prefetch_depth=prefetch_depth, min_offload_bytes=min_offload_bytes, stash_depth=stash_depth,
            host_pool_bytes=host_pool_bytes, replan_on_shape_change=replan_on_shape_change, plot=plot,
        )
        settings.validate()
        self.budget = parse_budget(budget)
        self.swap_tier = swap_tier
        self.blocks = blocks
        self.plot = plot
        self._options = ManagerOptions(
            **{**vars(settings), "swap_tier": swap_tier or "disk"},
            budget=self.budget,
            overrides=_parse_overrides(overrides),
        )
        self.manager: Optional[MemoryManager] = None
        self.excluded: dict[str, str] = {}
        self.plot_path: Optional[str] = None
        self._last_report: Optional[StepReport] = None
        self._patched_configure_model: Optional[nn.Module] = None
        self._active = False
        self._layout_candidates: Optional[set[str]] = None
        self._uncached_configs: list[Any] = []

    # public ------------------------------------------------------------------------------

    @property
    def plan(self) -> Optional[Plan]:
        return self.manager.plan if self.manager is not None else None

    def manage(self, module: nn.Module, prefix: str = "") -> list[str]:
        """Find and hook the blocks of ``module`` (a whole model or one pipeline stage).

        Must run before the strategy wraps the model; ``DeltaMemory.setup`` calls it on the
        LightningModule. Returns the managed block names; blocks someone else already
        checkpoints are left alone and listed in :attr:`excluded` with the reason.
        """
        if self._active:
            raise RuntimeError("DeltaMemory already manages a module; use one callback per model")
        found = [(f"{prefix}{name}", block) for name, block in discover_blocks(module, self.blocks)]
        self._options.overrides = _resolve_overrides(self._options.overrides, [name for name, _ in found])
        managed = self._respect_existing_checkpointing(found)
        for name in self.excluded:
            rank_zero_info(f"DeltaMemory: leaving {name} alone: {self.excluded[name]}")
        if not managed:
            warnings.warn(
                f"DeltaMemory: nothing to manage in {type(module).__name__} "
                f"({'all blocks are checkpointed by the user' if found else 'no repeated blocks found'}); "
                "pass blocks=[...] to choose them",
                stacklevel=2,
            )
            return []
        self.manager = MemoryManager(managed, self._options, log=rank_zero_info, share=_share_across_ranks,
                                     any_rank=_any_rank)
        self._active = True
        return [n for n, _ in managed]

    # Lightning hooks ---------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._active:
            return
        self._warn_deepspeed(trainer)
        if _builds_layout_on_first_batch(trainer.strategy):
            self._check_selection_before_layout(pl_module)
            return
        if self._has_blocks(pl_module) or not _overrides_configure_model(pl_module):
            self._manage_or_fail(pl_module)
            return
        original = pl_module.configure_model

        def configure_model_then_manage() -> None:
            original()
            del pl_module.__dict__["configure_model"]
            self._patched_configure_model = None
            self._manage_or_fail(pl_module)

        pl_module.configure_model = configure_model_then_manage
        self._patched_configure_model = pl_module

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active and self._layout_candidates is None:
            return
        _refuse_fully_sharded(pl_module, self.fully_sharded_refusal)  # configure_model may shard after setup
        self._warn_if_warmup_outlasts_run(trainer)
        self._turn_off_kv_caches(pl_module)
        device = pl_module.device
        if self.swap_tier is None:
            self._options.swap_tier = "host" if device.type == "cuda" else "disk"
        elif self.swap_tier == "host" and device.type != "cuda":
            warnings.warn(
                "DeltaMemory: swap_tier='host' on CPU copies activations within the same memory and "
                "frees nothing; use swap_tier='disk'",
                stacklevel=2,
            )
        if self._active:
            self.manager.start(pl_module, device)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._active and self._layout_candidates is not None:
            self._manage_layout_blocks(trainer.strategy, pl_module)
        if not self._active:
            return
        tensors = list(iter_tensors(batch))
        signature = tuple(tuple(t.shape) for t in tensors)
        self.manager.begin_step(signature, sum(t.numel() for t in tensors))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._active:
            self.manager.end_forward()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            self._last_report = self.manager.end_backward()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        report, self._last_report = self._last_report, None
        if report is None:
            return
        pl_module.log_dict(
            {
                "delta/peak_saved_MiB": report.peak_saved_bytes / 2**20,
                "delta/budget_MiB": report.budget_bytes / 2**20,
                "delta/planned_release_MiB": report.planned_release_bytes / 2**20,
                "delta/swapped_blocks": float(report.swapped_blocks),
                "delta/recomputed_blocks": float(report.recomputed_blocks),
                "delta/exposed_copy_ms": report.exposed_copy_s * 1e3,
                "delta/device_peak_MiB": report.device_peak_bytes / 2**20,
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Rank 0 saves the timeline plot into the log directory.

        ``trainer.log_dir`` broadcasts from rank 0, so every rank resolves it, before any
        rank-dependent test: a rank that skipped it would leave the others waiting.
        """
        if not self.plot:
            return
        directory = trainer.log_dir or trainer.default_root_dir
        if self.manager is None or not trainer.is_global_zero:
            return
        self.plot_path = save_timeline_plot(
            os.path.join(directory, PLOT_NAME),
            self.manager.timelines,
            self.manager.budget_bytes,
            self.manager.plan,
            self.manager.profile,
            trainer,
        )
        rank_zero_info(f"DeltaMemory: memory timeline saved to {self.plot_path}")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    # helpers -----------------------------------------------------------------------------

    def _close(self) -> None:
        for config in self._uncached_configs:
            config.use_cache = True
        self._uncached_configs = []
        if self._patched_configure_model is not None:
            self._patched_configure_model.__dict__.pop("configure_model", None)
            self._patched_configure_model = None
        if self._active:
            self.manager.close()
            self._active = False

    def _warn_if_warmup_outlasts_run(self, trainer: pl.Trainer) -> None:
        """A run no longer than the warm-up profiles every batch and never manages a block."""
        if trainer.max_steps < 0:
            return
        batches = trainer.max_steps * trainer.accumulate_grad_batches
        if self._options.warmup_steps >= batches:
            rank_zero_warn(
                f"DeltaMemory: warmup_steps={self._options.warmup_steps} covers the whole run "
                f"(max_steps={trainer.max_steps}, {batches} training batches), so no block is ever swapped "
                f"or recomputed; lower warmup_steps below {batches} or train for longer"
            )

    def _turn_off_kv_caches(self, pl_module: pl.LightningModule) -> None:
        """Training keeps no key/value cache, which recompute would replay (restored at teardown)."""
        self._uncached_configs = turn_off_kv_caches(pl_module)
        if self._uncached_configs:
            rank_zero_info(
                "DeltaMemory: turned off the key/value cache (config.use_cache=False) for training: a recomputed "
                "block replays its call, and a cache would take its keys twice"
            )

    def _respect_existing_checkpointing(
        self, found: list[tuple[str, nn.Module]], strategy: Any = None
    ) -> list[tuple[str, nn.Module]]:
        """The blocks nobody else recomputes; the others go to :attr:`excluded` with the reason."""
        managed = []
        for name, block in found:
            reason = strategy_recompute(block, strategy) or user_checkpointing(block)
            if reason is None:
                managed.append((name, block))
            else:
                self.excluded[name] = reason
        return managed

    def _check_selection_before_layout(self, pl_module: pl.LightningModule) -> None:
        """Validate blocks and overrides on the whole model, before the strategy cuts it."""
        found = [name for name, _ in discover_blocks(pl_module, self.blocks)]
        if not found:
            raise self._nothing_selected(pl_module)
        self._options.overrides = _resolve_overrides(self._options.overrides, found)
        unknown = sorted(set(self._options.overrides) - set(found))
        if unknown:
            raise ValueError(f"DeltaMemory overrides name unknown blocks {unknown}; the model's blocks are {found}")
        self._layout_candidates = set(found)
        rank_zero_info(
            "DeltaMemory: the strategy builds its layout on the first batch; each rank manages its blocks then"
        )

    def _manage_layout_blocks(self, strategy: Any, pl_module: pl.LightningModule) -> None:
        """Manage this rank's blocks of a layout the strategy has just built (first batch).

        Every rank gets a manager, even one with nothing left to manage, because the plan
        exchange at the end of warm-up is a collective over all ranks.
        """
        if not strategy.layout_built:
            raise RuntimeError(
                f"DeltaMemory: {type(strategy).__name__} has not built its layout by the first training batch; "
                "it must build it in batch_to_device (before on_train_batch_start)"
            )
        names = _original_module_names(pl_module)
        local = [(names[id(block)], block) for _, block in sorted(strategy.local_blocks.items()) if id(block) in names]
        selected = [(name, block) for name, block in local if name in self._layout_candidates]
        managed = self._respect_existing_checkpointing(selected, strategy)
        managed_names = {name for name, _ in managed}
        say = _log_once_per_stage((sorted(managed_names), sorted(self.excluded)))
        for name, reason in self.excluded.items():
            say(f"DeltaMemory: leaving {name} alone: {reason}")
        options = dataclasses.replace(
            self._options, overrides={n: a for n, a in self._options.overrides.items() if n in managed_names}
        )
        self.manager = MemoryManager(managed, options, log=say, share=_share_across_ranks,
                                     any_rank=_any_rank)
        self._active = True
        self.manager.start(pl_module, pl_module.device)

    def _has_blocks(self, module: nn.Module) -> bool:
        return bool(discover_blocks(module, self.blocks))

    def _manage_or_fail(self, pl_module: pl.LightningModule) -> None:
        if not self._has_blocks(pl_module):
            raise self._nothing_selected(pl_module)
        _refuse_fully_sharded(pl_module, self.fully_sharded_refusal)
        self.manage(pl_module)

    def _nothing_selected(self, pl_module: pl.LightningModule) -> ValueError:
        """The refusal of a fit with no block to manage: none found, or none that ``blocks`` picks."""
        if self.blocks is None:
            return ValueError(
                f"DeltaMemory found no repeated blocks in {type(pl_module).__name__}; pass "
                "blocks=[qualified names] or blocks=<module class> to choose what to manage"
            )
        return ValueError(
            f"DeltaMemory: blocks={self.blocks!r} selects no block: {describe_blocks(pl_module)}; {SELECTOR_FORMS}"
        )

    @staticmethod
    def _warn_deepspeed(trainer: pl.Trainer) -> None:
        config = getattr(trainer.strategy, "config", None)
        if isinstance(config, dict) and config.get("activation_checkpointing"):
            warnings.warn(
                "DeltaMemory: the DeepSpeed strategy has activation_checkpointing configured; it only acts "
                "inside deepspeed.checkpointing.checkpoint and conflicts with DeltaMemory's hooks - "
                "remove one of the two",
                stacklevel=2,
            )


def _builds_layout_on_first_batch(strategy: Any) -> bool:
    return layout_aware(strategy) is not None


def _original_module_names(pl_module: pl.LightningModule) -> dict[int, str]:
    """Qualified names in the unsplit model of ``pl_module``'s modules, by ``id``.

    A pipelined model is a ``RankStages`` with ``original_name``; its module names map back
    the same way its parameter names do, so plans and logs use the names users know.
    """
    model = getattr(pl_module, "model", None)
    rename = getattr(model, "original_name", None)
    names = {}
    for name, module in pl_module.named_modules():
        if rename is not None and name.startswith("model."):
            name = "model." + rename(name[len("model."):])
        names[id(module)] = name
    return names


def _log_once_per_stage(stage_key: Any) -> Callable[[str], None]:
    """A logger that speaks on the lowest rank with this ``stage_key``: one plan per pipeline stage.

    Collective (every rank calls it at the same point); messages carry the rank.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return rank_zero_info
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stage_key)
    rank = dist.get_rank()
    if gathered.index(stage_key) != rank:
        return lambda message: None
    return lambda message: log.info(message.replace("DeltaMemory", f"DeltaMemory [rank {rank}]", 1))


def _overrides_configure_model(pl_module: pl.LightningModule) -> bool:
    return type(pl_module).configure_model is not pl.LightningModule.configure_model


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (one small all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    votes = torch.tensor([int(flag)], device=collective_device())
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    return bool(votes.item())


def _share_across_ranks(payload: Any) -> Any:
    """Every rank plans from the profile of the lowest rank managing the same blocks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return payload
    names = tuple(b.name for b in payload[0].blocks)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (names, payload))
    return agree_profile(gathered, dist.get_rank())


def _refuse_fully_sharded(pl_module: pl.LightningModule, reason: str) -> None:
    """Refuse a module FSDP2's ``fully_shard`` has wrapped (Lightning's ``ModelParallelStrategy`` in
    ``configure_model``), before the first managed step fails inside FSDP2 with no word of DeltaMemory."""
    try:
        from torch.distributed.fsdp import FSDPModule  # lazy: torch.distributed, present on builds with FSDP2
    except ImportError:
        return
    wrapped = [name or type(pl_module).__name__ for name, module in pl_module.named_modules()
               if isinstance(module, FSDPModule)]
    if wrapped:
        raise ValueError(f"DeltaMemory cannot manage a module FSDP2 shards ({wrapped[0]} and {len(wrapped) - 1} more "
                         f"are fully_shard-ed): {reason}. Train with DDPStrategy, or merak3d with "
                         "data_parallel_sharding none, optimizer or gradients, or without DeltaMemory")
