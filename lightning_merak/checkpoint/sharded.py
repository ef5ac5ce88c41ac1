"""Sharded checkpoints of a built merak3d layout, readable by any other layout.

Once the layout is built, a checkpoint is a directory written with torch distributed
checkpoint (each rank writes its own shards, replicas once) plus ``lightning.ckpt`` with the
rest of Lightning's checkpoint. Tensors are keyed by the unsplit model's names, and any layout
can load them: on resume the whole model is still unsplit, so the shards are read into full
tensors and the new layout is cut from those. Expert-parallel MoE layers number their experts
from 0 on every rank; checkpoints number them globally. ``merak_ep``'s fused expert tensors, already
cut to each rank's experts before the build, are saved as slices of their ``[E, ...]`` whole and
read back as the slice this layout holds (:class:`~lightning_merak.plugins.moe.checkpoint.FusedExpertSlices`),
Adam's moments with them; so are the LoRA factors of adapters on those experts (:class:`ExpertSlices`).
A Lightning ``.ckpt`` file (a DDP run's, its experts and their factors gathered whole) is read the same way once in
memory: :meth:`ShardedCheckpointer.read_file` cuts the experts to this rank's and
:meth:`ShardedCheckpointer.named_optimizer_state` keys its optimizer state by name for the built layout.

A checkpoint directory is written under a temporary name and renamed once every rank's shards and
``lightning.ckpt`` are on disk (:mod:`~lightning_merak.checkpoint.files`), so a run killed
while saving keeps its previous checkpoint. Loading builds nothing but tensors and plain values
(:mod:`~lightning_merak.checkpoint.safe_load`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_merak.checkpoint.files import partial_path, publish_directory, refuse_unseen_shards
from lightning_merak.checkpoint.names import MODEL_RECORD_KEY, QUANTIZED_SPLITS_KEY, model_record
from lightning_merak.checkpoint.rewritten import join_saved_shards, saved_storage_where_rewritten
from lightning_merak.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, load_torch_file
from lightning_merak.checkpoint.saved_setup import (
    architecture_problem,
    group_names,
    optimizer_groups_problem,
    optimizer_settings_problem,
)
from lightning_merak.parallel.pipeline.stage import RankStages, tied_parameter_names
from lightning_merak.parallel.tensor.blocks import LayoutChange
from lightning_merak.plugins.moe.checkpoint import ExpertNumbering, FusedExpertSlices, slice_entries
from lightning_merak.plugins.moe.experts.adapter_slices import slice_expert_factor
from lightning_merak.protocols.layout_aware import data_parallel_groups_from_mesh
from lightning_merak.util.optimizer_state import joined_parts

__all__ = ["LIGHTNING_CHECKPOINT", "MERAK3D_OPTIMIZERS", "ExpertParallelCheckpointIO", "ExpertSlices",
           "ShardedCheckpointer", "is_sharded_checkpoint"]

LIGHTNING_CHECKPOINT = "lightning.ckpt"
MERAK3D_OPTIMIZERS = "merak3d_optimizers"
"""Key, in ``lightning.ckpt``, of each optimizer's parameter groups (by name) and the entries its shards hold."""
OPTIMIZER_NAMES = "merak_ep_optimizer_names"
"""Key of a DDP checkpoint of ``merak_ep``: each optimizer's parameter names in its state's order."""


def _read_target(tensor: torch.Tensor) -> torch.Tensor:
    """Where a saved tensor is read to: a copy of the unsplit tensor, or, for a model still on the meta
    device, CPU storage of its shape (the build then copies this rank's part into its shards)."""
    if tensor.is_meta:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    return tensor.detach().clone()


