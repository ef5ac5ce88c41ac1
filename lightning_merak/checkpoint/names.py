"""One place for Hugging Face names: wrapper prefixes, transformers' own renamings, tied weights.

Both directions use transformers' machinery on a model built on the meta device (no memory):
loading renames checkpoint keys as ``from_pretrained`` does
(:func:`transformers.core_model_loading.rename_source_key` over
:func:`~transformers.conversion_mapping.get_model_conversion_mapping`), exporting reverts them as
``save_pretrained`` does (:func:`~transformers.core_model_loading.revert_weight_conversion`) and
drops tied copies as it does (:func:`~transformers.modeling_utils.remove_tied_weights_from_state_dict`).
Only pure renamings are supported: a family whose tensors transformers *converts* (stacks, splits,
permutes) is refused by name, never handled by a table of our own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import torch
from torch import nn

from lightning_merak.parallel.init_parity import eager_init_suspended

__all__ = [
    "ConvertedTensors",
    "MODEL_RECORD_KEY",
    "PEFT_LAYER_INFIX",
    "QUANTIZED_SPLITS_KEY",
    "WRAPPER_PREFIXES",
    "build_meta_model",
    "checkpoint_names",
    "export_names",
    "load_config",
    "model_record",
    "recorded_split",
    "strip_wrappers",
]

WRAPPER_PREFIXES = ("model.base_model.model.", "base_model.model.", "model.", "")
"""Prefixes a transformers model's names carry inside Lightning (``model.``) and PEFT (``base_model.model.``)."""

PEFT_LAYER_INFIX = ".base_layer."
"""PEFT keeps a wrapped layer's own weights under ``<layer>.base_layer.``."""
_SAVED_MODULE_INFIX = re.compile(r"\.modules_to_save\.[^.]+\.")
"""PEFT's trained copy of a module in ``modules_to_save`` (``lm_head.modules_to_save.default.weight``)."""
_ORIGINAL_MODULE_INFIX = ".original_module."
"""The frozen module PEFT keeps beside that copy."""

MODEL_RECORD_KEY = "hf_model"
"""Key of :func:`model_record` in a Lightning checkpoint: what an export needs besides the tensors."""

QUANTIZED_SPLITS_KEY = "quantized_splits"
"""Key, in a merak3d checkpoint's model record, of how each base layer quantised per tensor-parallel shard was split
(by the layer's unsplit name: ``dim``, ``degree``, ``shape``, ``rows``), so its shards can be put back together."""


def model_record(model: nn.Module) -> Optional[dict[str, Any]]:
    """``{"config": transformers config dict, "adapters": {name: PEFT config dict}}`` of ``model``, or None.

    Recorded in checkpoints so ``merak-export`` can rebuild names, tied weights and adapters.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    adapters = getattr(model, "peft_config", None) or {}
    return {"config": config.to_dict(), "adapters": {name: adapter.to_dict() for name, adapter in adapters.items()}}


def recorded_split(splits: Mapping[str, Any], layer: str) -> Optional[dict[str, Any]]:
    """The split :data:`QUANTIZED_SPLITS_KEY` records for ``layer`` (a checkpoint key, under the LightningModule's
    attribute: ``model.``...), which the record names within the network (the longest such name: another layer's
    may end it too); None when it records none."""
    found = [name for name in splits if layer == name or layer.endswith("." + name)]
    return splits[max(found, key=len)] if found else None


def load_config(source: Union[str, Path, Mapping[str, Any]]) -> Any:
    """A transformers ``PretrainedConfig`` from a directory, a ``config.json`` path or a ``to_dict()`` mapping."""
    from transformers import AutoConfig

    if isinstance(source, Mapping):
        values = dict(source)
        model_type = values.pop("model_type", None)
        if model_type is None:
            raise ValueError("the recorded model config has no model_type; export with --config DIR")
        return AutoConfig.for_model(model_type, **values)
    path = Path(source)
    if path.is_file():
        return load_config(json.loads(path.read_text()))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; pass a local transformers model directory")
    return AutoConfig.from_pretrained(path)


def build_meta_model(config: Any) -> nn.Module:
    """The causal LM of ``config`` on the meta device: its names, tied weights and conversions, no memory. It draws
    nothing, inside a meta build's eager random stream too, which would otherwise move the generator by a whole
    model's init before the model being built draws (a pretrained model's adapters)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), eager_init_suspended():
        return AutoModelForCausalLM.from_config(config)


