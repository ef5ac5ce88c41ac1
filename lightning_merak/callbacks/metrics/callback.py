"""``TrainingMetrics``: throughput, step time, MFU, gradient norm and memory, on any strategy.

Every ``trainer.log_every_n_steps`` optimizer steps, and once more for the steps left when training ends
(so a run shorter than the interval logs too), every rank contributes its counts to one small
``all_gather`` and global rank 0 writes the interval's figures to each logger, saving the loggers at the
end. Lightning's ``Throughput`` rates need a full window of updates, which a run shorter than the window
never fills, and its ``ThroughputMonitor`` logs only from rank 0's batches; the rates here are over the
interval, with every data-parallel replica's batches counted.

A batch's tokens are its real ones: a :class:`~lightning_merak.parallel.micro_batching.VariableBatch`'s sample
lengths, or the ones of an ``attention_mask`` where the batch (a dict) has one; every position otherwise (labels
of ``-100`` only keep a position out of the loss: the model still computes it). The model FLOPs of a sample are
those of its own length.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.tensor import DTensor

from lightning_merak.callbacks.metrics.device import DATASHEET_PEAK, PeakFlops, compute_dtype, peak_flops, read_memory
from lightning_merak.callbacks.metrics.figures import log_figure, memory_figure
from lightning_merak.callbacks.metrics.steps import logged_step, logs_at
from lightning_merak.callbacks.nonfinite import NonFiniteGuard, SkippedStep
from lightning_merak.distributed.gradient_norm import ShardedGradients, installed_sharded_gradients
from lightning_merak.parallel.micro_batching import VariableBatch
from lightning_merak.planning.flops import frozen_weight_fraction, training_flops_per_token, transformer_shape

__all__ = ["TrainingMetrics"]

MEMORY_FIGURE = "memory/over_steps"
_COUNTS = ("tokens", "samples", "model_flops", "peak_mib", "current_mib", "stage_busy_s", "pipeline_step_s")


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = [value["input_ids"]] if "input_ids" in value else list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _sample_lengths(batch: Any) -> Optional[torch.Tensor]:
    """Each sample's real token count where the batch tells it: a global :class:`VariableBatch`'s lengths, or the
    ones of a dict batch's ``[samples, positions]`` ``attention_mask`` (padding left out)."""
    if isinstance(batch, VariableBatch):
        return batch.lengths
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return (mask != 0).sum(dim=-1)
    return None


def _total_squares(grads: list[torch.Tensor]) -> float:
    """The squared 2-norm of ``grads``, plain tensors and DTensor shards mixed (tensor parallelism alone shards
    some): the plain ones' and each mesh's DTensors' reduced to a full one, summed."""
    plain = [grad for grad in grads if not isinstance(grad, DTensor)]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            by_mesh.setdefault(grad.device_mesh, []).append(grad)
    squares = float(torch.nn.utils.get_total_norm(plain, norm_type=2.0)) ** 2 if plain else 0.0
    for sharded in by_mesh.values():  # the same meshes in the same order on every rank: the reductions match
        squares += float(torch.nn.utils.get_total_norm(sharded, norm_type=2.0).full_tensor()) ** 2
    return squares


