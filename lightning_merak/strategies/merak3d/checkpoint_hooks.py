"""The checkpoint hooks of ``Merak3DStrategy``: a built layout saves and loads sharded (:mod:`.checkpoint`); a
Lightning ``.ckpt`` file (a DDP run's) resumes too, each rank keeping its experts, stage and shard of it."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ContextManager, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_merak.checkpoint.safe_load import load_torch_file
from lightning_merak.checkpoint.sharded import OPTIMIZER_NAMES, ShardedCheckpointer, is_sharded_checkpoint
from lightning_merak.parallel.data.buckets import DataParallelGradients
from lightning_merak.parallel.materialize import has_meta
from lightning_merak.protocols.module_contract import MODEL
from lightning_merak.strategies.merak3d.network import ModuleView

__all__ = ["CheckpointHooks"]

_CHECKPOINTER_PREFIX = f"{MODEL}."
"""Where the sharded checkpointer reads a module's network in its state: under ``model.``."""
_READ_IN_PLACE = "merak3d_read_in_place"
"""Marks a checkpoint whose weights :meth:`CheckpointHooks.load_checkpoint` read into the built layout itself."""


class _NetworkAsModel:
    """A module whose network lives elsewhere than ``self.model``, as the sharded checkpointer reads one: the
    network as ``model``; its state under the module's names (``renamed``: under ``model.``, for saving)."""

    def __init__(self, view: ModuleView, renamed: bool) -> None:
        self.model = view.network
        self._view, self._renamed = view, renamed

    def state_dict(self) -> dict[str, Any]:
        state = self._view.module.state_dict()
        if not self._renamed:
            return state
        prefix = self._view.state_prefix
        return {_CHECKPOINTER_PREFIX + key[len(prefix):]: value for key, value in state.items()
                if key.startswith(prefix)}