def quantized_splits(model: nn.Module) -> dict[str, dict[str, Any]]:
    """How each layer of ``model`` quantised per tensor-parallel shard was split, by its unsplit name
    (:meth:`~lightning_merak.parallel.tensor.layers.QuantizableShard.quantized_split`): saved in the model record
    (:data:`QUANTIZED_SPLITS_KEY`) so the merged export can put the dequantised shards back together."""
    rename = model.original_name if isinstance(model, RankStages) else (lambda name: name)
    splits = {}
    for name, layer in model.named_modules():
        split = layer.quantized_split() if callable(getattr(layer, "quantized_split", None)) else None
        if split is not None:
            splits[rename(name)] = split
    return splits


class ExpertSlices(FusedExpertSlices):
    """``merak_ep``'s fused expert tensors and the LoRA factors of adapters on them, each rank's part a slice of
    the whole (:class:`~lightning_merak.plugins.moe.checkpoint.FusedExpertSlices` for the experts).

    PEFT cuts a factor per expert in its own layout: ``lora_A [E·r, in]`` is expert-major, so a rank's rows are
    one block as the experts' are; ``lora_B [out, r·E]`` has the expert fastest, so a rank's columns are strided.
    A checkpoint stores ``lora_B`` as ``[out, r, E]`` (a reshape of the single-process factor,
    :func:`~lightning_merak.adapters.moe.factor_view`) sharded on its last dimension, which DCP writes and reshards
    like any slice; Adam's moments with them. A ``lora_B`` saved flat (a run without ``merak_ep``) is read whole and
    sliced. Lightning's DDP gathers and slices the factors in PEFT's own layout instead.

    Args:
        shards: as :class:`FusedExpertSlices`'.
        factors: parameter name of each expert adapter factor → ``(kind, ExpertShard, this rank's shape)``.
    """

    def __init__(self, shards: dict[str, Any], factors: dict[str, tuple[str, Any, tuple[int, ...]]]) -> None:
        super().__init__(shards)
        self.factors = factors

    @classmethod
    def of(cls, model: nn.Module) -> ExpertSlices:
        """The fused expert tensors and expert adapter factors of ``model`` (experts already cut)."""
        factors = {}
        if "peft" in sys.modules:  # else no adapter exists, and importing the adapters would pull PEFT in
            from lightning_merak.adapters.moe import expert_factor_shards  # lazy: PEFT

            params = dict(model.named_parameters())
            factors = {name: (kind, shard, tuple(params[name].shape))
                       for name, (kind, shard) in expert_factor_shards(model).items()}
        return cls(FusedExpertSlices.of(model).shards, factors)

    def __contains__(self, name: str) -> bool:
        return name in self.factors or super().__contains__(name)

    def _factor(self, name: str, local: torch.Tensor) -> Optional[tuple[str, Any]]:
        """``(kind, shard)`` when ``local`` is this rank's part of an expert adapter factor (or its moment)."""
        found = self.factors.get(name)
        return None if found is None or tuple(local.shape) != found[2] else found[:2]

    def global_view(self, name: str, local: torch.Tensor) -> torch.Tensor:
        found = self._factor(name, local)
        if found is None:
            return super().global_view(name, local)
        from torch.distributed.tensor import Shard

        from lightning_merak.adapters.moe import factor_view  # lazy: PEFT (a factor exists: it is imported)

        kind, shard = found
        view = factor_view(kind, local, len(shard.experts))
        if shard.ep_size == 1:
            return view
        dim = 0 if kind == "A" else 2
        whole = list(view.shape)
        whole[dim] = whole[dim] // len(shard.experts) * shard.num_experts
        stride = torch.empty(whole, device="meta").stride()
        return DTensor.from_local(view, self._mesh(shard, local.device.type), [Shard(dim)], run_check=False,
                                  shape=torch.Size(whole), stride=stride)

    def read_target(self, name: str, saved_shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        found = self._factor(name, like)
        if found is None:
            return super().read_target(name, saved_shape, like)
        if found[0] == "B" and len(saved_shape) == 2 and tuple(saved_shape) != tuple(like.shape):
            return torch.empty(tuple(saved_shape), dtype=like.dtype)  # saved flat: read whole, sliced by loaded()
        return self.global_view(name, like)

    def local_shape(self, name: str, saved_shape: Sequence[int]) -> Optional[tuple[int, ...]]:
        """This rank's shape of a saved tensor of ``name`` (optimizer state included) when it is a slice of an
        expert tensor or factor; ``None`` for any other (read whole)."""
        if name in self.factors:
            return self.factors[name][2] if len(saved_shape) else None
        shard = self.shards.get(name)
        if shard is None or not saved_shape or saved_shape[0] != shard.num_experts:
            return None
        return (len(shard.experts), *saved_shape[1:])

    def loaded(self, name: str, value: Any) -> Any:
        """A tensor :meth:`read_target` read, in this rank's layout again (a plain tensor of its own experts)."""
        if isinstance(value, DTensor):
            value = value.to_local()
        found = self.factors.get(name)
        if found is None or not isinstance(value, torch.Tensor) or value.ndim < 2 or tuple(value.shape) == found[2]:
            return value
        kind, shard, shape = found
        if value.ndim == 3:
            return value.reshape(shape)
        return slice_expert_factor(kind, value, shard.experts, shard.num_experts).clone()  # type: ignore[arg-type]

    def gathered(self, name: str, local: torch.Tensor) -> torch.Tensor:
        found = self._factor(name, local)
        if found is None:
            return super().gathered(name, local)
        from lightning_merak.adapters.moe import join_expert_factors  # lazy: PEFT (a factor exists: it is imported)

        kind, shard = found
        if shard.ep_size == 1:
            return local
        pieces = [torch.empty_like(local) for _ in range(shard.ep_size)]
        dist.all_gather(pieces, local.detach().contiguous(), group=shard.group)
        rank = (local.shape[0] if kind == "A" else local.shape[1]) // len(shard.experts)
        return join_expert_factors(kind, pieces, rank)  # type: ignore[arg-type]

    def sliced(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        if name not in self.factors:
            return super().sliced(name, whole)
        return self.loaded(name, whole)

    def whole_checkpoint(self, checkpoint: dict[str, Any], module: nn.Module,
                         optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """As :class:`FusedExpertSlices`', and the name of each optimizer entry recorded: an optimizer over the
        trainable parameters alone (adapters) numbers its state otherwise than the module's parameter order."""
        super().whole_checkpoint(checkpoint, module, optimizers)
        names = {id(param): name for name, param in module.named_parameters()}
        checkpoint[OPTIMIZER_NAMES] = [[names.get(id(param), "") for group in optimizer.param_groups
                                        for param in group["params"]] for optimizer in optimizers]

    def local_checkpoint(self, checkpoint: dict[str, Any], module: nn.Module) -> None:
        """As :class:`FusedExpertSlices`', optimizer entries matched by the names :meth:`whole_checkpoint` recorded
        (by the module's parameter order in a file written without them)."""
        recorded = checkpoint.pop(OPTIMIZER_NAMES, None)
        if recorded is None:
            super().local_checkpoint(checkpoint, module)
            return
        state = checkpoint.get("state_dict", {})
        for key in list(state):
            state[key] = self.sliced(key, state[key])
        for names, saved in zip(recorded, checkpoint.get("optimizer_states", [])):
            slice_entries(saved, names, self.sliced)


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a directory merak3d wrote (and not a checkpoint file Lightning reads itself)."""
    return path.is_dir() and (path / LIGHTNING_CHECKPOINT).is_file()


class ShardedCheckpointer:
    """Saves and loads a built layout's state under the unsplit model's names.

    Args:
        placement: ``() -> (global rank, (pp, dp, tp))``: where this rank sits, to tell which
            experts it holds. It may raise when the degrees are not known yet.
    """

    def __init__(self, placement: Callable[[], tuple[int, tuple[int, int, int]]]) -> None:
        self._placement = placement
        self.layout_changes: dict[str, LayoutChange] = {}
        """Parameters whose layout the tensor-parallel split changed, by unsplit name."""
        self.experts = ExpertNumbering({}, self._data_parallel_ranks)
        """Expert-parallel MoE layers number their experts from 0 on every rank; checkpoints number them globally."""
        self.model_record: Optional[dict[str, Any]] = None
        self._quantized_splits: dict[str, dict[str, Any]] = {}
        """The unsplit model's transformers config (and adapters), saved with each checkpoint."""
        self.fused_experts = ExpertSlices({}, {})
        """``merak_ep``'s fused expert tensors and adapter factors on them, each rank's part a slice of the whole."""
        self.tied_names: dict[str, tuple[str, ...]] = {}
        """Each tied parameter's name → every name of its tie group (an embedding and its LM head). A layout without
        stages saves the shared optimizer state once, under the name ``named_parameters`` keeps; a last stage names
        its copy by the head."""
        self.before_load: Optional[Callable[[nn.Module], Any]] = None
        """Run on the LightningModule before a checkpoint is read (``merak_ep`` cuts a model that
        ``configure_model`` built to its experts there, so that only those are read)."""

    def find_experts(self, model: nn.Module) -> None:
        """Note ``model``'s expert-parallel layers, tied parameters and transformers config (on the unsplit model,
        before pruning).

        The config (:func:`~lightning_merak.checkpoint.names.model_record`) lets ``merak-export`` write the
        checkpoint as a Hugging Face directory.
        """
        self.experts = ExpertNumbering.of(model, self._data_parallel_ranks)
        self.fused_experts = ExpertSlices.of(model)
        self.model_record = model_record(model)
        self.tied_names = {name: group for group in tied_parameter_names(model) for name in group}

    def saved_entry(self, state: dict[str, Any], name: str) -> Optional[Any]:
        """The saved optimizer entry of parameter ``name``, or of a parameter tied to it: each copy of a tied
        weight resumes the state its tie group saved, whichever of its names the saving layout used."""
        return next((state[candidate] for candidate in (name, *self.tied_names.get(name, ())) if candidate in state),
                    None)

    # Names and layouts ------------------------------------------------------------------------

    def to_original_layout(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """``full`` (a gathered parameter-shaped tensor) in the unsplit model's layout."""
        change = self.layout_changes.get(name)
        return change.to_original(full) if change else full

    def _original_names(self, model: nn.Module) -> dict[int, str]:
        rename = model.original_name if isinstance(model, RankStages) else (lambda name: name)
        return {id(param): self.experts.renamed(rename(name), to_global=True)
                for name, param in model.named_parameters()}

    def _checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Shards stay DTensors; a shard whose layout sharding changed is saved whole, as the original; a rank's
        fused experts (and their optimizer state) as their slice of the whole."""
        if isinstance(tensor, DTensor) and name in self.layout_changes:
            return self.to_original_layout(name, tensor.full_tensor()).detach()
        return self.fused_experts.global_view(name, tensor.detach())

    def _tensor_rank(self) -> Optional[tuple[int, int]]:
        """This rank's place in its tensor-parallel group and the group's size, or None before the degrees are
        known."""
        try:
            rank, (_, _, tp) = self._placement()
        except (RuntimeError, ValueError, AttributeError):
            return None
        return rank % tp, tp  # the tp dimension is the fastest of merak3d's (pp, dp, tp) mesh

    def _data_parallel_ranks(self) -> tuple[int, list[int]]:
        """This rank and its data-parallel group's ranks, the ones its expert groups are carved from."""
        rank, (pp, dp, tp) = self._placement()
        mesh = torch.arange(pp * dp * tp).reshape(pp, dp, tp).tolist()  # the layout of merak3d's device mesh
        return rank, next(group for group in data_parallel_groups_from_mesh(mesh, ("pp", "dp", "tp"))
                          if rank in group)

    def _renumbered_state(self, state: dict[str, Any], to_global: bool) -> dict[str, Any]:
        """A module state (keys ``model.<name>``) with expert numbers renumbered (:class:`ExpertNumbering`)."""
        prefix = "model."
        return {prefix + self.experts.renamed(key[len(prefix):], to_global) if key.startswith(prefix) else key: value
                for key, value in state.items()}

    # Saving -----------------------------------------------------------------------------------

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """``module``'s state under the unsplit names; shards stay DTensors."""
        model = module.model
        self._quantized_splits = quantized_splits(model)
        state = {}
        for key, value in module.state_dict().items():
            rest = key[len("model."):]
            name = model.original_name(rest) if isinstance(model, RankStages) else rest
            state["model." + self.experts.renamed(name, to_global=True)] = self._checkpoint_tensor(name, value)
        return state

    def optimizer_state(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
        """``optimizer``'s state keyed by the unsplit names of ``model``'s parameters."""
        names = self._original_names(model)
        state = {
            names[id(param)]: {key: self._checkpoint_tensor(names[id(param)], value)
                               if isinstance(value, torch.Tensor) else value
                               for key, value in optimizer.state[param].items()}
            for group in optimizer.param_groups for param in group["params"] if param in optimizer.state
        }
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [names[id(param)] for param in group["params"]]} for group in optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def save(self, checkpoint: dict[str, Any], path: Path, *, pipeline_rank: int, global_rank: int,
             world_size: int) -> None:
        """Write ``checkpoint`` (its ``state_dict`` and ``optimizer_states`` from the methods above) to ``path``.

        Every rank writes its shards; rank 0 writes the rest with each optimizer's parameter
        groups gathered over the stages, then publishes the directory under ``path``, once it sees
        every shard (else every rank raises ``NotSharedCheckpointError``). The caller waits at a
        barrier afterwards.
        """
        import torch.distributed.checkpoint as dcp

        optimizer_states = checkpoint.pop("optimizer_states", [])
        tensors = {"model": checkpoint.pop("state_dict"), "optim": {}}
        layouts = []
        for index, saved in enumerate(optimizer_states):
            entries = {}
            for name, values in saved["state"].items():
                for key, value in values.items():
                    tensors["optim"][f"{index}/{name}/{key}"] = value
                    entries[f"{index}/{name}/{key}"] = (tuple(value.shape), value.dtype) if isinstance(
                        value, torch.Tensor) else value
            stage_groups: list[Any] = [None] * world_size
            dist.all_gather_object(stage_groups, (pipeline_rank, saved["param_groups"], entries))
            by_stage = {stage: groups for stage, groups, _ in stage_groups}
            per_stage = [by_stage[stage] for stage in sorted(by_stage)]
            layouts.append({
                "param_groups": [
                    {**per_stage[0][g], "params": list(dict.fromkeys(
                        name for groups in per_stage for name in groups[g]["params"]))}
                    for g in range(len(per_stage[0]))
                ],
                "entries": {key: value for _, _, part in stage_groups for key, value in part.items()},
            })
        temporary = partial_path(path)
        dcp.save(tensors, checkpoint_id=temporary)  # returns once every rank's shards are written
        splits = self._quantized_splits
        tensor_rank = self._tensor_rank()
        if tensor_rank is not None and tensor_rank[1] > 1:  # each stage knows its own blocks' splits
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, splits)
            splits = {name: split for part in gathered for name, split in part.items()}
        refuse_unseen_shards(temporary, path, global_rank)
        if global_rank == 0:
            record = {MODEL_RECORD_KEY: {**self.model_record, QUANTIZED_SPLITS_KEY: splits} if splits
                      else self.model_record} if self.model_record is not None else {}
            torch.save({**checkpoint, **record, MERAK3D_OPTIMIZERS: layouts}, temporary / LIGHTNING_CHECKPOINT)
            publish_directory(temporary, path)

    # Loading ----------------------------------------------------------------------------------

    def load(self, path: Path, module: nn.Module) -> dict[str, Any]:
        """Read a sharded checkpoint into full tensors, keyed as ``module`` (still unsplit) names them.

        Optimizer states come back consolidated (``"merak3d_consolidated"``), for
        :meth:`load_optimizer_state` once the layout is built.
        """
        import torch.distributed.checkpoint as dcp

        checkpoint = load_torch_file(path / LIGHTNING_CHECKPOINT)
        saved, record = checkpoint.get(MODEL_RECORD_KEY) or {}, model_record(module.model)
        problem = architecture_problem(saved.get("config"), record["config"] if record is not None else None)
        if problem is not None:  # it would read the tensors the model names, and ignore the others
            raise ValueError(f"{path}: {problem}")
        if self.before_load is not None:
            self.before_load(module)
        self.find_experts(module.model)
        metadata = SafeFileSystemReader(path).read_metadata()
        targets = self._renumbered_state(
            {key: _read_target(value) for key, value in module.state_dict().items()}, to_global=True)
        model_state = dict(targets)
        quantization = getattr(module.model, "after_materialize", None)  # an adapter's deferred base quantisation
        joins = saved_storage_where_rewritten(model_state, metadata, self._tensor_rank(),
                                              (checkpoint.get(MODEL_RECORD_KEY) or {}).get(QUANTIZED_SPLITS_KEY),
                                              getattr(quantization, "double_quant", True))
        for key, target in targets.items():
            saved = metadata.state_dict_metadata.get(f"model.{key}")
            if key.startswith("model.") and key[len("model."):] in self.fused_experts and hasattr(saved, "size"):
                model_state[key] = self.fused_experts.read_target(key[len("model."):], tuple(saved.size), target)
        optim_state: dict[str, Any] = {}
        for layout in checkpoint[MERAK3D_OPTIMIZERS]:
            for key, entry in layout["entries"].items():
                if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], torch.dtype):
                    optim_state[key] = self._optimizer_target(key, entry[0], entry[1])
                else:
                    optim_state[key] = entry
        tensors = {"model": model_state, "optim": optim_state}
        dcp.load(tensors, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        join_saved_shards(tensors["model"], joins)
        # this rank's slice of each fused expert tensor or adapter factor, as a plain tensor in its layout again
        tensors["model"] = {key: self.fused_experts.loaded(key[len("model."):], value)
                            for key, value in tensors["model"].items()}
        tensors["optim"] = {key: self.fused_experts.loaded(key.split("/", 2)[1], value) if "/" in key else value
                            for key, value in tensors["optim"].items()}
        checkpoint["state_dict"] = self._renumbered_state(tensors["model"], to_global=False)
        checkpoint["optimizer_states"] = []
        for index, layout in enumerate(checkpoint.pop(MERAK3D_OPTIMIZERS)):
            state: dict[str, dict[str, Any]] = {}
            for key in layout["entries"]:
                _, name, field_name = key.split("/", 2)
                if key.startswith(f"{index}/"):
                    state.setdefault(name, {})[field_name] = tensors["optim"][key]
            checkpoint["optimizer_states"].append(
                {"merak3d_consolidated": True, "state": state, "param_groups": layout["param_groups"]}
            )
        return checkpoint

    def load_into(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """Read a sharded checkpoint's model tensors into ``state`` in place: the built layout's own state
        (:meth:`module_state_dict`, what :meth:`save` writes from), so a layout built by a fit evaluates a
        checkpoint of the same layout without rebuilding. Returns the checkpoint's other entries (no optimizer
        states). Refused where the layout saves tensors in another form than it holds them (re-laid-out shards
        saved whole, fused experts as their slice of the whole, quantised bases), which a read cannot put back."""
        import torch.distributed.checkpoint as dcp

        if self.layout_changes or self.fused_experts.shards or self.fused_experts.factors or self._quantized_splits:
            raise ValueError(f"{path} is a sharded merak3d checkpoint of a layout with re-laid-out shards, fused "
                             "experts or a quantised base, which loads only before the layout is built: evaluate it "
                             "with a new Trainer and module (Trainer.validate/test/predict(module, ckpt_path=...))")
        checkpoint = load_torch_file(path / LIGHTNING_CHECKPOINT)
        checkpoint.pop(MERAK3D_OPTIMIZERS, None)
        dcp.load({"model": state}, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        return checkpoint

    def read_file(self, checkpoint: dict[str, Any], module: nn.Module) -> dict[str, Any]:
        """A Lightning checkpoint file's contents (a DDP run's: the whole model, ``merak_ep``'s experts and the LoRA
        factors on them gathered whole) with each fused expert tensor and expert factor cut to this rank's experts,
        in place. Its optimizer states stay in torch's format until :meth:`named_optimizer_state` keys them by name
        (the names are known once the optimizers exist)."""
        if self.before_load is not None:
            self.before_load(module)
        self.find_experts(module.model)
        state = checkpoint.get("state_dict", {})
        prefix = "model."
        for key in list(state):
            if not key.startswith(prefix):
                continue
            shard = self.fused_experts.shards.get(key[len(prefix):])
            if shard is not None and state[key].ndim and state[key].shape[0] != shard.num_experts:
                raise ValueError(f"{key} holds {state[key].shape[0]} experts, this model {shard.num_experts}: the file "
                                 "is of another expert count, or a merak_ep DDP run's that kept rank 0's experts only "
                                 "(before they were gathered whole); resume from a file holding every expert")
            state[key] = self.fused_experts.sliced(key[len(prefix):], state[key])
        return checkpoint

    def named_optimizer_state(self, saved: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
        """A file's optimizer state (torch's format, entries numbered by the optimizer's parameter order) as
        :meth:`load` returns one, keyed by the unsplit names (``names[i]``: the ``i``-th parameter of the optimizer
        that saved it), expert entries cut to this rank's experts; :meth:`load_optimizer_state` then places each
        entry on this rank's stage and shard. A composite optimizer's state (``{"parts": [...]}``, as ``MuonWithAdamW``
        saves it) is read as torch's over the parts' groups in order, the order its ``param_groups`` list them in."""
        saved = joined_parts(saved)
        order = [index for group in saved["param_groups"] for index in group["params"]]
        if len(order) != len(names):
            raise ValueError(f"the checkpoint's optimizer holds {len(order)} parameters, this run's {len(names)}: "
                             "resume with the configure_optimizers (and adapters) the checkpoint was trained with")
        name_of = dict(zip(order, names))
        state = {name_of[index]: {field: self.fused_experts.sliced(name_of[index], value)
                                  if isinstance(value, torch.Tensor) else value for field, value in entry.items()}
                 for index, entry in saved["state"].items()}
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [name_of[index] for index in group["params"]]} for group in saved["param_groups"]]
        return {"merak3d_consolidated": True, "state": state, "param_groups": groups}

    def _optimizer_target(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Where saved optimizer entry ``key`` (``<index>/<name>/<field>``) is read to: the whole tensor, or this
        rank's slice of a fused expert tensor's state."""
        name = key.split("/", 2)[1]
        local = self.fused_experts.local_shape(name, shape)
        if local is None:
            return torch.empty(shape, dtype=dtype)
        return self.fused_experts.read_target(name, shape, torch.empty(local, dtype=dtype))

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any], model: nn.Module) -> None:
        """Load ``saved`` into ``optimizer`` over the built ``model``'s parameters, each entry placed like its own."""
        if not saved.get("merak3d_consolidated"):
            optimizer.load_state_dict(saved)
            return
        fix = "resume with the configure_optimizers (optim.name) it was trained with"
        saved_groups = saved["param_groups"]
        problem = (optimizer_groups_problem(group_names(saved_groups), group_names(optimizer.param_groups), fix)
                   or optimizer_settings_problem(saved_groups, optimizer.param_groups, fix))
        if problem is not None:  # zipped with this optimizer's groups, they would be cut short or fail in torch
            raise ValueError(problem)
        names = self._original_names(model)
        state: dict[int, Any] = {}
        groups = []
        index = 0
        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
            ids = []
            for param in group["params"]:
                entry = self.saved_entry(saved["state"], names[id(param)])
                if entry is not None:
                    state[index] = {
                        key: self._local_like(param, names[id(param)], value) for key, value in entry.items()
                    }
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def _local_like(self, param: nn.Parameter, name: str, value: Any) -> Any:
        """A saved full optimizer-state entry placed like ``param`` (sharded, in its layout)."""
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            return value
        change = self.layout_changes.get(name)
        full = change.from_original(value) if change else value
        if full.shape != param.shape:
            return value
        # a copy: the value may be a memory-mapped file's pages (:meth:`read_file`), which must not back the state
        full = full.to(param.device, copy=True)
        if isinstance(param, DTensor):
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(full, param.device_mesh, param.placements)
        return full


def _torch_optimizer_state(saved: dict[str, Any], order: dict[str, int],
                           checkpointer: ShardedCheckpointer) -> dict[str, Any]:
    """A consolidated state (keyed by parameter name) in torch's own format, parameters numbered by ``order``
    (their place in the model), so that ``Optimizer.load_state_dict`` pairs them with an optimizer built over the
    model's parameters in that order. A layout with stages names a tied weight by each of its names (the last
    stage's copy by the head's): one entry per parameter of the model here."""
    state, groups = {}, []
    for group in saved["param_groups"]:
        names = sorted({next((tied for tied in checkpointer.tied_names.get(name, ()) if tied in order), name)
                        for name in group["params"]}, key=order.__getitem__)
        state.update({order[name]: entry for name in names
                      if (entry := checkpointer.saved_entry(saved["state"], name)) is not None})
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [order[n] for n in names]})
    return {"state": state, "param_groups": groups}


class ExpertParallelCheckpointIO(CheckpointIO):
    """A DDP run's checkpoint IO that resumes merak3d's sharded checkpoints and whole-expert files (as
    :class:`~lightning_merak.plugins.moe.experts.ExpertParallelCallback` saves them), each rank keeping its experts.

    DDP keeps the whole model on every rank except ``merak_ep``'s experts, so a merak3d checkpoint is read as an
    unsplit model's (experts sliced to this rank's, :class:`ShardedCheckpointer`) and its optimizer state put in
    torch's format over the model's parameter order. Everything else goes to ``inner``.

    Args:
        inner: the strategy's own checkpoint IO.
        module: the LightningModule, experts already cut to this rank's (its ``model`` not yet wrapped by DDP).
    """

    def __init__(self, inner: CheckpointIO, module: nn.Module) -> None:
        self.inner = inner
        self.module = module

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if not is_sharded_checkpoint(Path(path)):  # a DDP run's file: its experts whole, this rank keeps its own
            checkpoint = self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
            ExpertSlices.of(self.module).local_checkpoint(checkpoint, self.module)
            return checkpoint
        rank, world = dist.get_rank(), dist.get_world_size()
        checkpointer = ShardedCheckpointer(lambda: (rank, (1, world, 1)))
        checkpoint = checkpointer.load(Path(path), self.module)
        order = {name: index for index, (name, _) in enumerate(self.module.model.named_parameters())}
        checkpoint["optimizer_states"] = [_torch_optimizer_state(saved, order, checkpointer)
                                          for saved in checkpoint["optimizer_states"]]
        return checkpoint
