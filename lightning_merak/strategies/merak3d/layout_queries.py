"""What callbacks, plugins and the CLI ask ``Merak3DStrategy`` of its layout: degrees, groups, the arguments no
planning changes, the built blocks and step measurements (the properties of
:class:`~lightning_merak.protocols.layout_aware.LayoutAwareStrategy` among them), and the checks run before launch.

They read what the hooks in :mod:`.strategy` decided and change nothing, so they live apart from the hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_merak.parallel.data.buckets import DataParallelGradients
from lightning_merak.parallel.data.sharding_checks import check_fully_sharded_callbacks, refuse_loss_scaling
from lightning_merak.parallel.layout import Layout, LayoutGroups
from lightning_merak.strategies.merak3d import build, network
from lightning_merak.strategies.merak3d.arguments import Degree, Merak3DArguments
from lightning_merak.strategies.merak3d.context_step import ContextRoundsStep
from lightning_merak.strategies.merak3d.tensor_degrees import check_tensor_parallel_search
from lightning_merak.strategies.merak3d.variable_step import PipelineSteps

__all__ = ["LayoutQueries"]


class LayoutQueries:
    """The layout once adopted (the arguments until then), as the rest of the package reads it.

    A mixin of ``Merak3DStrategy``, which sets ``_groups``, ``_arguments``, ``_built``, ``_pipeline`` and
    ``_data_parallel``.
    """

    _groups: Optional[LayoutGroups]
    _arguments: Merak3DArguments
    _built: Optional[build.BuiltModel]
    _pipeline: Optional[Union[PipelineSteps, ContextRoundsStep]]
    _data_parallel: Optional[DataParallelGradients]

    @property
    def groups(self) -> LayoutGroups:
        """The adopted layout and its device mesh, once processes have started (or the planner chose)."""
        if self._groups is None and self._arguments.needs_planning and dist.is_initialized():
            raise RuntimeError(
                f"merak3d plans its layout at setup (degrees {self._arguments.degrees}): nothing can read its device "
                "mesh or groups before that; set every 'auto' of pipeline_parallel, tensor_parallel, tp_overlap, "
                "recompute, data_parallel_sharding and context_parallel to a value to have them from the start")
        if self._groups is None:
            raise RuntimeError("the device mesh exists once processes have started (setup_environment)")
        return self._groups

    @property
    def layout(self) -> Layout:
        return self.groups.layout

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.groups.mesh

    @property
    def data_parallel(self) -> int:  # replicas that see different samples: a context-parallel group counts once
        return self.layout.batch_replicas

    @property
    def pipeline_parallel(self) -> int:
        return self.layout.pipeline_parallel

    @property
    def tensor_parallel(self) -> int:
        return self.layout.tensor_parallel

    @property
    def micro_batches(self) -> int:
        if self._groups is None and self._arguments.micro_batches:
            return self._arguments.micro_batches
        return self.layout.micro_batches

    @property
    def pipeline_rank(self) -> int:
        return self.groups.pipeline_rank

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """The group gradients are averaged over; callbacks use it for their own communication."""
        return self.groups.data_parallel_group

    @property
    def tensor_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.tensor_group

    # what the layout decides once adopted, the arguments until then
    @property
    def reduction_stats(self) -> dict[str, float]:
        """The data-parallel gradient reduction so far (:meth:`.DataParallelGradients.stats`); empty at dp=1."""
        return self._data_parallel.stats() if self._data_parallel is not None else {}

    @property
    def last_exposed_communication_s(self) -> Optional[float]:
        """Seconds the last step waited for its data-parallel gradient reduction after backward (None at dp=1 or
        before the first step): the communication the overlap did not hide."""
        waits = self._data_parallel.exposed_s if self._data_parallel is not None else []
        return waits[-1] if waits else None

    @property
    def last_pipeline_step_times(self) -> Optional[tuple[float, float]]:
        """``(seconds this rank's stages computed, seconds the schedule ran)`` in the last training step (None
        without pipeline stages or before the first step): one minus their ratio is the rank's measured bubble."""
        return self._pipeline.clock.last if self._pipeline is not None else None

    @property
    def tp_overlap(self) -> Degree:
        return (self._groups.layout if self._groups is not None else self._arguments).tp_overlap

    @property
    def recompute(self) -> str:
        return (self._groups.layout if self._groups is not None else self._arguments).recompute

    @property
    def recompute_ratio(self) -> float:
        return (self._groups.layout if self._groups is not None else self._arguments).recompute_ratio

    # arguments no planning changes
    @property
    def tp_weight_grad_overlap(self) -> bool:
        return self._arguments.weight_grad_overlap

    @property
    def sequence_parallel(self) -> bool:
        return self._arguments.sequence_parallel

    @property
    def schedule(self) -> str:
        return self._arguments.schedule

    @property
    def virtual_stages(self) -> int:
        return self._arguments.stages_per_rank

    @property
    def partition_method(self) -> str:
        return self._arguments.partition

    @property
    def memory_limit(self) -> Optional[float]:
        return self._arguments.memory_limit

    @property
    def plan_only(self) -> bool:
        return self._arguments.plan_only

    @property
    def layout_built(self) -> bool:
        """Whether the first batch has built the layout (stages cut, blocks sharded)."""
        return self._built is not None

    @property
    def local_blocks(self) -> dict[int, nn.Module]:
        """This rank's transformer blocks by trunk index, once the layout is built.

        Callbacks that manage blocks (memory managers, profilers) use it: with ``pipeline_parallel>1`` a rank
        holds only its stages' blocks."""
        return dict(self._built.local_blocks) if self._built is not None else {}

    @property
    def needs_planning(self) -> bool:
        """Whether the layout planner still has to choose part of the layout (an ``"auto"`` beyond data_parallel)."""
        return self._groups is None and self._arguments.needs_planning

    def resolve_layout(self, world_size: int) -> tuple[int, int, int]:
        """``(dp, pp, tp)`` for ``world_size`` ranks, or a clear error when they cannot multiply to it."""
        return self._arguments.resolve_degrees(world_size)

    def validate_arguments(self, world_size: int, *, batch_size: Optional[int] = None,
                           sequence_length: Optional[int] = None, accumulate_grad_batches: int = 1) -> None:
        """Refuse, before the model is even built, a layout that the world size or the batches rule out.

        ``batch_size`` is the batch each data-parallel replica's dataloader yields and
        ``sequence_length`` its tokens per sample; the checks that need them are skipped without
        them. Degrees left to the planner are checked once it has chosen them, at setup.
        """
        self._arguments.validate(world_size, batch_size=batch_size, sequence_length=sequence_length,
                                 accumulate_grad_batches=accumulate_grad_batches)

    def validate_before_launch(self, module: pl.LightningModule, world_size: int, *, batch_size: Optional[int] = None,
                               sequence_length: Optional[int] = None, accumulate_grad_batches: int = 1) -> None:
        """Refuse, before any process starts, a layout that the world size, the batches or the model rule out.

        Runs :meth:`validate_arguments` first, and refuses ``tensor_parallel="auto"`` with no degree the model splits
        into at the fixed degrees (the planner would find none only after profiling). What is left for the first
        batch needs the traced model or the real batch: whether a block splits exactly over the tensor-parallel
        ranks, and the shape of each batch.
        """
        self.validate_arguments(world_size, batch_size=batch_size, sequence_length=sequence_length,
                                accumulate_grad_batches=accumulate_grad_batches)
        self._arguments.validate_model(module, world_size, sequence_length)
        view = network.module_view(module, *self._arguments.launch_degrees(world_size))
        check_tensor_parallel_search(self._arguments, getattr(view.network, "config", None), world_size,
                                     sequence_length)

    def validate_callbacks_before_launch(self, callbacks: Sequence[Any], world_size: int) -> None:
        """Refuse, before any process starts, a callback the layout's sharding mode rules out where the layout is
        fixed (else at setup, once the planner has chosen it): one that cannot run fully sharded."""
        if self._arguments.needs_planning or self._arguments.data_parallel_sharding != "full":
            return
        if self._arguments.layout(world_size).data_parallel > 1:
            check_fully_sharded_callbacks(callbacks)

    def validate_precision_before_launch(self, precision: Optional[str], world_size: int) -> None:
        """Refuse, before any process starts, fp16's loss scaling (Lightning's ``16-mixed`` on a GPU) where the
        fixed layout cannot take it (:func:`.refuse_loss_scaling`; a planned layout is checked at setup)."""
        if self._arguments.needs_planning or str(precision) not in ("16-mixed", "16"):
            return
        refuse_loss_scaling(self._arguments.layout(world_size))
