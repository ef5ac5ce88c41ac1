"""Adapters on MoE models: LoRA on attention and on fused expert tensors, per-expert adapters sharded with experts.

transformers 5 keeps a family's routed experts as fused 3D parameters (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``) that the experts registry reads by attribute. PEFT's LoRA on ``nn.Parameter``
(``target_parameters``, ``ParamWrapper``) adds ``scaling * B_e A_e`` to every expert's slice through a
parametrization for the duration of the forward, so ``merak_grouped`` and ``merak_ep`` compute with the
adapted weight unchanged. A PEFT model built after
:func:`~lightning_merak.plugins.moe.experts.enable_expert_parallel` holds the adapters of this rank's
experts only, and one built before is cut down by it (:func:`shard_expert_adapters`): an expert's
adapter lives where the expert does. Q-BaRA and QA-HiRA adapt attention projections as Linear layers and the
fused expert tensors with one pooled adapter per expert (:mod:`~lightning_merak.adapters.pooled_experts`, the
same weight-through-a-parametrization route), on float or INT4 experts
(:func:`~lightning_merak.adapters.int4_experts.quantize_experts_int4`).

Layout (PEFT's, kept so a saved adapter loads into an unsharded ``PeftModel``): ``lora_A`` is
``[E * r, in]`` expert-major, ``lora_B`` is ``[out, r * E]`` with the expert index fastest; the pooled
adapters' factors (``qbara_A``, ``qbara_B``, ``qahira_H``) are ``[E, ...]``, expert-major like ``lora_A``. The pure
functions :func:`slice_expert_factor` / :func:`join_expert_factors` move between the whole factor and a
rank's contiguous experts; :func:`expert_adapter_state_dict`, :func:`save_moe_adapter`,
:func:`load_moe_adapter` and :func:`merged_state_dict` are the collective wrappers over the expert group.
:func:`factor_view` and :func:`expert_factor_shards` let checkpoints store each rank's factors as slices of the
whole (:class:`~lightning_merak.checkpoint.sharded.ExpertSlices`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.adapters.int4_experts import FUSED_EXPERT_WEIGHTS
from lightning_merak.adapters.pooled_experts import PooledExpertsLayer, expert_tensor_names
from lightning_merak.adapters.qahira import QAHiRAConfig
from lightning_merak.adapters.qbara import QBaRAConfig
from lightning_merak.plugins.moe.experts.adapter_slices import Factor, shard_expert_adapters, slice_expert_factor
from lightning_merak.plugins.moe.experts.enable import experts_modules
from lightning_merak.plugins.moe.experts.grouped import EXPERT_TENSORS
from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE

__all__ = [
    "ATTENTION_PROJECTIONS",
    "EXPERT_PROJECTIONS",
    "ExpertAdapter",
    "add_moe_adapters",
    "expert_adapter_parameters",
    "expert_adapter_state_dict",
    "expert_adapters",
    "expert_factor_shards",
    "expert_target_parameters",
    "expert_factors",
    "factor_view",
    "join_expert_factors",
    "load_moe_adapter",
    "merged_state_dict",
    "moe_adapter_config",
    "save_moe_adapter",
    "shard_expert_adapters",
    "slice_expert_factor",
]

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                         "kv_b_proj")
"""Attention projection names of the six families (MLA's low-rank projections included)."""

EXPERT_PROJECTIONS = FUSED_EXPERT_WEIGHTS
"""Fused expert weights the adapters can target; expert biases are not adapted (no bias path in either wrapper)."""

_EXPERT_METHODS = ("LORA", "QBARA", "QAHIRA")


def join_expert_factors(kind: Factor, parts: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """The whole-model LoRA factor from the factors of contiguous expert ranges, in expert order."""
    if kind == "A":
        return torch.cat(list(parts))
    out = parts[0].shape[0]
    return torch.cat([p.reshape(out, rank, -1) for p in parts], dim=2).reshape(out, -1)


@dataclass(frozen=True)
class ExpertAdapter:
    """One adapter wrapper on a fused expert tensor (PEFT's LoRA ``ParamWrapper`` or a
    :class:`~lightning_merak.adapters.pooled_experts.PooledExpertsLayer`), with the expert shard it lives on."""

    name: str
    wrapper: nn.Module
    shard: Any

    @property
    def experts(self) -> range:
        """The global expert ids this rank's factors hold."""
        return self.shard.experts if self.shard is not None else range(int(self.wrapper.num_experts))

    @property
    def num_experts(self) -> int:
        """The layer's expert count over the whole expert group."""
        return self.shard.num_experts if self.shard is not None else int(self.wrapper.num_experts)


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return experts_modules(model)


def _shard_of(module: nn.Module) -> Any:
    return getattr(module, SHARD_ATTRIBUTE, None)


def expert_adapters(model: nn.Module) -> list[ExpertAdapter]:
    """Every adapter wrapper on a fused expert tensor of ``model`` (LoRA, Q-BaRA, QA-HiRA), by qualified name
    (named_modules order)."""
    from peft.tuners.lora.layer import ParamWrapper

    experts = {id(module) for _, module in _experts_modules(model)}
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (ParamWrapper, PooledExpertsLayer)) and id(base := module.get_base_layer()) in experts:
            shard = _shard_of(base)
            if shard is not None and int(module.num_experts) != len(shard.experts):
                raise ValueError(f"{name} adapts {module.num_experts} experts but its experts module holds "
                                 f"{len(shard.experts)}: call enable_expert_parallel before add_moe_adapters")
            found.append(ExpertAdapter(name, module, shard))
    return found


def expert_factors(adapter: ExpertAdapter) -> Iterator[tuple[str, Factor, nn.Parameter]]:
    """Every factor of ``adapter``: its parameter name under the wrapper, its kind and the parameter. ``A``
    factors hold the experts on their first dimension (LoRA's ``lora_A``, every pooled factor), ``B`` ones
    fastest on their last (LoRA's ``lora_B``)."""
    wrapper = adapter.wrapper
    if isinstance(wrapper, PooledExpertsLayer):
        for container in wrapper.adapter_layer_names:
            for key, parameter in getattr(wrapper, container).items():
                yield f"{container}.{key}", "A", parameter
        return
    for kind in ("A", "B"):
        for key, layer in getattr(wrapper, f"lora_{kind}").items():
            yield f"lora_{kind}.{key}.weight", kind, layer.weight  # type: ignore[misc]


def _sharded_factors(model: nn.Module) -> Iterator[tuple[str, Factor, Any, nn.Parameter]]:
    """Every factor of an expert adapter on a sharded experts module: its parameter name, kind, the experts
    module's ``ExpertShard`` and the parameter itself."""
    for adapter in expert_adapters(model):
        if adapter.shard is None:
            continue
        for name, kind, parameter in expert_factors(adapter):
            yield f"{adapter.name}.{name}", kind, adapter.shard, parameter


def expert_adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The LoRA factors of every expert adapter of ``model`` on a sharded experts module: reduced, clipped and
    checkpointed like the experts."""
    return [parameter for _, _, _, parameter in _sharded_factors(model)]


def factor_view(kind: Factor, factor: torch.Tensor, experts: int) -> torch.Tensor:
    """A factor (or a tensor shaped like it) of ``experts`` consecutive experts in a layout where the experts are
    one dimension: ``lora_A`` as is (``[experts·r, in]``, expert-major rows), ``lora_B [out, r·experts]`` as
    ``[out, r, experts]``, a reshape, so a rank's experts are a contiguous block of the whole factor's view."""
    return factor if kind == "A" else factor.reshape(factor.shape[0], -1, experts)


def expert_factor_shards(model: nn.Module) -> dict[str, tuple[Factor, Any]]:
    """Every LoRA factor of an expert adapter on a ``merak_ep`` experts module of ``model``, by parameter name:
    its kind and its experts module's ``ExpertShard`` (whose experts its rows or columns hold)."""
    return {name: (kind, shard) for name, kind, shard, _ in _sharded_factors(model)}


def moe_adapter_config(model: nn.Module, method: Literal["lora", "qbara", "qahira"] = "lora", *, r: int = 8,
                       alpha: float = 16.0, attention: bool = True, experts: bool = True, **options: Any) -> Any:
    """A PEFT config adapting ``model``'s attention projections and its fused expert tensors.

    Targets are read from the model: the attention projections it has (:data:`ATTENTION_PROJECTIONS`) and
    each experts module's fused weights (:data:`EXPERT_PROJECTIONS`). ``options`` go to the config class
    (e.g. ``lambda_in``, ``lambda_out``, ``lambda_overrides`` for Q-BaRA / QA-HiRA).
    """
    if method not in ("lora", "qbara", "qahira"):
        raise ValueError(f"method={method!r}: use lora, qbara or qahira")
    if not (attention or experts):
        raise ValueError("nothing to adapt: set attention=True and/or experts=True")
    present = {name.rpartition(".")[2] for name, module in model.named_modules() if hasattr(module, "in_features")}
    modules = sorted(present & set(ATTENTION_PROJECTIONS)) if attention else []
    if attention and not modules:
        raise ValueError(f"{type(model).__name__} has none of the attention projections {ATTENTION_PROJECTIONS}")
    parameters = expert_target_parameters(model) if experts else []
    if method == "lora":
        from peft import LoraConfig

        if experts and options.get("lora_dropout"):
            raise ValueError("lora_dropout must be 0 when adapting fused expert tensors (PEFT's ParamWrapper "
                             "cannot factor dropout out of the merged weight)")
        return LoraConfig(r=r, lora_alpha=alpha, target_modules=modules, target_parameters=parameters or None,
                          **options)
    config_class = QBaRAConfig if method == "qbara" else QAHiRAConfig
    return config_class(r=r, alpha=alpha, target_modules=modules, target_parameters=parameters or None, **options)


def expert_target_parameters(model: nn.Module) -> list[str]:
    """PEFT ``target_parameters`` naming every fused expert weight of ``model`` (:data:`EXPERT_PROJECTIONS`, float
    or INT4); refused for a model without an experts module going through transformers' experts registry."""
    experts_found = _experts_modules(model)
    if not experts_found:
        raise ValueError(f"{type(model).__name__} has no experts module going through transformers' experts "
                         "registry; adapt attention only (experts=False)")
    return sorted({f"{name.rpartition('.')[2]}.{tensor}" for name, module in experts_found
                   for tensor in expert_tensor_names(module)})


def _check_config(config: Any) -> None:
    targets = getattr(config, "target_parameters", None) or []
    if targets and getattr(config, "peft_type", None) not in _EXPERT_METHODS:
        raise ValueError(f"{config.peft_type} cannot adapt fused expert tensors; use one of {_EXPERT_METHODS}, or "
                         "leave target_parameters empty to adapt Linear layers only")
    for target in targets:
        if target.rpartition(".")[2] not in EXPERT_PROJECTIONS:
            raise ValueError(f"target_parameters entry {target!r} is not a fused expert weight "
                             f"{EXPERT_PROJECTIONS}; expert biases and other tensors are not adapted")


def add_moe_adapters(model: nn.Module, config: Any, adapter_name: str = "default") -> Any:
    """``get_peft_model(model, config)``, checked, with expert adapters marked like their experts.

    After :func:`~lightning_merak.plugins.moe.experts.enable_expert_parallel` each rank builds the adapters
    of its own experts (before it, ``enable_expert_parallel`` cuts them down); under expert parallelism
    their factors get ``allreduce=False`` (their gradient already sums every rank's tokens, as the
    experts' own does).
    """
    from peft import get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    _check_config(config)
    if any(isinstance(module, BaseTunerLayer) for module in model.modules()):
        raise ValueError(f"{type(model).__name__} already carries adapters; build the model again")
    peft_model = get_peft_model(model, config, adapter_name=adapter_name)
    shard_expert_adapters(peft_model, (module for _, module in _experts_modules(peft_model)))
    return peft_model


def _gather(tensor: torch.Tensor, shard: Any) -> list[torch.Tensor]:
    """Every expert-group rank's ``tensor``, in rank order (its own alone without expert parallelism)."""
    if shard is None or shard.ep_size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(shard.ep_size)]
    dist.all_gather(parts, tensor.contiguous(), group=shard.group)
    return parts


