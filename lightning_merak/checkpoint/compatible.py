"""Whether a checkpoint can resume a model: the model must have the architecture the checkpoint records (or, of no
transformers config, a place for every tensor it holds), the tensors both name must have the shapes the model gives
them, and the expert optimizer state of a DDP run's MoE layers must be spread over the ranks as the model spreads its
experts; the optimizer's parameter groups are read out for the launcher to hold against the run's.

Checked before launch, from the checkpoint's metadata (a merak3d directory's ``.metadata``, or a Lightning file
opened memory-mapped): a model configured differently from the run that saved it (another ``hidden_size``, layer
count or vocabulary) would otherwise fail in every rank's load with a size error deep in a copy, or, resumed at
its last step, not load at all and pass for a resumed run; fewer layers or another head split would load what it
names and train another function (merak3d reads only the tensors the model asks for); another ``moe.ep_size``
would fail in every rank's restore, after launch. The training loaders' saved states are read out too
(:func:`saved_loader_states`), for the launcher to hold them against the run's batches.

Only floating-point tensors of the same rank are compared: a quantised base is saved as its packed storage and
statistics, and a rewritten layout may store a tensor under another rank, which the load itself reconciles.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch import nn

from lightning_merak.checkpoint.checkpoint_io import SafeCheckpointIO
from lightning_merak.checkpoint.expert_optimizer import expert_parallel_size, saved_expert_parallel_size
from lightning_merak.checkpoint.names import MODEL_RECORD_KEY, model_record
from lightning_merak.checkpoint.safe_load import SafeFileSystemReader, load_torch_file
from lightning_merak.checkpoint.saved_setup import architecture_problem
from lightning_merak.checkpoint.sharded import (
    LIGHTNING_CHECKPOINT,
    MERAK3D_OPTIMIZERS,
    ExpertParallelCheckpointIO,
    is_sharded_checkpoint,
)
from lightning_merak.util.optimizer_state import joined_parts

__all__ = ["ShapeMismatch", "check_resume_expert_parallel", "check_resume_shapes", "resume_checkpoint_io",
           "saved_loader_states", "saved_model_config", "saved_optimizer_groups", "saved_tensor_shapes",
           "shape_mismatches", "unexpected_names"]

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
    state = _lightning_state(path).get("state_dict", {})
    return {key: tuple(value.shape) for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.is_floating_point()}


def shape_mismatches(saved: Mapping[str, tuple[int, ...]], model: Mapping[str, tuple[int, ...]]
                     ) -> list[ShapeMismatch]:
    """The tensors both name, of the same rank, whose sizes differ (sorted by name)."""
    return [ShapeMismatch(name, saved[name], shape) for name, shape in sorted(model.items())
            if name in saved and len(saved[name]) == len(shape) and saved[name] != shape]


def unexpected_names(saved: Mapping[str, Any], model: Mapping[str, Any]) -> list[str]:
    """The saved tensors (sorted) the model has no place for: neither one of its own names nor an entry below one
    (a quantised weight's statistics, ``<weight>.absmax``)."""
    return sorted(name for name in saved if name not in model and not any(owner in model for owner in _owners(name)))


def _owners(name: str) -> list[str]:
    """The names ``name`` may sit below: each dotted prefix of it."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def _lightning_state(path: Path) -> dict[str, Any]:
    """What Lightning saved of a checkpoint beside the tensors' data (a merak3d directory's ``lightning.ckpt``, or
    the file memory-mapped), or nothing where there is no such file; read once for all the checks of a resume (the
    file as it is now: a rewritten one is read again). Not to be changed: the checks share it."""
    file = path / LIGHTNING_CHECKPOINT if is_sharded_checkpoint(path) else path
    if not file.is_file():
        return {}
    written = file.stat()
    return _read_lightning_state(file.resolve(), written.st_mtime_ns, written.st_size)


@lru_cache(maxsize=1)
def _read_lightning_state(file: Path, mtime_ns: int, size: int) -> dict[str, Any]:
    """``file`` loaded memory-mapped; its modification time and size key the cache."""
    return load_torch_file(file, mmap=True)


def saved_model_config(path: Path) -> Optional[dict[str, Any]]:
    """The transformers config a checkpoint records of the model that saved it (None: no record)."""
    record = _lightning_state(path).get(MODEL_RECORD_KEY)
    return record.get("config") if isinstance(record, Mapping) else None


def check_resume_shapes(path: Path, module: nn.Module) -> None:
    """Refuse to resume ``module`` (built, on any device, meta included) from a checkpoint saved from another
    model: another architecture than the checkpoint records (each field that differs named), for a model of no
    transformers config tensors it has no place for (which merak3d's load would leave unread), or tensors of other
    sizes (the first that differ named)."""
    network = getattr(module, "model", None)
    record = model_record(network) if isinstance(network, nn.Module) else None
    saved_config = saved_model_config(path)
    problem = architecture_problem(saved_config, record["config"] if record is not None else None)
    if problem is not None:
        raise ValueError(f"resume={path}: {problem}")
    model = {name: tuple(tensor.shape) for name, tensor in module.state_dict(keep_vars=True).items()
             if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()}
    saved = saved_tensor_shapes(path)
    extra = unexpected_names(saved, model) if record is None else []  # a model of no transformers config
    if extra:
        raise ValueError(f"resume={path}: the checkpoint holds tensors this model has no place for: "
                         f"{', '.join(extra[:_SHOWN])}{_more(extra)}; resume with the model it was trained with "
                         "(its layer count, model.* settings), or start afresh without resume")
    mismatches = shape_mismatches(saved, model)
    if not mismatches:
        return
    shown = "; ".join(f"{item.name} is {list(item.saved)} there and {list(item.model)} here"
                      for item in mismatches[:_SHOWN])
    raise ValueError(f"resume={path}: the checkpoint was saved from a model of other sizes: {shown}"
                     f"{_more(mismatches)}; resume with the model settings it was trained with (model.*, the data's "
                     "vocabulary), or start afresh without resume")


def _more(items: list[Any]) -> str:
    """How many of ``items`` a message naming the first few leaves out."""
    return f" (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""


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
    loops = _lightning_state(path).get("loops") or {}
    states = loops.get("fit_loop", {}).get("state_dict", {}).get("combined_loader", [])
    return [state for state in states if isinstance(state, dict)]


def saved_optimizer_groups(path: Path) -> list[list[dict[str, Any]]]:
    """Each saved optimizer's parameter groups, their names and settings (merak3d's ``lightning.ckpt`` records them
    with its layouts, a Lightning file with each state; a composite's parts' groups in order), read before launch."""
    checkpoint = _lightning_state(path)
    states = checkpoint.get(MERAK3D_OPTIMIZERS) or [joined_parts(state) for state in
                                                    checkpoint.get("optimizer_states") or []]
    return [list(state.get("param_groups", [])) for state in states]


def check_resume_expert_parallel(path: Path, module: nn.Module) -> None:
    """Refuse to resume ``module`` from a Lightning file whose expert optimizer state was saved at another
    ``ep_size`` than ``module``'s MoE layers spread their experts over (merak3d's sharded directories name every
    expert and its state by its global number, and keep no such state)."""
    if not path.is_file():
        return
    saved = saved_expert_parallel_size(_lightning_state(path))
    ep_size = expert_parallel_size(module)
    if saved is not None and saved != ep_size:
        raise ValueError(f"resume={path}: the checkpoint's expert optimizer state was saved with moe.ep_size={saved}, "
                         f"this run uses moe.ep_size={ep_size}; resume with moe.ep_size={saved}, or start afresh "
                         "without resume")
