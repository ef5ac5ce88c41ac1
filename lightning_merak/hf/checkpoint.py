"""Pretrained Hugging Face weights into a model's tensors, whole or as this rank's DTensor shards.

:func:`load_pretrained` fills tensors named as in the unsplit transformers model, each read from a
local ``config.json`` + ``model.safetensors`` (or a sharded index) directory. A DTensor shard
reads only the slice it covers (``safe_open(...).get_slice(key)[...]``: memory-mapped, lazy), so
no rank ever holds more than its share; the copy converts the dtype. Why not torch's
``HuggingFaceStorageReader``: DCP requests whole-tensor global shapes that equal the file's, so
the row-regrouped fused projections and padded vocabularies of a tensor-parallel layout would
need a second copy; reading the rows each shard needs directly is exact and needs none.

Everything is checked before the first read: unknown and missing names, shapes, conversions
transformers applies that are more than renamings (refused, naming the family).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from lightning_merak.checkpoint.names import build_meta_model, checkpoint_names, load_config, strip_wrappers

__all__ = ["LoadReport", "PretrainedFiles", "check_pretrained_files", "load_pretrained", "mismatch_fix"]

SAFE_WEIGHTS = "model.safetensors"
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"


@dataclass
class PretrainedFiles:
    """Where each checkpoint key of a local transformers directory lives, and its shape."""

    directory: Path
    weight_map: dict[str, str]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def open(cls, directory: Union[str, Path]) -> PretrainedFiles:
        """The files' keys and shapes, from their headers alone; an index naming a file or key that is not there,
        or a file that is no safetensors file, is refused (a ``ValueError`` naming it) before anything is read."""
        directory = Path(directory)
        index = directory / SAFE_WEIGHTS_INDEX
        if index.is_file():
            try:
                weight_map = dict(json.loads(index.read_text())["weight_map"])
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map: {error!r}); "
                                 "save the model again with save_pretrained") from None
        elif (directory / SAFE_WEIGHTS).is_file():
            weight_map = dict.fromkeys(_header_shapes(directory / SAFE_WEIGHTS), SAFE_WEIGHTS)
        else:
            raise FileNotFoundError(
                f"{directory} has neither {SAFE_WEIGHTS} nor {SAFE_WEIGHTS_INDEX}; save the model with "
                "save_pretrained(..., safe_serialization=True) (PyTorch .bin checkpoints are not read)"
            )
        absent = sorted(name for name in set(weight_map.values()) if not (directory / name).is_file())
        if absent:
            raise ValueError(f"{index} lists weight files that {directory} does not hold: {', '.join(absent[:4])}"
                             f"{' ...' if len(absent) > 4 else ''}; copy every file the index names (an interrupted "
                             "download or copy?), or save the model again with save_pretrained")
        files = cls(directory, weight_map)
        for name in sorted(set(weight_map.values())):
            files.shapes.update(_header_shapes(directory / name))
        unlisted = sorted(key for key in weight_map if key not in files.shapes)
        if unlisted:
            raise ValueError(f"{index} places tensors in files that do not hold them: "
                             f"{', '.join(f'{key} ({weight_map[key]})' for key in unlisted[:4])}; save the model "
                             "again with save_pretrained")
        return files


def _header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Key → shape of each tensor of the safetensors ``file``, from its header; refused when it has none."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, "pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file} is not a readable safetensors file ({error}); save the model again with "
                         "save_pretrained") from None


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did: tensors filled, names left alone, bytes read from the files."""

    loaded: list[str] = field(default_factory=list)
    left_alone: list[str] = field(default_factory=list)
    bytes_read: int = 0


@dataclass
class _Read:
    name: str
    target: torch.Tensor  # this rank's local tensor, filled in place
    key: str  # checkpoint key
    global_shape: tuple[int, ...]
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    change: Any  # a LayoutChange (rows, transposed) or None