def _gradient_norm(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Optional[float]:
    """The total norm of ``pl_module``'s gradients, or ``None`` without gradients: parameters of which each rank
    holds another part (EmbRace's column shards, expert parallelism's experts under Lightning's DDP) counted as the
    clipping counts them, their squares summed over their groups (a collective); a sparse gradient (an embedding
    built with ``sparse=True``) counts its coalesced values."""
    shards = installed_sharded_gradients(trainer.strategy.precision_plugin) or ShardedGradients()
    replicated: list[torch.Tensor] = []
    sharded: dict[int, list[torch.Tensor]] = {}
    for param in pl_module.parameters():
        if param.grad is None:
            continue
        grad = param.grad.coalesce().values() if param.grad.is_sparse else param.grad
        index = shards.group_index(param)
        (replicated if index is None else sharded.setdefault(index, [])).append(grad)
    if not shards:
        return math.sqrt(_total_squares(replicated)) if replicated else None
    return math.sqrt(_total_squares(replicated) + float(shards.squares(sharded, pl_module.device)))


def _clipping_keeps_norm(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether this step's gradient clipping computes the total norm before clipping and keeps it
    (``strategy.last_gradient_norm``, merak3d's): clipping by norm through Lightning's own hook."""
    clip = trainer.gradient_clip_val
    return (hasattr(trainer.strategy, "last_gradient_norm") and clip is not None and float(clip) > 0
            and trainer.gradient_clip_algorithm in (None, "norm")
            and type(pl_module).configure_gradient_clipping is pl.LightningModule.configure_gradient_clipping)


class TrainingMetrics(pl.Callback):
    """Logs, per interval of ``trainer.log_every_n_steps`` optimizer steps:

    - ``perf/step_time_s``: wall time per optimizer step (validation and checkpoint saving excluded: every
      ``trainer.save_checkpoint``, which each checkpoint callback and merak3d's sharded save go through);
    - ``perf/tokens_per_s``, ``perf/samples_per_s``: over every data-parallel replica (real tokens: see above);
    - ``perf/mfu`` (over a datasheet peak: known CUDA devices) or ``perf/mfu_measured_peak`` (over a measured
      matmul: CPUs and other devices), with ``perf/peak_tflops`` it divides by and ``perf/model_tflops_per_s``:
      model FLOPs (:mod:`lightning_merak.planning.flops`, from ``pl_module.model.config``, frozen weights' gradients
      left out: :func:`~lightning_merak.planning.flops.frozen_weight_fraction` at the start of training) per
      second over all ranks;
    - ``train/grad_norm``: the total gradient norm before clipping, over every shard, on the steps that are
      logged only. A strategy with a ``gradient_norm(optimizer)`` (merak3d: over every stage, shard and expert)
      computes it (or its clipping by norm, which keeps the norm it computed: then it is read, not computed
      twice); otherwise it is the norm of the gradients Lightning hands to the optimizer (DTensor shards
      gathered, plain gradients beside them; EmbRace's column shards and expert parallelism's experts under DDP
      summed over their groups, as the clipping sums them). A step :class:`~lightning_merak.callbacks.nonfinite.
      NonFiniteGuard` skipped logs the non-finite norm its gradients had (NaN or infinity), with or without
      clipping. Left out of a log whose step computed none (a run stopped between intervals, a step skipped for
      its loss alone);
    - ``comm/exposed_s``, ``comm/exposed_fraction`` (rank 0; a strategy with ``last_exposed_communication_s``,
      merak3d with data parallelism reduced by its own buckets: ``data_parallel_sharding`` other than ``full``,
      whose FSDP2 reduces in its own hooks): the wait for the gradient reduction after backward, per step and as a
      share of the step;
    - ``perf/pipeline_bubble`` (a strategy with ``last_pipeline_step_times``, merak3d with pipeline stages): in the
      interval's last step, the share of the schedule's time the stages did not compute, over every rank
      (one minus the summed chunk compute over the summed schedule time: waits for neighbour stages, inside a
      chunk too, and the transfers they did not hide);
    - ``memory/peak_MiB/max`` and, for up to ``ranks_per_rank_metrics`` ranks, ``memory/peak_MiB/rank<r>``: each
      rank's high-water mark (CUDA: allocated tensors; CPU: the process's resident set).

    Intervals end, and values are logged, at Lightning's steps (:mod:`~.steps`): the rows of ``train/loss`` and the
    learning rate of the same optimizer step. A run whose last step is no logging step (shorter than
    ``log_every_n_steps``, or stopped between intervals) has that step's values logged at its end: the last interval's
    and the module's own training values Lightning holds for it but did not write (``trainer.logged_metrics`` but
    validation's and epoch aggregates), so every run's files hold its ``train/loss``. At the end a memory-over-steps
    figure goes to the loggers (:func:`~.figures.log_figure`).

    ``batch_size_fn(batch)`` and ``length_fn(batch)`` count a batch's samples and tokens (default: the sample
    lengths a batch tells, see above, else the first dimension and the element count of the module's inputs,
    ``pl_module.split_batch(batch)[0]`` where it has one, else the batch's first tensor; with ``length_fn`` the
    FLOPs are its tokens' at the batch's width). ``flops_per_token(seq_len)`` gives the training FLOPs of a
    token for a model whose config :func:`~lightning_merak.planning.flops.transformer_shape` does not know.
    """

    def __init__(self, batch_size_fn: Optional[Callable[[Any], int]] = None,
                 length_fn: Optional[Callable[[Any], int]] = None,
                 flops_per_token: Optional[Callable[[int], float]] = None, ranks_per_rank_metrics: int = 16) -> None:
        for name, value in (("batch_size_fn", batch_size_fn), ("length_fn", length_fn),
                            ("flops_per_token", flops_per_token)):
            if value is not None and not callable(value):
                raise TypeError(f"TrainingMetrics({name}=...) takes a function, got {type(value).__name__}")
        if (not isinstance(ranks_per_rank_metrics, int) or isinstance(ranks_per_rank_metrics, bool)
                or ranks_per_rank_metrics < 0):
            raise ValueError(f"ranks_per_rank_metrics={ranks_per_rank_metrics!r} must be an integer >= 0 (how many "
                             "ranks get memory/peak_MiB/rank<r>)")
        self.batch_size_fn, self.length_fn = batch_size_fn, length_fn
        self.flops_per_token = flops_per_token
        self._flops_fn = flops_per_token
        self.ranks_per_rank_metrics = ranks_per_rank_metrics
        self.peak: Optional[PeakFlops] = None
        self.history: dict[str, list[Any]] = {"step": [], "peak_mib": [], "current_mib": []}
        """Rank 0's record of each logged interval: the step, and every rank's memory readings."""
        self._counts = dict.fromkeys(_COUNTS, 0.0)
        self._steps = 0
        self._last_global_step = self._first_global_step = 0
        self._interval_start: Optional[float] = None
        self._paused_at: Optional[float] = None
        self._pauses = 0
        self._unwrap_save: Optional[Callable[[], None]] = None
        self._step_logged_at = 0
        """The logged step (Lightning's) of the last optimizer step."""
        self._grad_norm: Optional[tuple[int, float]] = None
        """``(optimizer step, norm)``: logged only with that step, never with a later one."""
        self._norm_from_clipping = False
        self._exposed_s: list[float] = []
        """The strategy's exposed gradient-communication wait of each step of the interval (merak3d)."""
        self._validation_keys: set[str] = set()
        """Metric names validation produced (``val/loss``): logged by Lightning when it ran, never again here."""
        self._before_validation: set[str] = set()
        self._flops_by_length: dict[int, float] = {}

    # Hooks ---------------------------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        self.peak = peak_flops(device, compute_dtype(str(trainer.precision)))
        if self.flops_per_token is None:
            config = _model_config(getattr(pl_module, "model", None))
            try:
                if config is None:
                    raise ValueError(f"{type(pl_module).__name__}.model has no transformers config")
                shape, frozen = transformer_shape(config), frozen_weight_fraction(pl_module)
                self._flops_fn = lambda seq_len: training_flops_per_token(shape, seq_len, frozen)
            except ValueError as error:
                rank_zero_warn(f"TrainingMetrics logs no MFU: {error}")
        self._last_global_step = self._first_global_step = trainer.global_step
        self._interval_start = time.perf_counter()
        self._unwrap_save = _pause_while_saving(trainer, self._pause, self._resume)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pause()
        self._before_validation = set(trainer.callback_metrics)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resume()
        self._validation_keys |= set(trainer.callback_metrics) - self._before_validation

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._unwrap_save is not None:
            self._unwrap_save()
            self._unwrap_save = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Before clipping: the gradients' total norm, on a step that will be logged (every rank alike)."""
        if not self._logs_next_step(trainer):
            return
        if _clipping_keeps_norm(trainer, pl_module):
            self._norm_from_clipping = True  # clipping computes this norm right after this hook: read it then
            return
        step = trainer.global_step + 1
        strategy_norm = getattr(trainer.strategy, "gradient_norm", None)
        if callable(strategy_norm):
            self._grad_norm = (step, float(strategy_norm(optimizer)))
            return
        norm = _gradient_norm(trainer, pl_module)
        if norm is not None:
            self._grad_norm = (step, norm)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        samples, tokens, model_flops = self._batch_counts(pl_module, batch)
        share = _rank_share(trainer, batch)
        self._counts["samples"] += samples * share
        self._counts["tokens"] += tokens * share
        self._counts["model_flops"] += model_flops * share
        if trainer.global_step == self._last_global_step:
            return  # accumulating gradients: the optimizer step comes with a later batch
        self._last_global_step = trainer.global_step
        self._step_logged_at = logged_step(trainer, after_update=True)
        self._steps += 1
        skipped = _skipped_step(trainer)
        if skipped is not None:  # its gradients were dropped before clipping or this callback could read them
            self._grad_norm = None if skipped.gradient_norm is None else (trainer.global_step, skipped.gradient_norm)
        elif self._norm_from_clipping:
            self._grad_norm = (trainer.global_step, float(trainer.strategy.last_gradient_norm))
        self._norm_from_clipping = False
        exposed = getattr(trainer.strategy, "last_exposed_communication_s", None)
        if exposed is not None:
            self._exposed_s.append(float(exposed))
        if logs_at(self._step_logged_at, trainer.log_every_n_steps):
            self._log_interval(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log the steps since the last interval, the memory figure, and save every logger (all ranks call this:
        the interval's gather and ``trainer.log_dir`` are collective)."""
        if self._steps > 0:
            self._log_interval(trainer)
        if trainer.is_global_zero and trainer.global_step > self._first_global_step \
                and not logs_at(self._step_logged_at, trainer.log_every_n_steps):
            self._log_unwritten_training_values(trainer)
        if not trainer.loggers or not self.history["step"]:
            return
        if trainer.is_global_zero:
            ranks = range(len(self.history["peak_mib"][0]))
            shown = list(ranks)[:max(self.ranks_per_rank_metrics, 1)]
            figure = memory_figure(self.history["step"],
                                   {r: [row[r] for row in self.history["peak_mib"]] for r in shown},
                                   {r: [row[r] for row in self.history["current_mib"]] for r in shown},
                                   "CUDA allocated" if trainer.strategy.root_device.type == "cuda" else "host RSS")
            log_figure(trainer, MEMORY_FIGURE, figure, self.history["step"][-1])
            for logger in trainer.loggers:
                logger.save()

    # Helpers -------------------------------------------------------------------------------------------

    def _log_unwritten_training_values(self, trainer: pl.Trainer) -> None:
        """The module's training values of the last step, which Lightning holds but wrote to no logger (the step
        was no logging step): logged once, at that step."""
        values = {name: value for name, value in trainer.logged_metrics.items()
                  if name not in self._validation_keys and name != "epoch" and not name.endswith("_epoch")}
        if values:
            for logger in trainer.loggers:
                logger.log_metrics({name: float(value) for name, value in values.items()}, step=self._step_logged_at)

    def _pause(self) -> None:
        """Stop the interval's clock (validation, a checkpoint save; nested pauses count once)."""
        self._pauses += 1
        if self._pauses == 1 and self._interval_start is not None:
            self._paused_at = time.perf_counter()

    def _resume(self) -> None:
        """Restart the interval's clock, the paused time left out of the interval."""
        self._pauses = max(self._pauses - 1, 0)
        if self._pauses == 0 and self._paused_at is not None and self._interval_start is not None:
            self._interval_start += time.perf_counter() - self._paused_at
            self._paused_at = None

    def _logs_next_step(self, trainer: pl.Trainer) -> bool:
        """Whether the optimizer step under way ends an interval or the run (the same on every rank)."""
        if logs_at(logged_step(trainer, after_update=False), trainer.log_every_n_steps):
            return True
        if 0 < trainer.max_steps <= trainer.global_step + 1:
            return True
        progress = trainer.fit_loop.epoch_loop.batch_progress
        max_epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else math.inf
        return bool(progress.is_last_batch) and trainer.current_epoch + 1 >= max_epochs

    def _batch_counts(self, pl_module: pl.LightningModule, batch: Any) -> tuple[int, int, float]:
        """``(samples, tokens, model FLOPs)`` of ``batch``: its real tokens, each sample's FLOPs at its length."""
        lengths = _sample_lengths(batch)
        if lengths is not None:  # a VariableBatch's probe block (what split_batch sees) is no sample's length
            width = int(lengths.max()) if lengths.numel() else 0
            samples, tokens = int(lengths.numel()), int(lengths.sum())
        else:
            split = getattr(pl_module, "split_batch", None)
            inputs = _first_tensor(split(batch)[0] if callable(split) else batch)
            width = int(inputs.shape[-1]) if inputs is not None and inputs.dim() > 1 else 0
            samples = int(inputs.shape[0]) if inputs is not None and inputs.dim() > 0 else 1
            tokens = int(inputs.numel()) if inputs is not None else samples
        if self.batch_size_fn is not None:
            samples = int(self.batch_size_fn(batch))
        if self.length_fn is not None:
            tokens = int(self.length_fn(batch))
            return samples, tokens, self._flops_at(width) * tokens
        if lengths is None:
            return samples, tokens, self._flops_at(width) * tokens
        per_length = Counter(int(length) for length in lengths.tolist())
        return samples, tokens, sum(self._flops_at(length) * length * count for length, count in per_length.items())

    def _flops_at(self, seq_len: int) -> float:
        """Training FLOPs of one token in a sequence of ``seq_len`` (0 without a FLOP count or a sequence)."""
        if self._flops_fn is None or seq_len < 1:
            return 0.0
        if seq_len not in self._flops_by_length:
            self._flops_by_length[seq_len] = float(self._flops_fn(seq_len))
        return self._flops_by_length[seq_len]

    def _gathered(self, trainer: pl.Trainer) -> torch.Tensor:
        """Every rank's counts and memory, one row per rank (one ``all_gather``)."""
        reading = read_memory(trainer.strategy.root_device)
        self._counts["peak_mib"], self._counts["current_mib"] = reading.peak_mib, reading.current_mib
        pipeline = getattr(trainer.strategy, "last_pipeline_step_times", None)
        if pipeline is not None:
            self._counts["stage_busy_s"], self._counts["pipeline_step_s"] = pipeline
        local = torch.tensor([self._counts[key] for key in _COUNTS], dtype=torch.float64)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return local.unsqueeze(0)
        device = trainer.strategy.root_device
        rows = [torch.empty_like(local, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local.to(device))
        return torch.stack(rows).cpu()

    def _log_interval(self, trainer: pl.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        now = time.perf_counter()
        elapsed = now - (self._interval_start if self._interval_start is not None else now)
        steps = self._steps
        rows = self._gathered(trainer)
        self._counts = dict.fromkeys(_COUNTS, 0.0)
        self._steps, self._interval_start = 0, now
        exposed, self._exposed_s = self._exposed_s, []
        if not trainer.is_global_zero:
            return
        world = rows.shape[0]
        totals = {key: float(rows[:, i].sum()) for i, key in enumerate(_COUNTS[:3])}  # each rank counted its share
        metrics = {"perf/step_time_s": elapsed / steps}
        if elapsed > 0:
            metrics["perf/tokens_per_s"] = totals["tokens"] / elapsed
            metrics["perf/samples_per_s"] = totals["samples"] / elapsed
            if totals["model_flops"] > 0 and self.peak is not None:
                achieved = totals["model_flops"] / elapsed
                name = "perf/mfu" if self.peak.source == DATASHEET_PEAK else "perf/mfu_measured_peak"
                metrics[name] = achieved / (self.peak.flops_per_s * world)
                metrics["perf/model_tflops_per_s"] = achieved / 1e12
                metrics["perf/peak_tflops"] = self.peak.flops_per_s / 1e12
        norm, self._grad_norm = self._grad_norm, None
        if norm is not None and norm[0] == trainer.global_step:
            metrics["train/grad_norm"] = norm[1]
        if exposed:
            metrics["comm/exposed_s"] = sum(exposed) / len(exposed)
            if metrics["perf/step_time_s"] > 0:
                metrics["comm/exposed_fraction"] = metrics["comm/exposed_s"] / metrics["perf/step_time_s"]
        busy, scheduled = float(rows[:, 5].sum()), float(rows[:, 6].sum())
        if scheduled > 0:
            metrics["perf/pipeline_bubble"] = max(0.0, 1.0 - busy / scheduled)
        peaks, currents = rows[:, 3].tolist(), rows[:, 4].tolist()
        metrics["memory/peak_MiB/max"] = max(peaks)
        if world <= self.ranks_per_rank_metrics:
            metrics.update({f"memory/peak_MiB/rank{rank}": peak for rank, peak in enumerate(peaks)})
        self.history["step"].append(self._step_logged_at)
        self.history["peak_mib"].append(peaks)
        self.history["current_mib"].append(currents)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self._step_logged_at)


def _skipped_step(trainer: pl.Trainer) -> Optional[SkippedStep]:
    """The optimizer step just taken, where a :class:`NonFiniteGuard` of ``trainer`` skipped it."""
    for callback in getattr(trainer, "callbacks", ()):
        if isinstance(callback, NonFiniteGuard) and callback.last_skipped is not None \
                and callback.last_skipped.global_step == trainer.global_step:
            return callback.last_skipped
    return None


def _pause_while_saving(trainer: pl.Trainer, pause: Callable[[], None],
                        resume: Callable[[], None]) -> Callable[[], None]:
    """Have ``trainer.save_checkpoint`` pause the interval's clock while it runs; returns what undoes it.

    Every checkpoint of a run goes through it (Lightning's checkpoint callbacks, a user's call, merak3d's sharded
    save inside it), and none of its hooks ends after the write: the write is only timed from outside."""
    save = getattr(trainer, "save_checkpoint", None)
    if save is None:  # a stand-in for a trainer, which saves nothing
        return lambda: None

    @functools.wraps(save)
    def timed_save(*args: Any, **kwargs: Any) -> Any:
        pause()
        try:
            return save(*args, **kwargs)
        finally:
            resume()

    trainer.save_checkpoint = timed_save  # type: ignore[method-assign]

    def unwrap() -> None:
        if vars(trainer).get("save_checkpoint") is timed_save:  # else wrapped again since: left to its wrapper
            del trainer.save_checkpoint

    return unwrap


def _rank_share(trainer: pl.Trainer, batch: Any) -> float:
    """The part of ``batch``'s counts this rank stands for, so that the ranks' parts sum to what the step trained:
    every rank reads a global :class:`VariableBatch` whole; otherwise each replica's ranks read one batch."""
    world = max(int(trainer.world_size), 1)
    if isinstance(batch, VariableBatch):
        return 1.0 / world
    sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(sampler.get("num_replicas", world)) / world


def _model_config(model: Any) -> Any:
    """The transformers config of ``model``, or of the model it was cut from: once merak3d has built its layout
    (on the first batch, which may be a sanity-check one, before training starts) a pipelined module's ``model``
    is its rank's stages, each holding a pruned copy of the model, config included, under ``net``."""
    config = getattr(model, "config", None)
    if config is not None or not isinstance(model, torch.nn.Module):
        return config
    return next((stage.net.config for stage in model.children()
                 if getattr(getattr(stage, "net", None), "config", None) is not None), None)
