"""The layout a merak3d run adopts, decided once: degrees, stages, micro-batches, overlap, recomputation.

:class:`Layout` is a value: the user's fixed arguments resolve into one at launch, or the planner
produces one at setup; either way it is checked when it is made and never changes afterwards.
:class:`LayoutGroups` joins it to the device mesh built from it, and answers which group and
which rank a dimension has. Nothing else in merak3d keeps a degree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_merak.distributed.process_groups import new_group
from lightning_merak.protocols.layout_aware import data_parallel_groups_from_mesh

__all__ = [
    "MULTI_STAGE_SCHEDULES",
    "SCHEDULES",
    "Layout",
    "LayoutGroups",
    "check_batch_split",
    "check_micro_batches",
    "check_overlap",
    "context_groups",
    "default_micro_batches",
    "schedule_problem",
]

SCHEDULES = ("1f1b", "gpipe", "shifted_critical_path", "interleaved_1f1b", "interleaved_zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble")
MESH_DIMENSIONS = ("pp", "dp", "tp")
"""The device mesh's dimensions, outermost first: a replica's stages are furthest apart, its tensor ranks closest."""


def default_micro_batches(pipeline_parallel: int) -> int:
    """Two micro-batches per stage keep the pipeline's bubble small; without stages the batch stays whole."""
    return 2 * pipeline_parallel if pipeline_parallel > 1 else 1


def schedule_problem(micro_batches: int, pipeline_parallel: int, schedule: str) -> Optional[str]:
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


def check_micro_batches(micro_batches: int, pipeline_parallel: int, schedule: str) -> None:
    """Refuse a micro-batch count the pipeline schedule cannot run; a multiple of the stages always runs."""
    problem = schedule_problem(micro_batches, pipeline_parallel, schedule)
    if problem is not None:
        raise ValueError(f"{problem}; set micro_batches to a multiple of pipeline_parallel={pipeline_parallel} "
                         f"(the default is {default_micro_batches(pipeline_parallel)})")


def check_overlap(tp_overlap: int, tensor_parallel: int) -> None:
    """Refuse sub-batch overlap without tensor-parallel communication to overlap."""
    if tp_overlap != 1 and tensor_parallel == 1:
        raise ValueError(
            f"tp_overlap={tp_overlap} overlaps tensor-parallel communication, but tensor_parallel=1; "
            "set tensor_parallel>1 or tp_overlap=1"
        )


