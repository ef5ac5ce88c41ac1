"""Pretrained MoE experts in, each expert-parallel rank reading only its own; out as ``save_pretrained`` writes them.

transformers 5 keeps a family's routed experts fused in its ``@use_experts_implementation`` modules
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), while a checkpoint holds either the same fused
tensors or one 2D tensor per expert and projection: what ``save_pretrained`` itself writes for
Mixtral (``block_sparse_moe.experts.{e}.w1.weight`` ...), Qwen2/3-MoE, OLMoE and DeepSeek-V2/V3
(``mlp.experts.{e}.gate_proj.weight`` ...). How per-expert tensors stack is read from transformers'
conversion mapping, never from a table of ours: a ``WeightConverter`` whose operations are
``MergeModulelist(dim=0)``, then optionally ``Concatenate(dim=d)`` over its source patterns in order.
A converter of any other shape on expert tensors is refused, naming the family.

Load: expert-parallel rank ``r`` of ``ep`` reads experts
:func:`~lightning_merak.plugins.moe.experts.exchange.local_expert_range` ``(E, r, ep)`` only: rows
``a:b`` of a fused tensor through a lazy ``get_slice``, or those experts' own keys, each copied straight
into its place in the local fused parameter (the dtype converted). Every other tensor goes through
:func:`~lightning_merak.hf.checkpoint.load_pretrained` as before. Export: :func:`export_layout` names
what ``save_pretrained`` would write (its reverse conversion run on meta tensors) and
:meth:`ExpertLayout.piece` cuts each written tensor from the whole fused one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from lightning_merak.checkpoint.names import build_meta_model, export_names, load_config, strip_wrappers
from lightning_merak.hf.checkpoint import LoadReport, PretrainedFiles, load_pretrained
from lightning_merak.plugins.moe.experts import local_expert_range

__all__ = [
    "ExpertLayout",
    "ExpertLoadReport",
    "ExpertPart",
    "expert_parameters",
    "export_layout",
    "load_pretrained_experts",
    "plan_experts",
]


@dataclass(frozen=True)
class ExpertPart:
    """One source pattern's per-expert tensors: their keys (expert 0, 1, ...) and where they sit in each expert.

    Expert ``e``'s tensor is ``fused[e].narrow(dim, start, length)``.
    """

    keys: tuple[str, ...]
    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class ExpertLayout:
    """How one fused expert parameter is stored: whole under ``fused_key``, or per expert in ``parts``."""

    name: str
    shape: tuple[int, ...]
    fused_key: Optional[str] = None
    parts: tuple[ExpertPart, ...] = ()

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    def keys(self) -> list[str]:
        """Every checkpoint key this parameter is stored under."""
        return [self.fused_key] if self.fused_key is not None else [key for part in self.parts for key in part.keys]

    def pieces(self) -> list[tuple[str, Optional[int], Optional[ExpertPart]]]:
        """``(key, expert, part)`` per stored tensor; ``(fused_key, None, None)`` for the fused layout."""
        if self.fused_key is not None:
            return [(self.fused_key, None, None)]
        return [(key, expert, part) for part in self.parts for expert, key in enumerate(part.keys)]

    def piece_shape(self, part: Optional[ExpertPart]) -> tuple[int, ...]:
        if part is None:
            return self.shape
        inner = list(self.shape[1:])
        inner[part.dim] = part.length
        return tuple(inner)

    def piece(self, fused: torch.Tensor, expert: Optional[int], part: Optional[ExpertPart]) -> torch.Tensor:
        """The stored tensor ``(expert, part)`` cut from the whole fused parameter (a view)."""
        if part is None:
            return fused
        return fused[expert].narrow(part.dim, part.start, part.length)


@dataclass
class ExpertLoadReport(LoadReport):
    """:class:`LoadReport` plus the experts this rank read and the bytes that took."""

    experts: range = range(0)
    expert_bytes_read: int = 0
    expert_tensors: list[str] = field(default_factory=list)


def expert_parameters(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name → global shape of each parameter of an experts module (``@use_experts_implementation``) of ``model``.

    Parameters whose first dimension is the module's ``num_experts``: the fused projections and
    their biases. Call it on the unsplit model (meta is fine).
    """
    found = {}
    for module_name, module in model.named_modules():
        if not hasattr(module, "_is_expert_parallel") or not isinstance(getattr(module, "num_experts", None), int):
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.ndim >= 2 and param.shape[0] == module.num_experts:
                found[f"{module_name}.{name}" if module_name else name] = tuple(param.shape)
    return found