def _region(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(local tensor, global shape, local shape, global offset)`` of a whole tensor or a DTensor shard."""
    from torch.distributed.tensor import DTensor

    if tensor.device.type == "meta":
        raise ValueError(f"{name} is on the meta device; materialise the model (to_empty) before loading weights")
    if not isinstance(tensor, DTensor):
        return tensor, tuple(tensor.shape), tuple(tensor.shape), (0,) * tensor.ndim
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as error:  # private helper: present in the torch versions the project pins
        raise RuntimeError("this torch has no compute_local_shape_and_global_offset; DTensor shards "
                           "cannot be located in the checkpoint") from error
    global_shape = tuple(tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(global_shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), global_shape, tuple(shape), tuple(offset)


def _expected_file_shape(read: _Read) -> tuple[int, ...]:
    if read.change is None:
        return read.global_shape
    return tuple(read.change.to_original(torch.empty(read.global_shape, device="meta")).shape)


def _is_vocabulary_padding(file_shape: tuple[int, ...], expected: tuple[int, ...], vocab_size: Optional[int]) -> bool:
    """The model pads the vocabulary rows (tensor-parallel vocabularies): the file holds ``vocab_size`` rows."""
    return (vocab_size is not None and len(file_shape) == len(expected) >= 1 and file_shape[0] == vocab_size
            and expected[0] > vocab_size and file_shape[1:] == expected[1:])


def _read_box(part: Any, file_shape: tuple[int, ...], shape: tuple[int, ...], offset: tuple[int, ...]) -> torch.Tensor:
    """The ``shape`` box at ``offset``; rows past the file's (a padded vocabulary) are zeros."""
    if not shape:
        return part[...]
    stop = min(offset[0] + shape[0], file_shape[0])
    box = (slice(offset[0], max(stop, offset[0])),) + tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:]))
    data = part[box]
    if data.shape[0] < shape[0]:
        data = torch.cat([data, torch.zeros((shape[0] - data.shape[0], *shape[1:]), dtype=data.dtype)])
    return data


def _segments(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first row, length)`` of each maximal stretch of ``rows`` that counts up by one."""
    segments: list[tuple[int, int, int]] = []
    for position, row in enumerate(rows):
        if segments and segments[-1][1] + segments[-1][2] == row:
            segments[-1] = (segments[-1][0], segments[-1][1], segments[-1][2] + 1)
        else:
            segments.append((position, row, 1))
    return segments


def _copy_changed(part: Any, file_shape: tuple[int, ...], read: _Read) -> int:
    """Copy this shard of a tensor whose layout the split changed into ``read.target``; the bytes read.

    The model's row ``i`` is the original's row ``change.rows[i]`` (a file column for a transposed
    Conv1D weight), so the shard's rows name what to read: one read per stretch of consecutive
    rows, copied straight into place (the dtype converted), nothing file-sized built. Rows past
    the file's (a padded vocabulary) are zeros.
    """
    change, start, count = read.change, read.offset[0], read.shape[0]
    transposed = bool(change.transposed) and len(file_shape) == 2
    wanted = change.rows[start:start + count] if change.rows is not None else range(start, start + count)
    across = (slice(read.offset[1], read.offset[1] + read.shape[1]),) if len(file_shape) == 2 else ()
    limit, read_bytes = file_shape[1 if transposed else 0], 0
    for position, first, length in _segments(wanted):
        stop = min(first + length, limit)
        if stop > first:
            rows = slice(first, stop)
            piece = part[across + (rows,)].t() if transposed else part[(rows,) + across]
            read.target[position:position + stop - first].copy_(piece)
            read_bytes += piece.numel() * piece.element_size()
        read.target[position + max(stop - first, 0):position + length].zero_()
    return read_bytes


def _layout_problem(read: _Read) -> Optional[str]:
    """Why ``read.change`` cannot describe this tensor, or None."""
    if not all(hasattr(read.change, field_name) for field_name in ("rows", "transposed", "to_original")):
        return (f"{read.key}: layout change {read.change!r} is not a LayoutChange (rows, transposed, to_original); "
                "pass the changes apply_tensor_parallel returned")
    if read.change.rows is not None and len(read.change.rows) != read.global_shape[0]:
        return (f"{read.key}: the layout change lists {len(read.change.rows)} rows, the model's tensor has "
                f"{read.global_shape[0]}")
    return None


def _ignored(patterns: Optional[list[str]], name: str) -> bool:
    return any(re.search(pattern, name) for pattern in patterns or [])


_FIX = "pass the directory save_pretrained wrote for this model, with its own config.json"


def mismatch_fix(overrides: Optional[Mapping[str, Any]] = None) -> str:
    """How to fix weights that do not match the model built from a folder's config.json: the ``model.config``
    ``overrides``, when given, are the likely cause (one that changes the structure), before the folder."""
    if not overrides:
        return _FIX
    given = " ".join(f"model.config.{key}={value if isinstance(value, str) else json.dumps(value, default=str)}"
                     for key, value in overrides.items())
    return (f"the overrides {given} may change the model's structure (layers, sizes, tied weights) away from the "
            f"folder's weights: remove them; or, if the folder is the wrong one, {_FIX}")


def _matched_names(files: PretrainedFiles, model: nn.Module, read_elsewhere: Optional[Mapping[str, Sequence[str]]],
                   overrides: Optional[Mapping[str, Any]] = None) -> tuple[dict[str, str], dict[str, str]]:
    """``(module name → checkpoint key, tied name → the name it is tied to)``; refused when the files lack a tensor
    the model persists or hold one it does not have (the weights of another architecture or configuration), or hold
    two different tensors for one tied weight (an untied checkpoint under ``tie_word_embeddings=True``)."""
    persistent = model.state_dict()
    elsewhere = dict(read_elsewhere or {})
    skipped = {key for keys in elsewhere.values() for key in keys}
    by_module = checkpoint_names([key for key in files.weight_map if key not in skipped], model)
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    unexpected = sorted(name for name in by_module if name not in persistent
                        and not _ignored(getattr(model, "_keys_to_ignore_on_load_unexpected", None), name))
    missing = sorted(name for name in persistent if name not in by_module and tied.get(name) not in by_module
                     and name not in elsewhere
                     and not _ignored(getattr(model, "_keys_to_ignore_on_load_missing", None), name))
    if unexpected or missing:
        raise ValueError(
            f"{files.directory} does not match {type(model).__name__} built from its config.json"
            f"{' and model.config' if overrides else ''}: missing {missing or 'none'}; unexpected "
            f"{unexpected or 'none'}; {mismatch_fix(overrides)}"
        )
    differing = [(by_module[name], by_module[source]) for name, source in sorted(tied.items())
                 if name in by_module and source in by_module and _differ(files, by_module[name], by_module[source])]
    if differing:
        raise ValueError(
            f"{files.directory} holds {', '.join(f'{copy} apart from {source}' for copy, source in differing)}, "
            f"with other values, but {type(model).__name__} ties them into one weight (tie_word_embeddings=True, "
            "from model.config or config.json): one parameter cannot hold both, and from_pretrained would leave "
            "them untied against the config. Set model.config.tie_word_embeddings=false to train the checkpoint "
            "untied, as it was saved"
        )
    return by_module, tied


_COMPARED_ELEMENTS = 1 << 24
"""How many elements of each tensor :func:`_differ` holds at once: a vocabulary's rows, block by block."""