def check_batch_split(batch_size: int, pipeline_parallel: int, micro_batches: Optional[int], tp_overlap: int,
                      schedule: str) -> None:
    """Refuse a batch that does not split into the micro-batches, and those into ``tp_overlap`` sub-batches.

    ``micro_batches=None`` stands for the default count. The error lists the micro-batch counts
    that would split the batch.
    """
    count = micro_batches or default_micro_batches(pipeline_parallel)

    def splits(candidate: int) -> bool:
        return batch_size % candidate == 0 and (batch_size // candidate) % tp_overlap == 0

    if splits(count):
        return
    if batch_size % count:
        origin = "" if micro_batches else f" (the default, 2 × pipeline_parallel={pipeline_parallel})"
        problem = f"batch size {batch_size} is not divisible by micro_batches={count}{origin}"
    else:
        problem = (f"micro-batches of {batch_size // count} samples (batch size {batch_size} / "
                   f"micro_batches={count}) cannot be split into tp_overlap={tp_overlap} sub-batches")
    fits = [candidate for candidate in range(1, batch_size + 1)
            if splits(candidate) and schedule_problem(candidate, pipeline_parallel, schedule) is None]
    choices = f"set micro_batches to {' or '.join(map(str, fits))}, or " if fits else ""
    raise ValueError(f"{problem}; {choices}make the batch size a multiple of {count * tp_overlap}")


@dataclass(frozen=True)
class Layout:
    """Everything about how a run is laid out over its ranks, checked when made.

    Attributes:
        data_parallel, pipeline_parallel, tensor_parallel: the degrees; their product is the world size.
        virtual_stages: stages per rank (above 1 only with an interleaved schedule).
        schedule: the pipeline schedule.
        micro_batches: micro-batches per batch.
        micro_batches_by_default: whether ``micro_batches`` is the default (2 × stages), which error
            messages say.
        tp_overlap: sub-batches per micro-batch that take turns over tensor-parallel collectives.
        recompute: ``"none"``, ``"full"`` or ``"stage_aware"``.
        recompute_ratio: the first stage's recomputed fraction under ``"stage_aware"``.
        data_parallel_sharding: what the data-parallel ranks split (``"none"``, ``"optimizer"``,
            ``"gradients"``, ``"full"``).
        data_parallel_shard_size: ranks each shard group spans (``None``: every data-parallel rank).
        context_parallel: ranks each sequence is split over. They hold the same parameters and see the same
            samples, so they are part of ``data_parallel`` (the mesh's ``dp`` dimension, which gradients are
            averaged over): ``data_parallel`` = batch replicas × ``context_parallel``.
        context_attention: how attention spans the split sequence, ``"ring"`` or ``"all_to_all"``.
    """

    data_parallel: int
    pipeline_parallel: int
    tensor_parallel: int
    virtual_stages: int
    schedule: str
    micro_batches: int
    micro_batches_by_default: bool
    tp_overlap: int
    recompute: str
    recompute_ratio: float
    data_parallel_sharding: str = "none"
    data_parallel_shard_size: Optional[int] = None
    context_parallel: int = 1
    context_attention: str = "ring"

    def __post_init__(self) -> None:
        check_micro_batches(self.micro_batches, self.pipeline_parallel, self.schedule)
        check_overlap(self.tp_overlap, self.tensor_parallel)
        if self.context_parallel < 1 or self.data_parallel % self.context_parallel:
            raise ValueError(f"context_parallel={self.context_parallel} must divide data_parallel={self.data_parallel} "
                             "(which counts batch replicas × context_parallel)")

    def describe(self, sequence_parallel: bool) -> str:
        """The layout in one line, as a run announces it."""
        context = (f" context_parallel={self.context_parallel} ({self.context_attention} attention)"
                   if self.context_parallel > 1 else "")
        schedule = (f"schedule={self.schedule}" + (f" ({self.virtual_stages} stages a rank)" if self.virtual_stages > 1
                                                   else "")) if self.pipeline_parallel > 1 else "no pipeline schedule"
        return (f"data_parallel={self.batch_replicas}{context} pipeline_parallel={self.pipeline_parallel} "
                f"tensor_parallel={self.tensor_parallel}, tp_overlap={self.tp_overlap}, "
                f"sequence_parallel={sequence_parallel}, {schedule}, "
                f"micro_batches={self.micro_batches}, recompute={self.recompute}")

    @property
    def batch_replicas(self) -> int:
        """Ranks that see different samples: data-parallel ranks over context-parallel ones."""
        return self.data_parallel // self.context_parallel

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.pipeline_parallel * self.tensor_parallel

    @property
    def num_stages(self) -> int:
        """Pipeline stages the model is cut into."""
        return self.pipeline_parallel * self.virtual_stages

    def check_batch(self, batch_size: int) -> None:
        """Refuse a batch that does not split into this layout's micro-batches and sub-batches."""
        check_batch_split(batch_size, self.pipeline_parallel, None if self.micro_batches_by_default
                          else self.micro_batches, self.tp_overlap, self.schedule)


def context_groups(mesh: DeviceMesh, context_parallel: int) -> Optional[dist.ProcessGroup]:
    """This rank's context-parallel group: consecutive runs of ``context_parallel`` ranks along ``dp`` (every rank
    creates every group, in one order, as ``new_group`` needs); None without context parallelism."""
    if context_parallel == 1:
        return None
    members = data_parallel_groups_from_mesh(mesh.mesh.tolist(), mesh.mesh_dim_names or ())
    mine = None
    for line in members:
        for start in range(0, len(line), context_parallel):
            group_ranks = line[start:start + context_parallel]
            group = new_group(group_ranks)
            if dist.get_rank() in group_ranks:
                mine = group
    return mine


@dataclass(frozen=True)
class LayoutGroups:
    """A :class:`Layout` and the device mesh built from it (dimensions ``pp``, ``dp``, ``tp``), with its groups.

    With context parallelism, each run of ``context_parallel`` consecutive ranks along ``dp`` is one
    context-parallel group (``context_group``): one batch replica's sequence split.
    """

    layout: Layout
    mesh: DeviceMesh
    context_group: Optional[dist.ProcessGroup] = None

    @classmethod
    def create(cls, layout: Layout, device_type: str) -> LayoutGroups:
        """Build the mesh and the context-parallel groups (a collective: every rank calls it)."""
        shape = (layout.pipeline_parallel, layout.data_parallel, layout.tensor_parallel)
        # its groups inherit the default group's device_id (bound on NCCL: distributed.process_groups)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMENSIONS)
        return cls(layout, mesh, context_groups(mesh, layout.context_parallel))

    @property
    def batch_rank(self) -> int:
        """Which batch replica this rank's samples belong to (the sampler's rank)."""
        return self.data_parallel_rank // self.layout.context_parallel

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    @property
    def pipeline_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    @property
    def tensor_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def tensor_group(self) -> dist.ProcessGroup:
        return self.mesh["tp"].get_group()

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def pipeline_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def tensor_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()
