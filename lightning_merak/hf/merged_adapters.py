"""Adapters merged into the base weights for ``merak-export --merge-adapters`` (:mod:`lightning_merak.hf.export`).

PEFT's merge is run on a layer of the model's own type (``nn.Linear``, ``nn.Embedding``, GPT-2's ``Conv1D`` with
``fan_in_fan_out``; any other type is refused, pointing to ``--adapter-only``), one layer at a time. An adapter on
one of tied weights (``embed_tokens`` of a ``tie_word_embeddings`` model) merges into that weight alone: its
partners (``lm_head``) are written unmerged and the config untied, as the trained model computed. LoRA on fused
expert tensors (PEFT's ``target_parameters``, one nested ``ParamWrapper`` per tensor) is merged one experts module
at a time the same way: the meta model's module wrapped by the recorded config, the checkpoint's base and factors
assigned in (``lora_B`` back from a merak3d directory's ``[out, r, E]``), PEFT's merge; that module's tensors are
held twice (read and merged) while it merges.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Iterable, Optional

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["merged_expert_parameters", "merged_weight", "refuse_unmergeable", "untie_adapted"]


def _skeleton(path: str, leaf: nn.Module) -> nn.Module:
    """A module tree holding only ``leaf``, under its name in the model, so PEFT's targets match as they did there."""
    from torch import nn

    skeleton = nn.Module()
    parent = skeleton
    *parents, name = path.split(".")
    for part in parents:
        parent.add_module(part, nn.Module())
        parent = getattr(parent, part)
    parent.add_module(name, leaf)
    return skeleton


def _inject(skeleton: nn.Module, adapters: dict[str, Any]) -> None:
    """Wrap ``skeleton`` as each recorded adapter config wrapped the model (its other targets are elsewhere)."""
    from peft import PeftConfig, inject_adapter_in_model

    import lightning_merak.adapters  # noqa: F401  # lazy: torch, PEFT (registers Q-BaRA and QA-HiRA with PEFT)

    with warnings.catch_warnings():  # "target_modules/target_parameters ... no module was matched": expected here
        warnings.filterwarnings("ignore", message=".*(were set but no|did not match any targeted).*")
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to")  # per layer type, as in training
        for name, values in adapters.items():
            narrowed = _narrowed(values, skeleton)
            if narrowed is not None:  # an adapter of other layers only (another adapter's q_proj beside its o_proj)
                inject_adapter_in_model(PeftConfig.from_peft_type(**narrowed), skeleton, adapter_name=name)


def _narrowed(values: dict[str, Any], skeleton: nn.Module) -> Optional[dict[str, Any]]:
    """A recorded adapter config with only the ``target_modules``, ``target_parameters`` and ``lambda_overrides`` that
    name what ``skeleton`` holds, or None where it names nothing ``skeleton`` holds: the others live in other layers,
    and PEFT refuses names that match nothing."""
    from lightning_merak.adapters.base import names_module  # lazy: torch, PEFT
    from lightning_merak.adapters.pooled_experts import expert_tensor_names  # lazy: torch, PEFT

    held = [name.replace(".base_layer", "") for name, _ in skeleton.named_modules()]
    held += [f"{name}.{tensor}" for name, module in skeleton.named_modules() for tensor in expert_tensor_names(module)]

    def present(key: str) -> bool:
        return any(names_module(key, name) for name in held)

    narrowed = dict(values)
    modules = values.get("target_modules")
    parameters = [key for key in values.get("target_parameters") or () if present(key)]
    if isinstance(modules, (list, tuple, set)):  # a regex string matches per layer
        held_modules = [key for key in modules if present(key)]
        if not held_modules and not parameters:
            return None
        if held_modules:  # none held: fused experts, adapted by parameter
            narrowed["target_modules"] = held_modules
    if values.get("target_parameters"):
        narrowed["target_parameters"] = [key for key in values["target_parameters"] if present(key)] or None
    if values.get("lambda_overrides"):
        narrowed["lambda_overrides"] = {key: pair for key, pair in values["lambda_overrides"].items() if present(key)}
    return narrowed