def _factor_keys(adapter: ExpertAdapter, state: dict[str, torch.Tensor]) -> dict[str, Factor]:
    """The keys of ``adapter``'s factors in PEFT's saved state dict ``state``, with their kinds."""
    if isinstance(adapter.wrapper, PooledExpertsLayer):
        return {f"{adapter.name}.{container}": "A" for container in adapter.wrapper.adapter_layer_names
                if f"{adapter.name}.{container}" in state}
    keys: dict[str, Factor] = {}
    for key in state:
        for kind in ("A", "B"):
            if key.startswith(f"{adapter.name}.lora_{kind}."):
                if not key.endswith(".weight"):
                    raise ValueError(f"{key}: expert adapters carry no bias (lora_bias=False)")
                keys[key] = kind  # type: ignore[assignment]
    return keys


def _parameter_key(key: str, adapter_name: str) -> str:
    """The model's parameter name of PEFT's saved key ``key`` (the adapter name put back)."""
    return key.replace(".weight", f".{adapter_name}.weight") if key.endswith(".weight") else f"{key}.{adapter_name}"


def expert_adapter_state_dict(model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """PEFT's adapter state dict with every expert factor whole (collective over each expert group).

    The same on every rank and equal to what an unsharded ``PeftModel`` holds, so it loads there as is.
    """
    from peft import get_peft_model_state_dict

    state = dict(get_peft_model_state_dict(model, adapter_name=adapter_name))
    for adapter in expert_adapters(model):
        for key, kind in _factor_keys(adapter, state).items():
            parts = _gather(state[key].detach(), adapter.shard)
            state[key] = join_expert_factors(kind, parts, int(adapter.wrapper.r[adapter_name]) if kind == "B" else 0)
    return state


def save_moe_adapter(model: nn.Module, directory: Union[str, Path], adapter_name: str = "default") -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` with whole expert factors (rank 0 writes).

    Collective over the expert groups; ``PeftModel.from_pretrained`` on the unsharded model reads it.
    """
    from safetensors.torch import save_file

    state = expert_adapter_state_dict(model, adapter_name)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.peft_config[adapter_name].save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})


def load_moe_adapter(model: nn.Module, source: Union[str, Path, dict[str, torch.Tensor]],
                     adapter_name: str = "default") -> None:
    """Load a whole-model adapter (a PEFT directory or state dict) into ``model``, each rank its experts' slice.

    A factor whose shape does not match this rank's adapter is refused before anything is loaded.
    """
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    state = dict(source) if isinstance(source, dict) else load_peft_weights(str(source), device="cpu")
    local = {}
    for adapter in expert_adapters(model):
        for key, kind in _factor_keys(adapter, state).items():
            local[key] = slice_expert_factor(kind, state[key], adapter.experts, adapter.num_experts)
    mine = model.state_dict()
    for key, value in {**state, **local}.items():
        target = _parameter_key(key, adapter_name)
        if target in mine and tuple(mine[target].shape) != tuple(value.shape):
            raise ValueError(f"{key} has shape {tuple(value.shape)}, this rank's adapter {tuple(mine[target].shape)}; "
                             "was the adapter trained with another r or another model?")
    result = set_peft_model_state_dict(model, {**state, **local}, adapter_name=adapter_name)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter keys the model has no place for: {result.unexpected_keys[:4]}")


def merged_state_dict(model: nn.Module,
                      adapter_name: Optional[str] = None) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Merge the adapters into their bases and return ``(base model, its state dict with whole experts)``.

    Collective over the expert groups. Each rank merges its own experts' adapters into its own slices
    (PEFT's ``merge_and_unload``), then the slices are gathered, so ``base.save_pretrained(dir,
    state_dict=state)`` on one rank writes what the merged unsharded model would.
    """
    base = model.merge_and_unload(adapter_names=[adapter_name] if adapter_name else None)
    state = dict(base.state_dict())
    for name, module in _experts_modules(base):
        shard = _shard_of(module)
        for tensor in EXPERT_TENSORS:
            value = getattr(module, tensor, None)
            if value is not None and shard is not None:
                state[f"{name}.{tensor}"] = torch.cat(_gather(value.detach(), shard))
    return base, state
