"""Whether a checkpoint can resume a model: the tensors both name must have the shapes the model gives them, and
the expert optimizer state of a DDP run's MoE layers must be spread over the ranks as the model spreads its experts.

Checked before launch, from the checkpoint's metadata (a merak3d directory's ``.metadata``, or a Lightning file
opened memory-mapped): a model configured differently from the run that saved it (another ``hidden_size``, layer
count or vocabulary) would otherwise fail in every rank's load with a size error deep in a copy, or, resumed at
its last step, not load at all and pass for a resumed run; another ``moe.ep_size`` would fail in every rank's
restore, after launch. The training loaders' saved states are read out too (:func:`saved_loader_states`), for the
launcher to hold them against the run's batches.

Only floating-point tensors of the same rank are compared: a quantised base is saved as its packed storage and
statistics, and a rewritten layout may store a tensor under another rank, which the load itself reconciles.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch import nn

from lightning_merak.checkpoint.checkpoint_io import SafeCheckpointIO
from lightning_merak.checkpoint.expert_optimizer import expert_parallel_size, saved_expert_parallel_size
from lightning_merak.checkpoint.safe_load import SafeFileSystemReader, load_torch_file
from lightning_merak.checkpoint.sharded import LIGHTNING_CHECKPOINT, ExpertParallelCheckpointIO, is_sharded_checkpoint

__all__ = ["ShapeMismatch", "check_resume_expert_parallel", "check_resume_shapes", "resume_checkpoint_io",
           "saved_loader_states", "saved_tensor_shapes", "shape_mismatches"]

_SHOWN = 3


class ShapeMismatch(NamedTuple):
    name: str
    saved: tuple[int, ...]
    model: tuple[int, ...]


def saved_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every floating-point tensor of a checkpoint's model state, keyed as the LightningModule's
    ``state_dict`` names it; nothing is read but metadata (a file is memory-mapped)."""
    if is_sharded_checkpoint(path):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
        return {key[len("model."):]: tuple(entry.size) for key, entry in stored.items()
                if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
                and entry.properties.dtype.is_floating_point}
    state = load_torch_file(path, mmap=True).get("state_dict", {})
    return {key: tuple(value.shape) for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.is_floating_point()}


def shape_mismatches(saved: Mapping[str, tuple[int, ...]], model: Mapping[str, tuple[int, ...]]
                     ) -> list[ShapeMismatch]:
    """The tensors both name, of the same rank, whose sizes differ (sorted by name)."""
    return [ShapeMismatch(name, saved[name], shape) for name, shape in sorted(model.items())
            if name in saved and len(saved[name]) == len(shape) and saved[name] != shape]


def check_resume_shapes(path: Path, module: nn.Module) -> None:
    """Refuse to resume ``module`` (built, on any device, meta included) from a checkpoint saved from a model of
    other sizes, naming the first tensors that differ."""
    model = {name: tuple(tensor.shape) for name, tensor in module.state_dict(keep_vars=True).items()
             if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()}
    mismatches = shape_mismatches(saved_tensor_shapes(path), model)
    if not mismatches:
        return
    shown = "; ".join(f"{item.name} is {list(item.saved)} there and {list(item.model)} here"
                      for item in mismatches[:_SHOWN])
    more = f" (and {len(mismatches) - _SHOWN} more)" if len(mismatches) > _SHOWN else ""
    raise ValueError(f"resume={path}: the checkpoint was saved from a model of other sizes: {shown}{more}; resume "
                     "with the model settings it was trained with (model.*, the data's vocabulary), or start afresh "
                     "without resume")


def resume_checkpoint_io(path: Optional[Path], strategy_name: str, module: nn.Module) -> CheckpointIO:
    """The checkpoint IO of a run of ``strategy_name`` resuming from ``path``: under DDP, a merak3d checkpoint
    directory (sharded tensors, any layout) is read into ``module``'s unsplit model as
    :class:`~lightning_merak.checkpoint.sharded.ExpertParallelCheckpointIO` reads it; another strategy, or a module
    with no ``model`` to read it into, is refused before launch, where Lightning would fail reading it."""
    io = SafeCheckpointIO()
    if path is None or strategy_name == "merak3d" or not is_sharded_checkpoint(path):
        return io
    if strategy_name.startswith("ddp") and isinstance(getattr(module, "model", None), nn.Module):
        return ExpertParallelCheckpointIO(io, module)
    raise ValueError(f"resume={path} is a merak3d checkpoint directory, which strategy={strategy_name} with "
                     f"{type(module).__name__} cannot read; resume it with strategy=merak3d (any layout: "
                     "strategy.data_parallel=N trains as DDP does), or write its weights out with merak-export and "
                     "start from them with model.path")


def saved_loader_states(path: Path) -> list[dict[str, Any]]:
    """The training loaders' states a checkpoint holds (Lightning's fit loop saves each one's ``state_dict``), read
    before launch so that a resume the loaders would refuse on every rank is refused first."""
    file = path / LIGHTNING_CHECKPOINT if is_sharded_checkpoint(path) else path
    if not file.is_file():
        return []
    loops = load_torch_file(file, mmap=True).get("loops") or {}
    states = loops.get("fit_loop", {}).get("state_dict", {}).get("combined_loader", [])
    return [state for state in states if isinstance(state, dict)]


def check_resume_expert_parallel(path: Path, module: nn.Module) -> None:
    """Refuse to resume ``module`` from a Lightning file whose expert optimizer state was saved at another
    ``ep_size`` than ``module``'s MoE layers spread their experts over (merak3d's sharded directories name every
    expert and its state by its global number, and keep no such state)."""
    if not path.is_file():
        return
    saved = saved_expert_parallel_size(load_torch_file(path, mmap=True))
    ep_size = expert_parallel_size(module)
    if saved is not None and saved != ep_size:
        raise ValueError(f"resume={path}: the checkpoint's expert optimizer state was saved with moe.ep_size={saved}, "
                         f"this run uses moe.ep_size={ep_size}; resume with moe.ep_size={saved}, or start afresh "
                         "without resume")