def refuse_unmergeable(model: nn.Module, layers: Iterable[str]) -> None:
    """Refuse, before anything is written, an adapted layer of ``model`` whose type :func:`merged_weight` does not
    rebuild: merged as another type, its weight would come out wrong (a ``Conv1D`` as an ``nn.Linear`` did)."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    for layer_name in layers:
        layer = model.get_submodule(layer_name)
        if not isinstance(layer, (nn.Linear, nn.Embedding, Conv1D)):
            raise ValueError(f"--merge-adapters: the adapted layer {layer_name} is a {type(layer).__name__}; the "
                             "merge rebuilds nn.Linear, nn.Embedding and transformers Conv1D layers only (and fused "
                             "experts): export the adapters alone with --adapter-only and merge them with PEFT")


def untie_adapted(model: nn.Module, hf_config: Any, adapted: Iterable[str]) -> tuple[nn.Module, dict[str, str]]:
    """``model`` rebuilt untied where an adapter is on one of a group of tied weights, and those ties (copy →
    source). The trained model read base + delta there but the unmerged base in its tied partners, so the partners
    are written apart from it and ``tie_word_embeddings`` set false: merged into the one shared tensor, the delta
    would reach every partner (as in PEFT's ``merge_and_unload``, which warns of it: PEFT issue #2777)."""
    from lightning_merak.checkpoint.names import build_meta_model  # lazy: torch

    layers = set(adapted)
    ties = {copy: source for copy, source in model.all_tied_weights_keys.items()
            if {copy.rpartition(".")[0], source.rpartition(".")[0]} & layers}
    if not ties:
        return model, ties
    hf_config.tie_word_embeddings = False
    hf_config.get_text_config().tie_word_embeddings = False
    model = build_meta_model(hf_config)
    still = sorted(set(ties) & set(model.all_tied_weights_keys))
    if still:
        raise ValueError(f"--merge-adapters: an adapter is on tied weights {still}, which tie_word_embeddings=false "
                         "does not untie in this model; export the adapters alone with --adapter-only")
    return model, ties


def merged_weight(layer_name: str, model_layer: nn.Module, base: dict[str, torch.Tensor],
                   adapter: dict[str, torch.Tensor], adapters: dict[str, Any]) -> torch.Tensor:
    """``layer_name``'s weight with every recorded adapter merged, by PEFT's own layer on a one-layer skeleton.

    The skeleton's layer has ``model_layer``'s type, so PEFT wraps it as it wrapped the live one: a GPT-2
    ``Conv1D`` (weight ``(in, out)``) gets ``fan_in_fan_out`` as PEFT sets it, an embedding its own LoRA."""
    import torch
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    weight = base["weight"]
    if not weight.is_floating_point():
        raise ValueError(f"--merge-adapters: the base of {layer_name} is stored quantized ({weight.dtype}); "
                         "train the adapter on an unquantized base (adapter.quantization=none) to export it merged")
    layer_module: nn.Module  # model_layer's type, one refuse_unmergeable passed
    if isinstance(model_layer, Conv1D):
        layer_module = Conv1D(weight.shape[1], weight.shape[0]).to(weight.dtype)
    elif isinstance(model_layer, nn.Embedding):
        layer_module = nn.Embedding(weight.shape[0], weight.shape[1], dtype=weight.dtype)
    else:
        layer_module = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in base, dtype=weight.dtype)
    skeleton = _skeleton(layer_name, layer_module)
    _inject(skeleton, adapters)
    layer = skeleton.get_submodule(layer_name)
    layer.load_state_dict({**{f"base_layer.{key}": value for key, value in base.items()}, **adapter})
    with torch.no_grad():
        layer.merge(adapter_names=list(adapters))
    return layer.get_base_layer().weight.detach()


def merged_expert_parameters(module_name: str, experts: nn.Module, stored: dict[str, torch.Tensor],
                    adapters: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The parameters of the fused experts module ``module_name`` with every recorded adapter merged.

    PEFT adapts each fused tensor with its own ``ParamWrapper``, nested around the module in PEFT's order, so
    the wrapping is PEFT's own: the meta model's module is wrapped by the recorded configs (still on meta),
    ``stored`` (the checkpoint's tensors under the wrapped module, by PEFT's names) is assigned in, and each
    wrapper merges its ``scaling·B_e A_e`` into its tensor, as ``merge_and_unload`` does on the live model. A
    ``lora_B`` a merak3d checkpoint holds as ``[out, r, E]`` is reshaped back to PEFT's ``[out, r·E]``.
    """
    import copy

    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    skeleton = _skeleton(module_name, copy.deepcopy(experts))
    _inject(skeleton, adapters)
    wrapped = skeleton.get_submodule(module_name)
    expected = wrapped.state_dict()
    if sorted(expected) != sorted(stored):
        raise ValueError(f"--merge-adapters: the recorded adapter config wraps {module_name} as "
                         f"{sorted(expected)}, the checkpoint holds {sorted(stored)}; export with the adapter "
                         "config the run trained")
    values = {}
    for key, target in expected.items():
        value = stored[key]
        if "lora_B." in key and value.ndim == 3 and value.numel() == target.numel():
            value = value.reshape(target.shape)  # as merak3d stores it
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{module_name}.{key} has shape {tuple(value.shape)} in the checkpoint, the recorded "
                             f"adapter config makes it {tuple(target.shape)}")
        values[key] = value.clone()  # merged in place; a memory-mapped checkpoint stays untouched
    wrapped.load_state_dict(values, assign=True)
    with torch.no_grad():
        for module in wrapped.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge(adapter_names=list(adapters))
    base = wrapped.get_base_layer()
    return {name: param.detach() for name, param in base.named_parameters(recurse=False)}
