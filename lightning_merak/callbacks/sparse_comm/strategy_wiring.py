"""How :class:`~.callback.SparseCommunication` attaches to the strategy: its process groups, what it changes in DDP
and in clipping, the network and scan-speed probes of the cost model, and when it replaces the tables."""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_merak.callbacks.sparse_comm.sketch import drop_zero_rows
from lightning_merak.callbacks.sparse_comm.wire_cost_model import NetworkModel
from lightning_merak.distributed.gradient_norm import clip_over_groups
from lightning_merak.distributed.process_groups import collective_device, new_group
from lightning_merak.protocols.layout_aware import LayoutAwareStrategy, data_parallel_groups_from_mesh, layout_aware
from lightning_merak.util.timing import DeviceTimer

BANDWIDTH_PROBE_BYTES = 4 * 1024 * 1024
_BANDWIDTH_PROBE_REPEATS = 3


def data_parallel_group(strategy: pl.strategies.Strategy) -> dist.ProcessGroup | None:
    """The strategy's data-parallel group (``None`` means the world group)."""
    group = getattr(strategy, "data_parallel_group", None)
    return group() if callable(group) else group


def dedicated_group(strategy: pl.strategies.Strategy, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group on which excluded tables and EmbRace communicate: the strategy's ``sparse_comm_process_group``,
    else a new one over the data-parallel ranks, else ``group`` itself when it is not the world group."""
    provided = getattr(strategy, "sparse_comm_process_group", None)
    if provided is not None:
        return provided() if callable(provided) else provided
    layout = layout_aware(strategy)
    if layout is not None:
        return _new_data_parallel_groups(layout)
    if group is None or group is dist.group.WORLD:
        return new_group(ranks=list(range(dist.get_world_size())))
    return group


def _new_data_parallel_groups(strategy: LayoutAwareStrategy) -> dist.ProcessGroup:
    """A new group per data-parallel group of the strategy's mesh (every rank creates all of them,
    in the same order); returns this rank's."""
    mesh = strategy.device_mesh
    rank = dist.get_rank()
    own = None
    for ranks in data_parallel_groups_from_mesh(mesh.mesh.tolist(), list(mesh.mesh_dim_names)):
        group = new_group(ranks=ranks)
        if rank in ranks:
            own = group
    assert own is not None, "every rank lies in one data-parallel group of the mesh"
    return own


def before_strategy_setup(strategy: pl.strategies.Strategy, action: Callable[[], None]) -> None:
    """Run ``action`` once, first thing when Lightning next sets ``strategy`` up: after
    ``LightningModule.configure_model`` has built the model, before the strategy moves it, wraps it (DDP)
    and creates the optimizers (``Trainer._run``), which is where ``setup`` otherwise leaves a callback."""
    shadowed = vars(strategy).get("setup")  # None: the class's method

    def setup(trainer: pl.Trainer) -> None:
        if shadowed is None:
            del strategy.setup
        else:
            strategy.setup = shadowed
        action()
        strategy.setup(trainer)

    strategy.setup = setup


def ignore_in_ddp(pl_module: pl.LightningModule, names: list[str]) -> None:
    """Keep the named parameters out of the DDP wrapper the strategy builds next."""
    ignore = getattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None)
    if ignore is None:
        raise RuntimeError(
            "this torch has no DistributedDataParallel._set_params_and_buffers_to_ignore_for_model, "
            "needed to keep tables out of DDP; use method='s2' with dense-gradient embeddings"
        )
    already = list(getattr(pl_module, "_ddp_params_and_buffers_to_ignore", []))
    ignore(pl_module, sorted(set(already) | set(names)))


def gradients_in_buckets(strategy: pl.strategies.Strategy) -> None:
    """Let DDP keep gradients as views of its buckets, unless the user chose otherwise.

    The hook hands each bucket's dense table gradient to the S2 reducer and writes the result back into the bucket;
    with gradients copied into buckets and back, a table-sized gradient crosses memory twice more per step than
    torch's sparse path does (measured, a 500k × 64 table on one CPU thread: ~56 ms per copy). Only the
    ``DDPStrategy``'s keyword arguments (a private attribute, read if present) can ask for it before DDP wraps.
    """
    ddp_kwargs = getattr(strategy, "_ddp_kwargs", None)
    if isinstance(ddp_kwargs, dict):
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)


def finds_unused_parameters(strategy: pl.strategies.Strategy) -> bool:
    """Whether the ``DDPStrategy`` asks DDP to look for parameters without a gradient (``find_unused_parameters``):
    DDP then fails on a rank whose batch did not read a table looked up sparsely ("Expected sparse gradient to be
    defined"), as it expects the gradient of a sparse parameter from every rank."""
    ddp_kwargs = getattr(strategy, "_ddp_kwargs", None)
    return isinstance(ddp_kwargs, dict) and bool(ddp_kwargs.get("find_unused_parameters"))


def clip_with_shards(trainer: pl.Trainer, shards: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Under DDP, which has no clipping owner of its own, clip by the norm over the whole sharded tables,
    not this rank's columns: otherwise ranks clip by different factors and replicated weights drift apart (with
    experts' registrations, if expert parallelism made them, in one norm)."""
    clip_over_groups(trainer, shards, group)


def measure_bandwidth(group: dist.ProcessGroup | None) -> NetworkModel:
    """Time an all-reduce on ``group``; the slowest rank's time, so all ranks agree."""
    probe = torch.zeros(BANDWIDTH_PROBE_BYTES // 4, device=collective_device(group))
    dist.all_reduce(probe, group=group)
    with DeviceTimer(probe.device) as timer:
        for _ in range(_BANDWIDTH_PROBE_REPEATS):
            dist.all_reduce(probe, group=group)
    elapsed = torch.tensor([timer.seconds / _BANDWIDTH_PROBE_REPEATS], dtype=torch.float64, device=probe.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    world_size = dist.get_world_size(group)
    wire_bytes = 2 * (world_size - 1) / world_size * BANDWIDTH_PROBE_BYTES
    return NetworkModel(bandwidth_bytes_per_s=wire_bytes / max(elapsed.item(), 1e-9))


def measure_scan_speed(device: torch.device) -> float:
    """Bytes per second at which this rank finds all-zero gradient rows (local, no collective)."""
    probe = torch.ones(BANDWIDTH_PROBE_BYTES // 4 // 64, 64, device=device)
    drop_zero_rows(torch.arange(probe.shape[0], device=device), probe)
    with DeviceTimer(device) as timer:
        for _ in range(_BANDWIDTH_PROBE_REPEATS):
            drop_zero_rows(torch.arange(probe.shape[0], device=device), probe)
    elapsed = timer.seconds / _BANDWIDTH_PROBE_REPEATS
    return BANDWIDTH_PROBE_BYTES / max(elapsed, 1e-9)