def _differ(files: PretrainedFiles, first: str, second: str) -> bool:
    """Whether checkpoint tensors ``first`` and ``second`` differ in shape or value (read block by block): a file
    that holds a tied weight twice, as equal copies, loads into the one parameter either way."""
    from safetensors import safe_open

    shape = files.shapes[first]
    if shape != files.shapes[second]:
        return True
    row = max(1, int(torch.Size(shape[1:]).numel()))
    step = max(1, _COMPARED_ELEMENTS // row)
    with torch.device("cpu"), safe_open(files.directory / files.weight_map[first], "pt") as one, \
            safe_open(files.directory / files.weight_map[second], "pt") as other:  # read, also in a meta build
        if not shape:
            return not torch.equal(one.get_tensor(first), other.get_tensor(second))
        left, right = one.get_slice(first), other.get_slice(second)
        return any(not torch.equal(left[start:start + step], right[start:start + step])
                   for start in range(0, shape[0], step))


def check_pretrained_files(files: PretrainedFiles, model: nn.Module,
                           read_elsewhere: Optional[Mapping[str, Sequence[str]]] = None,
                           overrides: Optional[Mapping[str, Any]] = None) -> None:
    """Refuse, from the files' headers (and a tied weight's two copies, where the files hold both), weights that are
    not the unsplit ``model``'s (meta is fine): the checks :func:`load_pretrained` makes on each rank, made once
    before any rank starts.
    ``read_elsewhere`` as for :func:`load_pretrained`; ``overrides``, the ``model.config`` the model was built with,
    are named as the likely cause of a mismatch."""
    by_module, tied = _matched_names(files, model, read_elsewhere, overrides)
    mismatched = []
    for name, tensor in model.state_dict().items():
        key = by_module.get(name) or by_module.get(tied.get(name, ""))
        if key is not None and files.shapes[key] != tuple(tensor.shape):
            mismatched.append(f"{key}: file {files.shapes[key]}, model {tuple(tensor.shape)}")
    if mismatched:
        raise ValueError(f"shapes in {files.directory} differ from {type(model).__name__}'s, built from its "
                         f"config.json{' and model.config' if overrides else ''}: {'; '.join(mismatched[:4])}; "
                         f"{mismatch_fix(overrides)}")


def load_pretrained(tensors: Mapping[str, torch.Tensor], directory: Union[str, Path],
                    layout_changes: Optional[Mapping[str, Any]] = None, *,
                    model: Optional[nn.Module] = None,
                    read_elsewhere: Optional[Mapping[str, Sequence[str]]] = None) -> LoadReport:
    """Fill ``tensors`` in place from the transformers checkpoint in ``directory``.

    Args:
        tensors: the unsplit model's parameter and buffer names (as transformers names them,
            optionally under Lightning's ``model.`` or PEFT's ``base_model.model.``) → this rank's
            tensor: a whole tensor, or a DTensor whose shard alone is read.
        directory: a local directory with ``config.json`` and safetensors weights.
        layout_changes: names (as in ``tensors`` or bare) → the ``LayoutChange`` the split
            applied (fused projections regrouped per rank, key/value rows held by several ranks,
            Conv1D transposed); each shard reads only the file rows its own rows come from.
        model: the unsplit transformers model (meta is fine) for names, tied weights and
            conversions; built on the meta device from ``config.json`` when omitted.
        read_elsewhere: module name → the checkpoint keys another reader fills it from
            (:func:`~lightning_merak.hf.experts.load_pretrained_experts`): those keys are not
            renamed here, those names not required.

    Non-persistent buffers and adapter weights are left alone. A tied weight absent from the
    file (``lm_head.weight``) is read from the tensor it is tied to.
    """
    files = PretrainedFiles.open(directory)
    if model is None:
        model = build_meta_model(load_config(directory))
    config = model.config
    layout_changes = dict(layout_changes or {})
    persistent = model.state_dict()
    known = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers()), **persistent}
    by_module, tied = _matched_names(files, model, read_elsewhere)
    prefix, resolved = strip_wrappers(tensors, known)
    foreign = sorted(name for name, bare in resolved.items() if bare is None)
    if foreign and "base_model." not in prefix:
        raise ValueError(f"{type(model).__name__} has no tensors named {foreign[:8]}; pass the unsplit model's "
                         "parameter and buffer names (as in model.named_parameters())")
    report = LoadReport(left_alone=foreign)
    reads: list[_Read] = []
    for name, bare in resolved.items():
        if bare is None:
            continue
        if bare not in persistent or (bare not in by_module and tied.get(bare) not in by_module):
            report.left_alone.append(name)  # a non-persistent buffer, or a key transformers ignores too
            continue
        key = by_module[bare] if bare in by_module else by_module[tied[bare]]
        target, global_shape, shape, offset = _region(name, tensors[name])
        reads.append(_Read(name, target, key, global_shape, shape, offset,
                           layout_changes.get(name, layout_changes.get(bare))))
    problems = [problem for read in reads if read.change is not None and (problem := _layout_problem(read))]
    if problems:
        raise ValueError(f"layout changes do not fit the model's tensors: {'; '.join(problems)}")
    mismatched = []
    for read in reads:
        file_shape, expected = files.shapes[read.key], _expected_file_shape(read)
        if file_shape != expected and not _is_vocabulary_padding(file_shape, expected,
                                                                 getattr(config, "vocab_size", None)):
            mismatched.append(f"{read.key}: file {file_shape}, model {expected}")
    if mismatched:
        raise ValueError(f"shapes in {directory} differ from the model's: {'; '.join(mismatched)}")
    _fill(files, reads, report)
    return report


def _fill(files: PretrainedFiles, reads: list[_Read], report: LoadReport) -> None:
    """Read each shard's slice, file by file, and copy it (converting the dtype) into place."""
    from safetensors import safe_open

    by_file: dict[str, list[_Read]] = {}
    for read in reads:
        by_file.setdefault(files.weight_map[read.key], []).append(read)
    with torch.no_grad():
        for file_name, file_reads in sorted(by_file.items()):
            with safe_open(files.directory / file_name, "pt") as handle:
                for read in file_reads:
                    part = handle.get_slice(read.key)
                    file_shape = files.shapes[read.key]
                    if read.change is not None:
                        report.bytes_read += _copy_changed(part, file_shape, read)
                    else:
                        data = _read_box(part, file_shape, read.shape, read.offset)
                        read.target.copy_(data.view(read.target.shape))
                        report.bytes_read += data.numel() * data.element_size()
                    report.loaded.append(read.name)
