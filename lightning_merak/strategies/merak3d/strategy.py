"""``Merak3DStrategy``: the hooks Lightning calls, each handing its work to the module that owns it.

In the order a run meets them: the constructor checks the arguments (:mod:`.arguments`);
``setup_environment`` starts the processes and adopts the layout the arguments fix
(:mod:`lightning_merak.parallel.layout`), or ``setup`` the one the planner chooses (:mod:`.planning`); the first
batch builds it (:mod:`.build`); pipelined steps run the schedule (:mod:`.pipeline_step`); ``backward``
synchronises and clipping clips the gradients (:mod:`lightning_merak.parallel.data.gradients`); checkpoints are
sharded (:mod:`.checkpoint_hooks`, :mod:`lightning_merak.checkpoint.sharded`). What callbacks and the CLI read
of the layout, and the checks before launch, are :mod:`.layout_queries`.
"""

from __future__ import annotations

import time
import weakref
from datetime import timedelta
from typing import Any, ContextManager, Iterable, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import nn

from lightning_merak.callbacks.agreed_stop import add_agreed_sigterm_stop
from lightning_merak.checkpoint.sharded import ShardedCheckpointer
from lightning_merak.distributed import host_memory, process_groups
from lightning_merak.distributed.collectives import reduce_in_place
from lightning_merak.distributed.gradient_norm import ShardedGradients
from lightning_merak.distributed.process_exit import leave_process_groups_at_exit
from lightning_merak.distributed.termination import install_termination_handler
from lightning_merak.parallel.context.stages import install_context_parallel_layout
from lightning_merak.parallel.data import buckets as data_parallel
from lightning_merak.parallel.data import fully_sharded, gradients
from lightning_merak.parallel.data.agreed_overflow import agree_on_overflow
from lightning_merak.parallel.layout import Layout, LayoutGroups
from lightning_merak.parallel.materialize import has_meta, meta_device
from lightning_merak.parallel.tensor.layers import shared_row_weights
from lightning_merak.planning.planner.step_check import BatchClock, StepTimeCheck
from lightning_merak.strategies.merak3d import arguments, build, network, planning, rebuilt_optimizers, trainer_checks
from lightning_merak.strategies.merak3d.arguments import Degree
from lightning_merak.strategies.merak3d.checkpoint_hooks import CheckpointHooks
from lightning_merak.strategies.merak3d.context_step import ContextRoundsStep, install_step
from lightning_merak.strategies.merak3d.layout_queries import LayoutQueries
from lightning_merak.strategies.merak3d.replica_group import batch_replica_group
from lightning_merak.strategies.merak3d.step_replay import ReplayedStep, names_logged
from lightning_merak.strategies.merak3d.variable_step import PipelineSteps, check_micro_batching
from lightning_merak.util.buffers import ReplicaBuffers, buffers_kept

__all__ = ["Merak3DStrategy"]