def _concat_dim(converter: Any, family: str) -> Optional[int]:
    """The fused dimension the converter's source patterns concatenate along (None: one pattern, stacked only)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    stacks = bool(ops) and type(ops[0]) is MergeModulelist and ops[0].dim == 0
    if stacks and len(ops) == 1 and len(converter.source_patterns) == 1:
        return None
    if stacks and len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim >= 1:
        return ops[1].dim
    raise NotImplementedError(
        f"transformers converts expert tensors of model type {family!r} with {ops} (patterns "
        f"{converter.source_patterns}); lightning-merak reads only per-expert tensors stacked along the expert "
        "dimension (MergeModulelist(dim=0), then Concatenate). Load this family with strategy=ddp (from_pretrained)."
    )


def _expert_index(pattern: str) -> re.Pattern[str]:
    """A regex of a converter's source pattern whose group is the expert number its ``*`` stands for."""
    return re.compile(re.escape(pattern.lstrip("^")).replace(r"\*", r"(\d+)"))


def plan_experts(model: nn.Module, file_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, ExpertLayout]:
    """Module name → :class:`ExpertLayout` of each expert parameter, from a checkpoint's keys and shapes.

    Keys are renamed as ``from_pretrained`` renames them (transformers' conversion mapping on the
    unsplit ``model``, meta is fine); every expert parameter must be stored whole or as exactly
    experts ``0..E-1`` of each source pattern, with shapes that stack into it. Raises naming the
    first problem; reads nothing.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_renamings, rename_source_key

    family = str(model.config.model_type)
    experts = expert_parameters(model)
    transforms = get_model_conversion_mapping(model, add_legacy=True)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    meta_state = model.state_dict()
    fused: dict[str, str] = {}
    stacked: dict[str, dict[str, dict[int, str]]] = {}  # name → source pattern → expert → key
    foreign = []
    for key in file_shapes:
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        if pattern is None:
            if name in experts:
                fused[name] = key
            continue
        if name not in experts:
            foreign.append(key)
            continue
        _concat_dim(by_pattern[pattern], family)
        found = _expert_index(pattern).search(apply_renamings(key, renamings))
        if found is None:
            raise ValueError(f"{key}: no expert number where {pattern!r} has its '*'")
        stacked.setdefault(name, {}).setdefault(pattern, {})[int(found.group(1))] = key
    if foreign:
        raise NotImplementedError(
            f"transformers converts (not just renames) checkpoint tensors of model type {family!r} other than "
            f"experts ({', '.join(sorted(foreign)[:6])}); lightning-merak reads only renamed tensors and stacked "
            "experts. Load this family with strategy=ddp (from_pretrained) instead."
        )
    layouts = {}
    for name, shape in experts.items():
        if name in fused and name in stacked:
            raise ValueError(f"{name} is stored both whole ({fused[name]}) and per expert; keep one layout")
        if name in fused:
            if tuple(file_shapes[fused[name]]) != shape:
                raise ValueError(f"{fused[name]}: file {tuple(file_shapes[fused[name]])}, model {shape}")
            layouts[name] = ExpertLayout(name, shape, fused_key=fused[name])
        elif name in stacked:
            layouts[name] = _stacked_layout(name, shape, stacked[name], by_pattern, file_shapes, family)
        else:
            raise ValueError(f"the checkpoint has no tensors for expert parameter {name} {shape} (neither fused nor "
                             "per expert); is it a checkpoint of this model?")
    return layouts


def _stacked_layout(name: str, shape: tuple[int, ...], patterns: dict[str, dict[int, str]],
                    by_pattern: Mapping[str, Any], file_shapes: Mapping[str, tuple[int, ...]],
                    family: str) -> ExpertLayout:
    """Check per-expert tensors stack into ``shape`` as the converter says, and where each part sits."""
    converter = by_pattern[next(iter(patterns))]
    concat = _concat_dim(converter, family)
    order = list(converter.source_patterns)
    if sorted(patterns) != sorted(order):
        raise ValueError(f"{name}: the checkpoint holds {sorted(patterns)}, transformers stacks {order}")
    parts, start = [], 0
    dim = 0 if concat is None else concat - 1
    for pattern in order:
        experts = patterns[pattern]
        if sorted(experts) != list(range(shape[0])):
            raise ValueError(f"{name}: {pattern} holds experts {sorted(experts)}, the model has {shape[0]}")
        keys = tuple(experts[e] for e in range(shape[0]))
        shapes = {tuple(file_shapes[key]) for key in keys}
        if len(shapes) != 1:
            raise ValueError(f"{name}: experts of {pattern} differ in shape: {sorted(shapes)}")
        (piece,) = shapes
        expected = list(shape[1:])
        if len(piece) != len(expected) or any(a != b for i, (a, b) in enumerate(zip(piece, expected)) if i != dim):
            raise ValueError(f"{name}: {keys[0]} has shape {piece}, which does not stack into {shape}")
        parts.append(ExpertPart(keys, dim, start, piece[dim]))
        start += piece[dim]
    if start != shape[1 + dim]:
        raise ValueError(f"{name}: parts {order} add up to {start} along dimension {1 + dim}, the model has "
                         f"{shape[1 + dim]}")
    return ExpertLayout(name, shape, parts=tuple(parts))


def _ep_problems(name: str, tensor: torch.Tensor, layout: ExpertLayout, mine: range,
                 layout_changes: Mapping[str, Any], bare: str) -> Optional[str]:
    from torch.distributed.tensor import DTensor

    expected = (len(mine), *layout.shape[1:])
    if isinstance(tensor, DTensor):
        return f"{name} is a DTensor; pass this rank's local experts as a plain tensor of shape {expected}"
    if tensor.device.type == "meta":
        return f"{name} is on the meta device; materialise the model (to_empty) before loading weights"
    if tuple(tensor.shape) != expected:
        return (f"{name} has shape {tuple(tensor.shape)}; experts {mine.start}..{mine.stop - 1} of {layout.shape} "
                f"need {expected} (is ep_rank/ep_size the layout enable_expert_parallel used?)")
    if name in layout_changes or bare in layout_changes:
        return f"{name} has a tensor-parallel layout change; expert parameters are split only by expert"
    return None


def load_pretrained_experts(tensors: Mapping[str, torch.Tensor], directory: Union[str, Path], *, ep_rank: int = 0,
                            ep_size: int = 1, layout_changes: Optional[Mapping[str, Any]] = None,
                            model: Optional[nn.Module] = None) -> ExpertLoadReport:
    """Fill ``tensors`` from the MoE checkpoint in ``directory``, expert parameters with this rank's experts only.

    Args:
        tensors: as for :func:`~lightning_merak.hf.checkpoint.load_pretrained`; an expert parameter
            (``...experts.gate_up_proj``) holds this rank's experts, ``[E/ep_size, ...]`` under its
            unsplit name, as :func:`~lightning_merak.plugins.moe.experts.enable.enable_expert_parallel`
            leaves it.
        directory: a local transformers directory (experts stored fused or per expert).
        ep_rank, ep_size: this rank's place in its expert-parallel group (1: every expert).
        layout_changes, model: as for :func:`~lightning_merak.hf.checkpoint.load_pretrained`.

    Everything is checked before the first read.
    """
    files = PretrainedFiles.open(directory)
    if model is None:
        model = build_meta_model(load_config(directory))
    layouts = plan_experts(model, files.shapes)
    changes = dict(layout_changes or {})
    known = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers()),
             **model.state_dict()}
    _, resolved = strip_wrappers(tensors, known)
    mine = {name: local_expert_range(layout.num_experts, ep_rank, ep_size) for name, layout in layouts.items()}
    local = {name: bare for name, bare in resolved.items() if bare in layouts}
    problems = [problem for name, bare in local.items()
                if (problem := _ep_problems(name, tensors[name], layouts[bare], mine[bare], changes, bare))]
    if problems:
        raise ValueError(f"expert tensors do not fit ep_rank={ep_rank} of ep_size={ep_size}: {'; '.join(problems)}")
    rest = {name: tensor for name, tensor in tensors.items() if name not in local}
    base = load_pretrained(rest, directory, changes,
                           model=model, read_elsewhere={name: layout.keys() for name, layout in layouts.items()})
    ranges = set(mine.values())
    report = ExpertLoadReport(loaded=base.loaded, left_alone=base.left_alone, bytes_read=base.bytes_read,
                              experts=next(iter(ranges)) if len(ranges) == 1 else range(0))
    _read_experts(files, {name: (tensors[name], layouts[bare], mine[bare]) for name, bare in local.items()}, report)
    return report


def _read_experts(files: PretrainedFiles, targets: Mapping[str, tuple[torch.Tensor, ExpertLayout, range]],
                  report: ExpertLoadReport) -> None:
    """Read each rank's experts, file by file, straight into their places in the local fused tensors."""
    from safetensors import safe_open

    by_file: dict[str, list[tuple[str, torch.Tensor, Optional[slice]]]] = {}
    for target, layout, mine in targets.values():
        if layout.fused_key is not None:
            by_file.setdefault(files.weight_map[layout.fused_key], []).append(
                (layout.fused_key, target, slice(mine.start, mine.stop)))
            continue
        for part in layout.parts:
            for expert in mine:
                key = part.keys[expert]
                place = target[expert - mine.start].narrow(part.dim, part.start, part.length)
                by_file.setdefault(files.weight_map[key], []).append((key, place, None))
    with torch.no_grad():
        for file_name, reads in sorted(by_file.items()):
            with safe_open(files.directory / file_name, "pt") as handle:
                for key, place, rows in reads:
                    data = handle.get_slice(key)[rows] if rows is not None else handle.get_tensor(key)
                    place.copy_(data)
                    report.expert_bytes_read += data.numel() * data.element_size()
    report.bytes_read += report.expert_bytes_read
    report.expert_tensors = sorted(targets)
    report.loaded += report.expert_tensors


def export_layout(model: nn.Module) -> tuple[dict[str, str], dict[str, ExpertLayout]]:
    """What ``save_pretrained`` writes for ``model``: module name → key of each plain tensor (tied copies left
    out), and module name → :class:`ExpertLayout` of each expert parameter (fused or per expert, as
    transformers' reverse conversion, run on meta tensors, writes it)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    experts = expert_parameters(model)
    if not experts:
        return export_names(model), {}
    kept = remove_tied_weights_from_state_dict(model.state_dict(), model)
    placeholders = {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta") for name, tensor in kept.items()}
    by_identity = {id(tensor): name for name, tensor in placeholders.items()}
    reverted = revert_weight_conversion(model, dict(placeholders))
    plain = {by_identity[id(tensor)]: key for key, tensor in reverted.items()
             if id(tensor) in by_identity and by_identity[id(tensor)] not in experts}
    layouts = plan_experts(model, {key: tuple(tensor.shape) for key, tensor in reverted.items()
                                   if by_identity.get(id(tensor)) not in plain})
    return plain, layouts