def _conversions(model: nn.Module, add_legacy: bool) -> tuple[list[Any], list[Any]]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(model, add_legacy=add_legacy)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


class ConvertedTensors(ValueError, NotImplementedError):
    """A family whose checkpoint tensors transformers converts, not just renames: not implemented here (a
    ``NotImplementedError``), and a refusal of the model the user named (a ``ValueError``: the CLIs print it)."""


def _refuse_conversion(model: nn.Module, what: str) -> None:
    raise ConvertedTensors(
        f"transformers converts (not just renames) checkpoint tensors of model type {model.config.model_type!r} "
        f"when it loads or saves them ({what}); lightning-merak reads and writes only renamed tensors. "
        "Load this family with strategy=ddp (from_pretrained) and save it with save_pretrained instead."
    )


def checkpoint_names(file_keys: Iterable[str], model: nn.Module) -> dict[str, str]:
    """Module name → checkpoint key for each tensor in a checkpoint, renamed as ``from_pretrained`` renames it."""
    from transformers.core_model_loading import rename_source_key

    renamings, converters = _conversions(model, add_legacy=True)
    meta_state = model.state_dict()
    names: dict[str, str] = {}
    converted = []
    for key in file_keys:
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        if pattern is not None:
            converted.append(key)
        names[name] = key
    if converted:
        _refuse_conversion(model, ", ".join(sorted(converted)[:6]) + ", ...")
    return names


def export_names(model: nn.Module) -> dict[str, str]:
    """Module name → checkpoint key for each tensor ``save_pretrained`` writes (tied copies left out)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    kept = remove_tied_weights_from_state_dict(model.state_dict(), model)
    placeholders = {name: torch.empty(0, device="meta") for name in kept}
    by_identity = {id(tensor): name for name, tensor in placeholders.items()}
    try:
        reverted = revert_weight_conversion(model, dict(placeholders))
    except Exception as error:  # a converter's operation on placeholders: a conversion we do not apply
        _refuse_conversion(model, str(error))
    converted = [key for key, tensor in reverted.items() if id(tensor) not in by_identity]
    if converted:
        _refuse_conversion(model, ", ".join(sorted(converted)[:6]) + ", ...")
    return {by_identity[id(tensor)]: key for key, tensor in reverted.items()}


def strip_wrappers(names: Iterable[str], known: Mapping[str, Any]) -> tuple[str, dict[str, Optional[str]]]:
    """The wrapper prefix under which ``names`` match ``known`` module names, and each name's module name.

    The prefix that matches most names wins (the longest on a tie), none (``""``) where no name matches under any:
    nothing is then taken for a wrapper (PEFT's ``base_model.`` would make every name an adapter's). PEFT's
    ``.base_layer.`` is dropped, nested ones too (PEFT wraps a module once per adapted parameter:
    ``experts.base_layer.base_layer.gate_up_proj``). A module in PEFT's ``modules_to_save`` is its trained copy
    (``.modules_to_save.<adapter>.``), not the frozen ``.original_module.`` beside it. A name that does not match
    under it maps to None.
    """
    names = list(names)

    def resolve(name: str, prefix: str) -> Optional[str]:
        if not name.startswith(prefix) or _ORIGINAL_MODULE_INFIX in name:
            return None
        bare = _SAVED_MODULE_INFIX.sub(".", name[len(prefix):])
        while PEFT_LAYER_INFIX in bare:  # one replace leaves every second of adjacent infixes
            bare = bare.replace(PEFT_LAYER_INFIX, ".")
        return bare if bare in known else None

    matches = {prefix: sum(resolve(name, prefix) is not None for name in names) for prefix in WRAPPER_PREFIXES}
    best = max(WRAPPER_PREFIXES, key=matches.__getitem__) if any(matches.values()) else ""
    return best, {name: resolve(name, best) for name in names}