class Merak3DStrategy(LayoutQueries, CheckpointHooks):
    """Automated 3D parallelism: ``data_parallel × pipeline_parallel × tensor_parallel`` ranks.

    When ``pipeline_parallel``, ``tensor_parallel``, ``tp_overlap`` or ``recompute`` is
    ``"auto"``, the layout planner profiles this machine and model at setup (one batch of the
    training dataloader gives the shapes) and picks the layout with the least predicted time
    per sample that fits ``memory_limit``; it logs its choice, the runner-up and the predicted
    step time (``layout_plan`` keeps the whole ranking, ``layout_choice`` the chosen layout's
    prediction, within the degrees fixed by the user). ``plan_only=True`` stops after that. ``memory_limit`` bounds
    that search only: with nothing to plan it is not applied, and rank 0 warns so once.

    Every argument, its default and what it does: :class:`~lightning_merak.strategies.merak3d.options.Merak3DOptions`
    (the signature below repeats it, in order) and ``docs/reference/cli.md`` (``merak-train strategy.<argument>=``).
    It trains any LightningModule DDP trains, its steps as written; what it reads of it (nothing is required
    without pipeline stages) is stated in :mod:`lightning_merak.protocols.module_contract`.
    """

    strategy_name = "merak3d"

    def __init__(
        self,
        data_parallel: Degree = "auto", pipeline_parallel: Degree = 1,
        tensor_parallel: Degree = 1, tp_overlap: Degree = 1,
        tp_weight_grad_overlap: Optional[bool] = None, sequence_parallel: bool = False,
        context_parallel: Degree = 1, context_attention: str = "auto", context_parallel_degree: str = "fixed",
        micro_batches: Optional[int] = None, schedule: str = "1f1b",
        virtual_stages: int = 2, recompute: str = "none",
        recompute_ratio: float = 0.5, compile: bool = False, float8: Optional[str] = None,
        partition: str = "autopipe",
        process_group_backend: Optional[str] = None,
        timeout_s: float = 600.0,
        memory_limit: Optional[float] = None,
        plan_only: bool = False,
        planner_calibration: str = "analytic",
        vocab_parallel: bool = True, vocab_stages: str = "off",
        compact_host_memory: bool = False,
        data_parallel_sharding: str = "none",
        data_parallel_shard_size: Optional[int] = None,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: Optional[bool] = None,
        grad_bucket_mb: Optional[float] = None,
        micro_batching: str = "none", micro_batch_tokens: Optional[int] = None, micro_batching_cost: Any = None,
    ) -> None:
        super().__init__()
        given = locals()
        self._arguments, self.micro_batching = arguments.checked_arguments(given)  # read by data.lengths=variable
        self._groups: Optional[LayoutGroups] = None
        """The layout, once decided, and its device mesh: the one place a degree lives."""
        self._replica_group: Optional[dist.ProcessGroup] = None
        """The ranks holding different samples, which logging sums over (:mod:`.replica_group`); all before the
        layout exists."""
        self.layout_plan: Optional[Any] = None
        self.layout_choice: Optional[Any] = None
        """The planner's prediction for the layout this run adopted (a ``planner.Prediction``)."""
        self.step_time_check: Optional[StepTimeCheck] = None
        """A planned run's measured step next to its prediction, once its first batches ran."""
        self._verified_tp_degrees: frozenset[int] = frozenset()
        """Tensor-parallel degrees whose split was already checked against the whole block (while planning)."""
        self._batch_clock: Optional[BatchClock] = None
        self.last_gradient_norm: Optional[float] = None
        """Total gradient norm (all stages, shards and experts) before the last clipping."""
        self._reading_planning_batch = False
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(seconds=timeout_s)
        self._built: Optional[build.BuiltModel] = None
        self._built_in_evaluation = False
        self._pipeline: Optional[Union[PipelineSteps, ContextRoundsStep]] = None
        self._view: Optional[network.ModuleView] = None
        """The LightningModule as merak3d trains it: where its network lives, what it provides of the contract."""
        self._checkpointer = ShardedCheckpointer(self._expert_placement)
        self._pending_optimizer_states: list[dict[str, Any]] = []
        self._configured_optimizers: rebuilt_optimizers.HyperParameters = []
        """What ``configure_optimizers`` set at setup, to tell what callbacks changed before the build."""
        self._restored_state: Optional[dict[str, Any]] = None
        self._sharded_gradients = ShardedGradients()
        self._data_parallel: Optional[data_parallel.DataParallelGradients] = None
        """The replicated parameters' gradient buckets, reduced over the replicas, and ZeRO's shards (dp > 1)."""
        self._fully_sharded: Optional[fully_sharded.FullySharded] = None
        """FSDP2's modules with ``data_parallel_sharding="full"`` (they reduce their gradients themselves)."""
        self._row_shares: dict[int, torch.Tensor] = {}
        """1 / copies of each local row of split parameters whose rows several ranks hold, set by the build."""
        self._replica_buffers = ReplicaBuffers()  # the buffers training changes, equal over the replicas as DDP keeps
        self.partition: Optional[Any] = None
        self.num_nodes = 1

    # Layout -------------------------------------------------------------------------------

    def _adopt(self, layout: Layout) -> None:
        """Build the device mesh of ``layout`` (every rank at once) and announce it."""
        self._groups = LayoutGroups.create(layout, self.root_device.type)
        self._replica_group = batch_replica_group(self._groups)
        rank_zero_info(f"merak3d: {layout.describe(self.sequence_parallel)}")

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
        return {"num_replicas": self.data_parallel, "rank": self.groups.batch_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
            host_memory.export_heap_tunables()  # the ranks it starts keep freed host memory reusable

    def setup_environment(self) -> None:
        # before the rendezvous, so a rank waiting for its peers also ends on SIGTERM/SIGINT
        install_termination_handler()
        host_memory.prepare_heap(compact=self._arguments.compact_host_memory,
                                 tensors_on_host=self.root_device.type == "cpu")
        super().setup_environment()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        backend, options = process_groups.process_group_setup(self._process_group_backend, self.root_device)
        self._process_group_backend = backend  # on NCCL the options bind every group to this rank's GPU
        reset_seed()  # as Lightning's DDP does: the generators start training where DDP's do (dropout included)
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, **options)
        # a layout built by an earlier validate/predict keeps its mesh: its shards and groups live on it
        if self._groups is None and not self._arguments.needs_planning:
            if self._arguments.memory_limit is not None:  # as sequence_parallel at tp=1: legal, announced
                rank_zero_warn(f"merak3d: memory_limit={self._arguments.memory_limit:g} bounds the layout planner's "
                               "search, and no part of this layout is 'auto', so nothing is planned and the limit "
                               "is not applied; set a degree to 'auto' or leave memory_limit unset")
            self._adopt(self._arguments.layout(self.world_size))

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.adopt_planned_layout(trainer)  # finds the module's network first when it plans
        self._check_trainer(trainer)
        if self._built is None:  # a layout built by an earlier validate or predict holds only its part
            self._view = network.module_view(module, self.pipeline_parallel, self.tensor_parallel)
            check_micro_batching(self.micro_batching, self.pipeline_parallel, self._view)
            self._arguments.check_model(self._view.network, self.pipeline_parallel, self.tensor_parallel)
            self.precision_plugin.convert_module(module)  # bf16-true: weights in bf16 (on meta too)
        self.model_to_device()
        if self._built is None and not has_meta(module):  # built or meta: ranks' parts start equal when built
            for tensor in [*gradients.replicated_parameters(module), *gradients.replicated_buffers(module)]:
                dist.broadcast(tensor.data, src=0)
        if trainer.state.fn == TrainerFn.FITTING:
            add_agreed_sigterm_stop(trainer)  # SIGTERM stops every rank at one step, with no collective in a handler
            self.setup_optimizers(trainer)
            self._configured_optimizers = rebuilt_optimizers.hyperparameters(self.optimizers)
            data_parallel.check_sharding(self.layout, self.optimizers, self.precision_plugin, trainer.callbacks)
            if self._built is not None:  # built by an earlier validate, predict or fit: these optimizers are new
                self._shard_optimizers()
        self.setup_precision_plugin()

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        """Refuse the Trainer's options and callbacks this layout cannot honour; warn of ``micro_batches`` that split
        nothing (:mod:`.trainer_checks`)."""
        layout, fitting = self.layout, trainer.state.fn == TrainerFn.FITTING
        arguments.check_accumulation(trainer.accumulate_grad_batches, fitting=fitting,
                                     pipeline_parallel=layout.pipeline_parallel, tp_overlap=layout.tp_overlap)
        if fitting:
            trainer_checks.check_weight_averaging(layout, trainer.callbacks)
        warning = trainer_checks.unsplit_micro_batches_warning(layout, self.micro_batching.enabled,
                                                               self._arguments.context_parallel_degree)
        if warning is not None:
            rank_zero_warn(warning)

    def setup_precision_plugin(self) -> None:
        """Lightning's, then clipping over every stage and shard (:meth:`_clip_grad_by_norm`, ``clip_by_value``), and a
        loss scaler's overflow agreed over every rank (:func:`.agree_on_overflow`)."""
        super().setup_precision_plugin()
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        self.precision_plugin.clip_grad_by_value = gradients.clip_by_value
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and self.world_size > 1:  # experts, EmbRace's columns: ranks hold different gradients
            agree_on_overflow(scaler)

    @property
    def module_view(self) -> network.ModuleView:
        """The LightningModule as merak3d trains it; found in ``setup``, or when a checkpoint is restored before."""
        if self._view is None:
            self._view = network.module_view(self.lightning_module, *self._arguments.launch_degrees(self.world_size))
        return self._view

    def model_to_device(self) -> None:
        assert self.model is not None
        if not has_meta(self.model):  # a meta model gets storage on the device part by part when built
            self.model.to(self.root_device)

    def tensor_init_context(self, empty_init: Optional[bool] = None) -> ContextManager[None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device; each rank materialises its part."""
        return meta_device(self.precision_plugin) if empty_init else super().tensor_init_context(empty_init)

    def model_sharded_context(self) -> ContextManager[None]:
        """``LightningModule.configure_model()`` builds on the meta device, as ``init_module(empty_init=True)``."""
        return meta_device()

    def barrier(self, name: Optional[str] = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    @property
    def batch_replica_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks that hold different samples (:mod:`.replica_group`), which ``self.log(..., sync_dist=True)`` and
        ``self.all_gather`` reduce over; a torchmetrics ``Metric``'s ``process_group`` for the same (None: every
        rank, before the layout exists)."""
        return self._replica_group

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Reduce a tensor (``self.log(..., sync_dist=True)``) in place (:func:`.reduce_in_place`) over ``group``, by
        default over the batch's replicas: a sum counts each sample once, as one process does."""
        return reduce_in_place(tensor, self._replica_group if group is None else group, reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """``LightningModule.all_gather``: over the batch's replicas, one entry per replica's samples, for its
        default group too (it passes the world's: ``torch.distributed.all_gather`` gathers over every rank)."""
        default = group is None or group is dist.group.WORLD
        return super().all_gather(tensor, self._replica_group if default else group, sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Over every rank, not the replicas: stopping or saving must be one decision, or the ranks that go on
        wait forever in a collective of those that stopped."""
        count = reduce_in_place(torch.tensor(int(decision), device=self.root_device), dist.group.WORLD, "sum")
        return bool(count == self.world_size) if all else bool(count)

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        trainer = getattr(self.lightning_module, "_trainer", None)  # None when no Trainer ran it
        leave_process_groups_at_exit(ended_well=trainer is not None and trainer.state.status == TrainerStatus.RUNNING)
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # Planning --------------------------------------------------------------------------

    def adopt_planned_layout(self, trainer: pl.Trainer, *, merak_ep: bool = False, ep_size: int | None = None) -> None:
        """Plan what is left on one batch and build its mesh (all ranks at once), once: from ``setup``, or first from
        merak_ep's expert groups (their ranks follow the chosen dp), pricing their exchange over ``ep_size`` ranks.
        ``plan_only`` stops the run here, whether anything was left to plan or every degree was given."""
        if not self.needs_planning:
            if self.plan_only:
                trainer.should_stop, trainer.num_sanity_val_steps = True, 0
            return
        degrees = self._arguments.launch_degrees(self.world_size)
        view = self._view = network.module_view(self.lightning_module, *degrees)
        self._arguments.check_model(view.network, *degrees)
        batch, global_batch = planning.planning_batch(self._planning_batch(trainer))
        with buffers_kept(view.network):  # the profile's forwards are no training batches (running statistics)
            planned = planning.plan_layout(
                self._arguments, view, view.split_batch(batch)[0], view.planning_loss(batch),
                world_size=self.world_size, num_processes=self.num_processes, device=self.root_device,
                optimizer=self.optimizers[0] if self.optimizers else None,
                clip_gradients=bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm in (None, "norm"),
                broadcast=self.broadcast, merak_ep=merak_ep, ep_size=ep_size, global_batch=global_batch)
        self.layout_plan, self.layout_choice = planned.plan, planned.choice
        self._verified_tp_degrees = planned.verified_tp_degrees
        self._adopt(planned.layout)
        if self.plan_only:
            trainer.should_stop, trainer.num_sanity_val_steps = True, 0

    def _planning_batch(self, trainer: pl.Trainer) -> Any:
        """One training batch, on the device, for the planner to profile at the real shapes (the layout, and so the
        data-parallel rank, does not exist yet: a dataloader built now sees one replica)."""
        self._reading_planning_batch = True
        try:
            return super().batch_to_device(planning.first_training_batch(trainer))
        finally:
            self._reading_planning_batch = False

    def on_train_start(self) -> None:
        """Before any step: refuse a last batch the layout cannot split; train modules built in an evaluation loop."""
        trainer = self.lightning_module.trainer
        if not self.micro_batching.enabled:  # variable-length micro-batching plans any batch's micro-batches
            arguments.check_last_batch(trainer.train_dataloader, self.layout, trainer.num_training_batches,
                                       trainer.max_steps)
        if self._built is not None:
            self.module_view.network.train()
        if self.layout_choice is not None and self.step_time_check is None:
            # read from the package, where tests shorten the check
            self._batch_clock = BatchClock(planning.STEP_CHECK_WARMUP, planning.STEP_CHECK_BATCHES)

    def on_validation_start(self) -> None:
        self.on_train_end()  # parameters gathered while the next forward would run are complete before evaluation
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:  # DDP's forward syncs buffers in a fit only
            self._replica_buffers.before_validation(self.lightning_module, self.groups.data_parallel_group)
        if self._batch_clock is not None:
            self._batch_clock.pause()

    def on_train_end(self) -> None:
        if self._data_parallel is not None:
            self._data_parallel.wait_for_parameters()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        clock = self._batch_clock
        if clock is None:
            return
        clock.batch_started(time.perf_counter())
        if clock.ready:
            self._batch_clock = None
            assert self.layout_choice is not None
            self.step_time_check = planning.check_step_time(clock, self.layout_choice, self.root_device,
                                                            self.lightning_module.trainer)

    # Building the layout on the first batch ----------------------------------------------

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self._built is None:
            # Evaluation loops bring their batch under no_grad or inference mode; the split check
            # needs a backward, and the parameters the build creates must not be inference tensors.
            with torch.inference_mode(False), torch.enable_grad(), build.random_state_kept():
                try:
                    self._build(batch)
                except StopIteration as error:  # raised in the data fetch, Lightning would end the epoch silently
                    raise RuntimeError("merak3d's layout build raised StopIteration, which the loop would take for "
                                       "the end of the data; see the traceback") from error
        return batch

    def _build(self, batch: Any) -> None:
        """Cut, split and wrap the model for this rank on the shapes of ``batch``, then hand it to Lightning."""
        module, view = self.lightning_module, self.module_view
        existing = weakref.WeakSet(module.modules())  # not keeping alive the whole layers a split replaces
        traced = self.pipeline_parallel > 1 or self.tensor_parallel > 1
        inputs = view.split_batch(batch)[0] if traced or view.contract else network.batch_inputs(batch)
        arguments.check_scored_length(module, inputs.shape[1] if isinstance(inputs, torch.Tensor) else None)
        self._checkpointer.find_experts(view.network)
        built = build.build_model(view.network, inputs, device=self.root_device,
                                  arguments=planning.planned_arguments(self._arguments, self.layout_choice),
                                  groups=self.groups, global_rank=self.global_rank, broadcast=self.broadcast,
                                  verified_tp_degrees=self._verified_tp_degrees, optimizers=self.optimizers,
                                  load_weights=build.weight_loader(module, self._restored_state, view.network,
                                                                   view.state_prefix))
        self._checkpointer.layout_changes, self.partition = built.layout_changes, built.partition
        if self.layout.context_parallel > 1:  # every forward (every stage's) runs on this rank's sequence shard
            install_context_parallel_layout(view.network, built.stages, self.groups, self.micro_batching.packs)
        self._pipeline = install_step(self._arguments.context_parallel_degree, self.micro_batching, view,
                                      built.stages, self.groups, self.root_device)
        if self._pipeline is None:  # a pipeline's schedule wraps the loss itself
            network.install_module_loss(view, self.groups)
        for part in module.modules():
            if part not in existing:  # stage wrappers and pruned containers join the loop's mode
                part.training = module.training
        self._row_shares = {id(param): share for param, share in shared_row_weights(module)}
        layout = self.layout
        if layout.data_parallel_sharding == "full" and layout.data_parallel > 1:  # before the optimizers see them
            self._fully_sharded, built = build.shard_built_model(
                view.network, built, self.groups, layout.data_parallel_shard_size, row_shared=bool(self._row_shares))
        self._built = built
        self._built_in_evaluation = not module.training
        trainer = module.trainer
        if trainer.state.fn == TrainerFn.FITTING:
            self._rebuild_optimizers(trainer)
            self.setup_precision_plugin()
            for optimizer, state in zip(self.optimizers, self._pending_optimizer_states):
                self._checkpointer.load_optimizer_state(optimizer, state, view.network)
            self._pending_optimizer_states = []
            self._shard_optimizers()

    def _rebuild_optimizers(self, trainer: pl.Trainer) -> None:
        """``configure_optimizers`` again, over the built parameters (:mod:`.rebuilt_optimizers`): in the optimizers
        and schedulers that Lightning and callbacks hold, with what callbacks set, where the groups correspond; else
        new ones, the schedulers' states (restored from a checkpoint) carried over, and a callback's change refused."""
        first, schedulers = self.optimizers, self.lr_scheduler_configs
        self._setup_optimizers_over_stages(trainer)
        if rebuilt_optimizers.group_counts_match(first, self.optimizers):
            rebuilt_optimizers.adopt_rebuilt(first, self.optimizers)
            self.optimizers, self.lr_scheduler_configs = first, schedulers
            return
        rebuilt_optimizers.refuse_changes(self._configured_optimizers, first,
                                          (len(schedulers), len(self.lr_scheduler_configs)))
        for config, old in zip(self.lr_scheduler_configs, schedulers):
            config.scheduler.load_state_dict(old.scheduler.state_dict())

    def _setup_optimizers_over_stages(self, trainer: pl.Trainer) -> None:
        """``setup_optimizers`` over this rank's part, refusing on every rank together (a rank alone would leave
        the others waiting in the step) an optimizer none of whose parameters some rank holds, which torch refuses."""
        try:
            self.setup_optimizers(trainer)
            empty = False
        except ValueError as error:
            if rebuilt_optimizers.EMPTY_OPTIMIZER not in str(error):
                raise
            empty = True
        if self.reduce_boolean_decision(empty, all=False):
            raise ValueError(rebuilt_optimizers.empty_optimizer_refusal(self.pipeline_parallel))

    def _shard_optimizers(self) -> None:
        """Bucketed gradient reduction (dp > 1); with a sharded mode each optimizer steps this rank's slices."""
        self._data_parallel = self._data_parallel or data_parallel.data_parallel_gradients(
            self.lightning_module, self._built, self.groups, self._arguments)
        if self._data_parallel is not None:
            self._data_parallel.attach(self.optimizers, self.precision_plugin, self._sharded_gradients)

    def on_validation_end(self) -> None:
        """A layout built in a fit's sanity check trains afterwards: Lightning restores the modes of the modules
        it saw before the loop, by name, and the build renamed and wrapped them (they would train in eval mode)."""
        if self._built_in_evaluation and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self.module_view.network.train()
        self._built_in_evaluation = False

    # Steps ------------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._replica_buffers.before_training_step(self.lightning_module, self.groups.data_parallel_group)
        pipelined_network = self._view.network.forward if self._pipeline is not None and self._view else None
        if isinstance(pipelined_network, network.PipelinedNetwork):  # its loss reads the step's batch and arguments
            pipelined_network.batch, pipelined_network.step_arguments = args[0], (args[1:], kwargs)
        if self._data_parallel is not None:  # a pipelined step runs its micro-batches' backward passes in here
            averaged_later = self._data_parallel.arm(self._pipeline.backward_passes(args[0]) if self._pipeline else 1)
            if self._pipeline is not None:
                self._pipeline.scaled_later = averaged_later
        module = self.lightning_module
        with self.precision_plugin.train_step_context():
            with names_logged(module, watched=isinstance(pipelined_network, network.PipelinedNetwork)) as outside:
                try:
                    return module.training_step(*args, **kwargs)
                except ReplayedStep as step:  # the loss was read from training_step, replayed per micro-batch
                    replayed = step
            replayed.logged.log_means(module, self.micro_batches, logged_outside=outside)
            return replayed.loss

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's order, the gradients synchronised before the ``on_after_backward`` hooks, which see them
        averaged over the replicas as under DDP (their collectives overlap the backward from the second step on).
        The first step synchronises after the hooks: a callback names there the parameters it reduces itself
        (``_ddp_params_and_buffers_to_ignore``), and no collective has started yet. Pipelined runs did their
        backward inside the schedule."""
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        if self._pipeline is None:
            self.precision_plugin.backward(closure_loss, self.lightning_module, optimizer, *args, **kwargs)
        else:
            self._pipeline.restore_gradients()
        names_pending = self._data_parallel is not None and not self._data_parallel.validated
        if not names_pending:
            self._synchronize_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        if names_pending:
            self._synchronize_gradients()
        self.post_backward(closure_loss)
        return closure_loss

    def _synchronize_gradients(self) -> None:
        """Sum the tensor-parallel and tied gradients and average the replicas' (:func:`.synchronize_gradients`),
        in buckets rebuilt first if the averaged parameters changed on the first step (:func:`.refreshed`)."""
        built, current = self._built, self._data_parallel
        if current is not None:  # a callback may take parameters out of the average on the first step
            self._data_parallel = data_parallel.refreshed(current, self.lightning_module, built, self.groups,
                                                          self._arguments, self.optimizers)
            if self._data_parallel is not current:
                self._sharded_gradients.remove(current.shard_parameters)
                self._shard_optimizers()
        gradients.synchronize_gradients(built.tensor_partial if built else [], built.tied if built else [],
                                        self.groups, self._data_parallel)

    def register_sharded_gradients(self, params: Iterable[nn.Parameter], group: Optional[dist.ProcessGroup]) -> None:
        """Count ``params``' gradients as parts of one whole split over ``group`` when clipping: each rank
        of it holds other columns, as EmbRace's tables do (``protocols.layout_aware.LayoutAwareStrategy``)."""
        self._sharded_gradients.register(params, group)

    def gradient_norm(self, optimizer: torch.optim.Optimizer) -> float:
        """The total norm of ``optimizer``'s gradients over every stage, shard and expert, as clipping sees it
        (:func:`~.gradients.total_norm`; a collective: every rank calls it)."""
        return gradients.total_norm(optimizer, self._counted_once(), self.groups, self.root_device,
                                    self._sharded_gradients, self._row_shares)

    def _counted_once(self) -> list[gradients.TiedParameter]:
        """The copies a gradient norm counts once: tied weights, and the parameters outside a pipelined network
        that every pipeline rank holds alike (counted on the first)."""
        tied = list(self._built.tied) if self._built is not None else []
        for param in getattr(self._pipeline, "outside_parameters", []):
            tied.append(gradients.TiedParameter(self.groups.pipeline_group, param, self.groups.pipeline_rank == 0))
        return tied

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
        """Clip by the norm over every stage and shard (:func:`~.gradients.clip_by_total_norm`)."""
        self.last_gradient_norm = gradients.clip_by_total_norm(
            optimizer, clip_val, self._counted_once(), self.groups, self.root_device, self._sharded_gradients,
            self._row_shares)
