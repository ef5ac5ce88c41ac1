"""Adapter factors on fused expert tensors, cut to an expert-parallel rank's experts.

A LoRA factor over fused experts holds every expert's rows (``A``) or columns (``B``) side by side;
:func:`slice_expert_factor` takes one expert range of it, and :func:`shard_expert_adapters` cuts every
such adapter of a model down to the experts its rank holds, as expert parallelism does to the experts.
Other expert adapters (Q-BaRA, QA-HiRA, whose factors are ``[E, ...]``) cut themselves: any wrapper with a
``keep_expert_factors(experts, num_experts, local_only)`` method and a ``get_base_layer()`` is asked to.
"""

from __future__ import annotations

from typing import Iterable, Literal

import torch
from torch import nn

from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE

__all__ = ["Factor", "shard_expert_adapters", "slice_expert_factor"]

Factor = Literal["A", "B"]


def slice_expert_factor(kind: Factor, weight: torch.Tensor, experts: range, num_experts: int) -> torch.Tensor:
    """The rows (``A``: the first dimension, any rank) or columns (``B``) of a whole-model factor that belong to
    ``experts``."""
    if kind == "A":
        rest = weight.shape[1:]
        return weight.reshape(num_experts, -1, *rest)[experts.start:experts.stop].reshape(-1, *rest)
    rank = weight.shape[1] // num_experts
    folded = weight.reshape(weight.shape[0], rank, num_experts)[:, :, experts.start:experts.stop]
    return folded.reshape(weight.shape[0], -1)


def shard_expert_adapters(model: nn.Module, experts_modules: Iterable[nn.Module]) -> list[str]:
    """Cut every expert adapter built for all experts down to its experts module's local experts.

    :func:`~lightning_merak.plugins.moe.experts.enable_expert_parallel` calls it after slicing the experts,
    so adapters added before expert parallelism (e.g. by a model's own construction) end up where their
    experts are. Returns the names of all expert adapter factors (marked ``allreduce=False`` under
    expert parallelism, as the experts are).
    """
    from peft.tuners.lora.layer import ParamWrapper

    experts = {id(module) for module in experts_modules}
    names = []
    for name, module in model.named_modules():
        if not (hasattr(module, "keep_expert_factors") or isinstance(module, ParamWrapper)):
            continue
        if id(base := module.get_base_layer()) not in experts:
            continue
        shard = getattr(base, SHARD_ATTRIBUTE, None)
        if shard is None:
            continue
        if hasattr(module, "keep_expert_factors"):
            kept = module.keep_expert_factors(shard.experts, shard.num_experts, local_only=shard.ep_size > 1)
            names += [f"{name}.{factor}" for factor in kept]
            continue
        whole = int(module.num_experts)
        if whole not in (shard.num_experts, len(shard.experts)):
            raise ValueError(f"{name} adapts {whole} experts; its layer has {shard.num_experts}")
        for kind in ("A", "B"):
            for adapter, layer in getattr(module, f"lora_{kind}").items():
                if whole != len(shard.experts):
                    weight = layer.weight
                    local = slice_expert_factor(kind, weight.data, shard.experts, whole).clone()
                    layer.weight = nn.Parameter(local, requires_grad=weight.requires_grad)
                if shard.ep_size > 1:
                    layer.weight.allreduce = False  # type: ignore[attr-defined]
                names.append(f"{name}.lora_{kind}.{adapter}.weight")
        module.num_experts = len(shard.experts)
    return names