class CheckpointHooks(ParallelStrategy):
    """Lightning's checkpoint hooks for a layout that is built on the first batch.

    Before the build the model is whole (or on the meta device) and Lightning's own behaviour
    applies; afterwards :class:`~.checkpoint.ShardedCheckpointer` writes and reads the shards
    under the unsplit model's names. The strategy provides ``pipeline_rank``, ``layout``,
    ``_groups`` and ``_arguments``, and sets ``_checkpointer``, ``_built``,
    ``_restored_state``, ``_pending_optimizer_states`` and ``_data_parallel``.
    """

    _checkpointer: ShardedCheckpointer
    _built: Optional[Any]
    _restored_state: Optional[dict[str, Any]]
    _pending_optimizer_states: list[dict[str, Any]]
    _data_parallel: Optional[DataParallelGradients]
    module_view: ModuleView

    def _whole_optimizer(self, optimizer: torch.optim.Optimizer) -> ContextManager[None]:
        """``optimizer`` with whole parameters and states while inside, when data-parallel sharding slices them."""
        reduction = self._data_parallel
        return reduction.consolidated(optimizer) if reduction is not None else contextlib.nullcontext()

    def to_original_layout(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """``full`` (a gathered parameter-shaped tensor) in the unsplit model's layout."""
        return self._checkpointer.to_original_layout(name, full)

    def _expert_placement(self) -> tuple[int, tuple[int, int, int]]:
        """This rank and the ``(pp, dp, tp)`` degrees, for the checkpointer to tell which experts it holds.

        Lightning restores a checkpoint before ``setup``: the adopted layout is read as soon as it exists (a layout
        without planning, ``data_parallel="auto"`` resolved, is adopted when the processes start; ``merak_ep`` plans
        before the restore), the degrees the user fixed otherwise."""
        if self._groups is not None:  # adopted once, never replaced
            layout = self.layout
            return self.global_rank, (layout.pipeline_parallel, layout.data_parallel, layout.tensor_parallel)
        return self.global_rank, self._arguments.fixed_degrees("resuming expert-parallel MoE layers")

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._built is None:
            return self.lightning_module.state_dict()
        if self._data_parallel is not None:  # parameters gathered while the next forward would run
            self._data_parallel.wait_for_parameters()
        view = self.module_view
        if view.attribute == MODEL:
            return self._checkpointer.module_state_dict(self.lightning_module)
        # saved under the module's own names, as DDP saves it; the rest of the module's state is whole
        prefix = view.state_prefix
        state = {prefix + key[len(_CHECKPOINTER_PREFIX):]: value
                 for key, value in self._checkpointer.module_state_dict(_NetworkAsModel(view, renamed=True)).items()}
        rest = {key: value for key, value in self.lightning_module.state_dict().items() if not key.startswith(prefix)}
        return {**state, **rest}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self._built is None:
            return optimizer.state_dict()
        with self._whole_optimizer(optimizer):  # saved as an unsharded run's, loadable by any mode
            return self._checkpointer.optimizer_state(optimizer, self.module_view.network)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self._built is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        self._checkpointer.save(checkpoint, Path(filepath), pipeline_rank=self.pipeline_rank,
                                global_rank=self.global_rank, world_size=self.world_size)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if not is_sharded_checkpoint(path):
            if self._built is not None:  # loaded into the built model as it is (plain data parallelism reads it)
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            # a file (a DDP run's): this rank's experts of it now, its stage and shard when the layout is built
            return self._checkpointer.read_file(self._read_file(checkpoint_path, weights_only), self._as_read())
        if self._built is None:
            return self._checkpointer.load(path, self._as_read())
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            raise RuntimeError(f"{path} is a sharded merak3d checkpoint: a fit resumes from it only before the layout "
                               "is built; resume with a new Trainer and module (Trainer.fit(module, ckpt_path=...))")
        # evaluating after a fit (ckpt_path="best"): the weights read into the layout the fit built
        checkpoint = self._checkpointer.load_into(path, self.lightning_module_state_dict())
        return {**checkpoint, "state_dict": {}, _READ_IN_PLACE: True}

    def _as_read(self) -> Any:
        """The LightningModule as the sharded checkpointer reads one: its network as ``model``."""
        view = self.module_view
        return self.lightning_module if view.attribute == MODEL else _NetworkAsModel(view, renamed=False)

    def _read_file(self, checkpoint_path: Any, weights_only: Optional[bool]) -> dict[str, Any]:
        """A local ``.ckpt`` file read memory-mapped and weights-only, so that a rank reads the pages of what it keeps
        (its experts' rows, and on a meta model its stage's blocks); any other through the checkpoint IO."""
        path = Path(checkpoint_path)
        if weights_only is False or not isinstance(self.checkpoint_io, TorchCheckpointIO) or not path.is_file():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        return load_torch_file(path, mmap=True)

    def _named_optimizer_states(self, checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
        """The file's optimizer states keyed by parameter name: by the names a DDP run of ``merak_ep`` recorded, else
        by this run's optimizers (the same ``configure_optimizers`` over the same unsplit model)."""
        recorded = checkpoint.get(OPTIMIZER_NAMES)
        model_names = {id(param): name for name, param in self.module_view.network.named_parameters()}
        states = []
        for index, (optimizer, state) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            if state.get("merak3d_consolidated"):
                states.append(state)
                continue
            if recorded is not None:
                names = [name[len("model."):] if name.startswith("model.") else "" for name in recorded[index]]
            else:
                names = [model_names.get(id(param), "") for group in optimizer.param_groups
                         for param in group["params"]]
            if "" in names:
                raise ValueError("merak3d resumes an optimizer over the LightningModule's `model` only; a parameter "
                                 "outside it has no place in the layout: move it into `model`")
            states.append(self._checkpointer.named_optimizer_state(state, names))
        return states

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if checkpoint.get(_READ_IN_PLACE):  # load_checkpoint put the weights in place already
            return
        if has_meta(self.lightning_module):  # a meta model has nowhere to put it: filled once materialised
            self._restored_state = checkpoint["state_dict"]
        else:
            super().load_model_state_dict(checkpoint, strict)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if self._built is not None:
            for optimizer, state in zip(self.optimizers, states):
                with self._whole_optimizer(optimizer):
                    self._checkpointer.load_optimizer_state(optimizer, state, self.module_view.network)
        else:
            self._pending_optimizer_states = self._named_optimizer_states(checkpoint)
