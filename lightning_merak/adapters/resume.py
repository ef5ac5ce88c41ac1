"""Whole-model checkpoints of adapters on a quantised base: the packed base read back, mismatches refused.

A bitsandbytes 4-bit layer writes its packed weight and, beside it, its quantisation state
(``weight.absmax``, ``weight.quant_map``, the nested statistics and ``weight.quant_state.bitsandbytes__nf4``)
but reads none of it back into a built layer, so ``load_state_dict`` (Lightning's resume from a ``.ckpt``
included) stopped at those "unexpected" keys. :func:`restore_packed_4bit` gives a layer a load hook that
rebuilds its quantisation state from them with bitsandbytes' own ``QuantState.from_dict`` and takes the
checkpoint's packed bytes. bitsandbytes' int8 layer reads its scales (``SCB``) itself.

:func:`refuse_mismatched_checkpoints` guards a model's load: before any tensor is copied it compares, layer
by layer, the base quantisation the checkpoint holds (nf4, fp4, int8, the project's int4, or float) with
the model's, the shapes of the trainable (adapter) tensors and which adapted layers each side has, and raises
one error naming the differences and the fix, where torch would list dozens of unexpected keys and size
mismatches and PEFT's adapter load (not strict) would drop or skip adapter weights without a word.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional

import torch
from torch import nn

from .int4 import QuantLinearInt4

__all__ = ["base_quantization", "checkpoint_quantization", "quantized_layers", "refuse_mismatched_checkpoints",
           "restore_packed_4bit"]

_QUANT_STATE_KEY = "weight.quant_state.bitsandbytes__"
_QUANTIZED_SUFFIXES = (("." + _QUANT_STATE_KEY + "nf4", "nf4"), ("." + _QUANT_STATE_KEY + "fp4", "fp4"),
                       (".SCB", "int8"), (".qweight", "int4"))
_HOOKED = "merak_checkpoint_hook"
"""Attribute marking a module whose load hook is registered, so registering again adds no second one."""
_FOUR_BIT_TYPES = ("nf4", "fp4")


def base_quantization(layer: nn.Module) -> Optional[str]:
    """How a base linear layer stores its weight (``nf4``, ``fp4``, ``int8``, ``int4``, ``none``), or None
    for a module that is no base linear layer. bitsandbytes is only consulted if already imported."""
    if isinstance(layer, QuantLinearInt4):
        return "int4"
    if type(layer) is nn.Linear:
        return "none"
    bnb = sys.modules.get("bitsandbytes")  # not imported: heavy and optional, and without it no 4-bit layer
    if bnb is None:
        return None
    if isinstance(layer, bnb.nn.Linear4bit):
        return str(layer.weight.quant_type)
    if isinstance(layer, bnb.nn.Linear8bitLt):
        return "int8"
    return None


def checkpoint_quantization(state_dict: dict[str, Any], layer_prefix: str) -> Optional[str]:
    """How the checkpoint stores the layer at ``layer_prefix`` (its keys' common prefix, dot included): the
    names of :func:`base_quantization`, or None where the checkpoint does not hold that layer."""
    for quant_type in _FOUR_BIT_TYPES:
        if layer_prefix + _QUANT_STATE_KEY + quant_type in state_dict:
            return quant_type
    if layer_prefix + "SCB" in state_dict:
        return "int8"
    if layer_prefix + "qweight" in state_dict:
        return "int4"
    weight = state_dict.get(layer_prefix + "weight")
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return "none"
    return None


def quantized_layers(keys: Iterable[str]) -> dict[str, str]:
    """The layers a checkpoint's ``keys`` store quantised (their name: nf4, fp4, int8 or int4)."""
    layers = {}
    for key in keys:
        for suffix, kind in _QUANTIZED_SUFFIXES:
            if key.endswith(suffix):
                layers[key[: -len(suffix)]] = kind
    return layers


def _load_packed_4bit(layer: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load pre-hook of a bitsandbytes 4-bit layer: its quantisation state and packed bytes from the checkpoint.

    The quant-state keys are consumed here (torch would report them as unexpected); the packed weight stays
    for the regular load to copy into the weight, now shaped as the checkpoint's (a CPU-repacked weight is not).
    """
    from bitsandbytes.functional import QuantState

    stats_prefix = prefix + "weight."
    stats = {key[len(stats_prefix):]: state_dict.pop(key) for key in list(state_dict) if key.startswith(stats_prefix)}
    packed = state_dict.get(prefix + "weight")
    if not stats or packed is None:
        return
    weight = layer.weight
    quant_state = QuantState.from_dict(qs_dict=stats, device=weight.device)
    if quant_state.quant_type != weight.quant_type:
        raise ValueError(f"{prefix.rstrip('.')}: the checkpoint's base is {quant_state.quant_type}, this layer's "
                         f"{weight.quant_type}; build the model with quantization={quant_state.quant_type}")
    weight.data = torch.empty_like(packed, device=weight.device)
    weight.quant_state = quant_state
    weight.blocksize = quant_state.blocksize
    weight.compress_statistics = quant_state.nested
    weight.bnb_quantized = True
    if hasattr(layer, "quant_state"):
        layer.quant_state = quant_state


def restore_packed_4bit(layer: nn.Module) -> nn.Module:
    """Let the bitsandbytes ``Linear4bit`` ``layer`` load its own state dict back (returns it)."""
    if not getattr(layer, _HOOKED, False):
        layer.register_load_state_dict_pre_hook(_load_packed_4bit)
        setattr(layer, _HOOKED, True)
    return layer


def _mismatches(model: nn.Module, state_dict: dict[str, Any], prefix: str) -> list[str]:
    problems = []
    for name, layer in model.named_modules():
        kind = base_quantization(layer)
        stored = checkpoint_quantization(state_dict, f"{prefix}{name}." if name else prefix)
        if kind is not None and stored is not None and stored != kind:
            problems.append(f"{name}: base {stored} in the checkpoint, {kind} here")
    for name, param in model.named_parameters():
        stored_tensor = state_dict.get(prefix + name)
        if param.requires_grad and isinstance(stored_tensor, torch.Tensor) and stored_tensor.shape != param.shape:
            problems.append(f"{name}: shape {tuple(stored_tensor.shape)} in the checkpoint, {tuple(param.shape)} here")
    return problems


def _is_adapter_tensor(name: str, containers: frozenset[str]) -> bool:
    """Whether ``name`` lies under a tuner layer's adapter container (PEFT's ``<layer>.<container>.<adapter
    name>[.weight]``, e.g. ``q_proj.qbara_A.default``; a saved key with no place in the model keeps PEFT's file
    form, without the adapter name)."""
    return any(part in containers for part in name.split("."))


def _adapter_key_problem(model: nn.Module, state_dict: dict[str, Any], prefix: str) -> Optional[str]:
    """Why the checkpoint's adapter tensors do not fit ``model``'s one for one, or None: PEFT's adapter load
    (``strict=False``) drops a saved tensor with no place in the model and keeps a missing one's initial value,
    both silently, as when the adapter was trained on a model with more or fewer layers. Only the adapters the
    checkpoint holds any tensor of are checked for missing ones (loading one adapter of several is fine)."""
    containers = frozenset(name for layer in model.modules() for name in getattr(layer, "adapter_layer_names", ()))
    if not containers:
        return None
    saved = {key[len(prefix):] for key in state_dict if key.startswith(prefix)}
    saved = {name for name in saved if _is_adapter_tensor(name, containers)}
    here = {name for name, _ in model.named_parameters(remove_duplicate=False) if _is_adapter_tensor(name, containers)}
    loaded = {_adapter_name(name, containers) for name in saved & here}
    unplaced = sorted(saved - here)
    missing = sorted(name for name in here - saved if _adapter_name(name, containers) in loaded)
    if not unplaced and not missing:
        return None
    problems = [f"{len(names)} {what} (e.g. {', '.join(names[:3])})" for names, what in (
        (unplaced, "saved adapter weights match no module of this model"),
        (missing, "adapter weights of this model are not in it")) if names]
    return (f"the checkpoint's adapter does not fit this model: {'; '.join(problems)}. It was trained on a model "
            "with other layers (more or fewer blocks) or other target_modules; load it into the model it was trained "
            "on (the same model settings and adapter.target_modules)")


def _adapter_name(name: str, containers: frozenset[str]) -> str:
    """The adapter a model's adapter tensor belongs to: the part after its container."""
    parts = name.split(".")
    return next(parts[index + 1] for index, part in enumerate(parts[:-1]) if part in containers)


def _refuse_mismatches(model: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    key_problem = _adapter_key_problem(model, state_dict, prefix)
    if key_problem is not None:
        raise ValueError(key_problem)
    problems = _mismatches(model, state_dict, prefix)
    if problems:
        listed = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise ValueError(
            f"the checkpoint was made by a different adapter model ({listed}). Build the model as the run that "
            "saved it did: the same base quantization (adapter.quantization), adapter rank (adapter.r, lambda_in, "
            "lambda_out) and target_modules")


def refuse_mismatched_checkpoints(model: nn.Module) -> nn.Module:
    """Make ``model``'s ``load_state_dict`` refuse a checkpoint of another quantisation, adapter shape or adapted
    layers before copying anything, and let its bitsandbytes 4-bit layers load their packed state (returns
    ``model``). The loads of its parents (``PeftModel.from_pretrained``, Lightning's resume) run the check too."""
    bnb = sys.modules.get("bitsandbytes")  # not imported: heavy and optional, and without it no 4-bit layer
    for layer in model.modules():
        if bnb is not None and isinstance(layer, bnb.nn.Linear4bit):
            restore_packed_4bit(layer)
    if not getattr(model, _HOOKED, False):
        model.register_load_state_dict_pre_hook(_refuse_mismatches)
        setattr(model, _HOOKED, True)
    return model
