"""Process groups the package creates, and which backend serves a collective: gloo and NCCL made explicit.

NCCL differs from gloo in what a collective may be handed and how a group starts:

* a group is bound to one GPU (``device_id``): ``init_process_group`` then connects NCCL at once and later
  ``new_group``/``DeviceMesh`` groups split from it; every group here is created through
  :func:`init_process_group` and :func:`new_group`, which pass it on NCCL;
* collectives take CUDA tensors only: a small tensor made for a collective (a vote, a measured time)
  lives on :func:`collective_device`;
* object collectives (``all_gather_object``, ``broadcast_object_list``) stage their bytes on
  ``torch.cuda.current_device()``: :func:`init_process_group` sets it to the rank's GPU before any group exists;
* gloo lacks a fast reduce-scatter (an all-to-all plus a local sum stands in for it on CPU tensors), NCCL has
  a native one: :func:`reduce_scatter_by_exchange` says which to use;
* ``all_to_all_single`` with uneven splits runs on both (NCCL groups it from send/receive pairs) as long as
  the splits are Python ints and the tensors contiguous, which every caller here passes.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_merak.distributed.nccl_environment import apply_nccl_defaults

__all__ = ["backend_serving", "collective_device", "group_device_id", "init_process_group", "new_group",
           "process_group_options", "process_group_setup", "reduce_scatter_by_exchange"]


def backend_serving(backend: str, device_type: str) -> str:
    """The backend that runs collectives on ``device_type`` tensors, from a group's backend string
    (``"nccl"``, ``"gloo"`` or a per-device ``"cpu:gloo,cuda:nccl"``)."""
    backend = str(backend).lower()
    if ":" not in backend:
        return backend
    by_device = dict(entry.split(":", 1) for entry in backend.split(","))
    if device_type not in by_device:
        raise ValueError(f"process group backend {backend!r} serves no {device_type} tensors")
    return by_device[device_type]


def reduce_scatter_by_exchange(backend: str, device_type: str) -> bool:
    """Whether a reduce-scatter of ``device_type`` tensors runs as an all-to-all plus a local sum (gloo,
    whose own reduce-scatter all-reduces the whole tensor) rather than the backend's native one (NCCL)."""
    return backend_serving(backend, device_type) == "gloo"


def group_device_id(backend: str, device: Optional[torch.device] = None) -> Optional[torch.device]:
    """The GPU an NCCL group binds to (``device``, else the current CUDA device); None for other backends."""
    if "nccl" not in str(backend).lower():
        return None
    if device is not None and torch.device(device).type == "cuda" and torch.device(device).index is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device())


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a tensor made for a collective over ``group`` must live: the rank's GPU on NCCL, else the CPU."""
    if str(dist.get_backend(group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")  # gloo, or a per-device group whose CPU tensors gloo serves


def process_group_options(backend: str, device: Optional[torch.device] = None) -> dict[str, Any]:
    """Keyword arguments for ``init_process_group`` on ``backend``: on NCCL ``device_id``, once that GPU is made
    current and torch's watchdog and flight recorder defaults are set
    (:func:`~lightning_merak.distributed.nccl_environment.apply_nccl_defaults`); none for other backends."""
    device_id = group_device_id(backend, device)
    if device_id is None:
        return {}
    apply_nccl_defaults()
    torch.cuda.set_device(device_id)
    return {"device_id": device_id}


def process_group_setup(requested: Optional[str], device: torch.device) -> tuple[str, dict[str, Any]]:
    """The backend for a rank on ``device`` (``requested``, else NCCL on CUDA and gloo elsewhere) and its
    :func:`process_group_options`."""
    backend = requested or ("nccl" if torch.device(device).type == "cuda" else "gloo")
    return backend, process_group_options(backend, device)


def init_process_group(backend: str, *, device: Optional[torch.device] = None, **kwargs: Any) -> None:
    """``dist.init_process_group(backend, **kwargs)`` with :func:`process_group_options`."""
    dist.init_process_group(backend, **process_group_options(backend, device), **kwargs)


def new_group(ranks: Sequence[int], **kwargs: Any) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` bound to the default group's GPU on NCCL (a collective over every rank)."""
    default = dist.distributed_c10d._get_default_group()
    device_id = getattr(default, "bound_device_id", None) or group_device_id(dist.get_backend())
    if device_id is not None:
        kwargs.setdefault("device_id", device_id)
    return dist.new_group(list(ranks), **kwargs)
