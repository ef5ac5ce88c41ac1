"""Q-BaRA and QA-HiRA on fused expert tensors: one pooled adapter per expert, added to the expert's weight.

transformers 5 keeps routed experts as 3D parameters read by attribute (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``; ``[E, in, out]`` where the experts module is ``is_transposed``). The pooled adapter's
update of expert ``e`` is a weight, ``s / lambda_in * M_e`` tiled ``lambda_out x lambda_in``
(:func:`~lightning_merak.adapters.pooling.tiled_delta_weight`, the Linear layer's math per expert), so
:class:`PooledExpertsLayer` adds it to every expert's slice through a parametrization for the duration of the
forward, as PEFT's LoRA ``ParamWrapper`` does: the eager expert loop, ``merak_grouped`` and ``merak_ep`` compute
with the adapted weight unchanged. Factors are expert-major (``qbara_A [E, r', in/lambda_in]``,
``qbara_B [E, out/lambda_out, r']``, ``qahira_H [E, out/lambda_out, in/lambda_in]``), so an expert-parallel
rank's factors are one block of the whole (:meth:`PooledExpertsLayer.keep_expert_factors`). Dropout on the pooled input
cannot be factored out of a weight: expert targets need ``dropout=0``. On INT4 experts
(:mod:`~lightning_merak.adapters.int4_experts`) the merge shifts zero-points, exact when ``lambda_in % G == 0``.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn
from torch.nn.utils import parametrize

from .int4_experts import FUSED_EXPERT_WEIGHTS, int4_expert_tensor
from .pooling import per_group_delta, tiled_delta_weight

__all__ = ["MergesIntoBase", "PooledExpertsLayer", "check_expert_target", "expert_tensor_names", "fused_shape",
           "inject_expert_layers"]


def fused_shape(module: nn.Module, tensor: str) -> tuple[int, int, int]:
    """``(experts, out, in)`` of ``module.<tensor>``, whichever way round the module stores it."""
    experts, first, second = getattr(module, tensor).shape
    return (experts, second, first) if getattr(module, "is_transposed", False) else (experts, first, second)


def check_expert_target(method: str, name: str, module: nn.Module, tensor: str, lambda_in: int, lambda_out: int,
                        dropout: float, require_group_alignment: bool) -> None:
    """Raise, naming the tensor and the fix, when ``method`` cannot adapt ``module.<tensor>`` (before any wrapping)."""
    base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
    value = getattr(base, tensor, None)
    if tensor not in FUSED_EXPERT_WEIGHTS or not isinstance(value, torch.Tensor) or value.ndim != 3:
        raise TypeError(f"{method}: target_parameters entry '{name}' is not a fused 3D expert weight "
                        f"{FUSED_EXPERT_WEIGHTS}; expert biases and other tensors are not adapted. Remove it from "
                        "target_parameters")
    if dropout:
        raise ValueError(f"{method}: dropout={dropout} on fused expert tensor '{name}': the update is added to the "
                         "expert's weight, which cannot carry dropout on the pooled input. Set dropout=0, or adapt "
                         "attention only (experts=False)")
    _, out_features, in_features = fused_shape(base, tensor)
    for label, features, factor in (("in", in_features, lambda_in), ("out", out_features, lambda_out)):
        if features % factor:
            raise ValueError(f"{method}: expert tensor '{name}' has {label}_features={features} per expert, not "
                             f"divisible by lambda_{label}={factor}. Pick lambda_{label} dividing {features} or set "
                             f"lambda_overrides={{'{tensor}': [lambda_in, lambda_out]}}")
    quantized = int4_expert_tensor(base, tensor)
    if require_group_alignment and quantized is not None and lambda_in % quantized.group_size:
        raise ValueError(f"{method}: expert tensor '{name}' is INT4 with group_size={quantized.group_size}, "
                         f"misaligned with lambda_in={lambda_in}: the exact merge needs lambda_in to be a multiple of "
                         f"the group size. Set lambda_in={quantized.group_size} (lambda_overrides={{'{tensor}': "
                         f"[{quantized.group_size}, lambda_out]}}) or quantize with a group size dividing {lambda_in}")


def expert_tensor_names(module: nn.Module) -> list[str]:
    """The fused expert weights ``module`` holds itself, as parameters or parametrized (e.g. INT4) tensors."""
    own = set(module._parameters) | set(getattr(module, "parametrizations", {}) or {})
    return sorted(name for name in own if name in FUSED_EXPERT_WEIGHTS)


def _matches(key: str, targets: set[str]) -> bool:
    return key in targets or any(key.endswith("." + target) for target in targets)


def inject_expert_layers(tuner: Any, config: Any, model: nn.Module, adapter_name: str) -> list[str]:
    """Wrap every fused expert weight ``config.target_parameters`` names (PEFT's ``_inject_parameters``).

    Tensors of one module nest their wrappers in sorted order; a tensor already wrapped by this method gets the
    new adapter added to its wrapper. Returns the adapted tensors' keys.
    """
    targets = set(config.target_parameters or [])
    sites = []
    for module_name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            continue
        position = module_name.replace(".base_layer", "")
        sites += [(position, tensor) for tensor in expert_tensor_names(module)
                  if _matches(f"{position}.{tensor}", targets)]
    for position, tensor in sites:
        parent_name, _, child_name = position.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        target = top = getattr(parent, child_name)
        while isinstance(target, BaseTunerLayer) and getattr(target, "parameter_name", None) != tensor:
            target = target.base_layer
        if not isinstance(target, PooledExpertsLayer):
            target = top
        tuner._create_and_replace(config, adapter_name, target, child_name, parent, current_key=f"{position}.{tensor}",
                                  parameter_name=tensor)
    return [f"{position}.{tensor}" for position, tensor in sites]


class _AddDelta(nn.Module):
    """Parametrization ``W -> W + delta`` (the adapters' update of every expert)."""

    def __init__(self, delta: torch.Tensor) -> None:
        super().__init__()
        self.delta = delta

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta


class MergesIntoBase:
    """``merge`` / ``unmerge`` of a pooled adapter layer through its ``_add_to_base(adapter, sign)``."""

    method_name: str
    layer_name: str
    lambda_in: dict[str, int]
    merged_adapters: list[str]

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        """Add the update to the base: exact for float bases and, by a zero-point shift, for INT4 ones."""
        for adapter_name in check_adapters_to_merge(self, adapter_names):
            if adapter_name not in self.lambda_in:
                continue
            if safe_merge and not torch.isfinite(self.pooled_matrix(adapter_name)).all():  # type: ignore[attr-defined]
                raise ValueError(f"{self.method_name}: NaN/inf in adapter '{adapter_name}' of '{self.layer_name}'")
            self._add_to_base(adapter_name, sign=1.0)  # type: ignore[attr-defined]
            self.merged_adapters.append(adapter_name)

    def unmerge(self) -> None:
        if not self.merged:  # type: ignore[attr-defined]
            warnings.warn("Already unmerged. Nothing to do.")
            return
        while self.merged_adapters:
            adapter_name = self.merged_adapters.pop()
            if adapter_name in self.lambda_in:
                self._add_to_base(adapter_name, sign=-1.0)  # type: ignore[attr-defined]


class PooledExpertsLayer(MergesIntoBase, nn.Module, BaseTunerLayer):
    """PEFT tuner layer adding ``s / lambda_in * tile(M_e)`` to expert ``e`` of one fused tensor for the forward.

    Subclasses name their parameter dicts in ``adapter_layer_names`` and build ``M`` (:meth:`pooled_matrix`).
    """

    other_param_names = ("scaling", "lambda_in", "lambda_out")
    method_name = "pooled adapter"
    requires_group_alignment = False

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: Any, lambda_in: int, lambda_out: int,
                 layer_name: str, parameter_name: str) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.layer_name = layer_name
        self.parameter_name = parameter_name
        self.scaling: dict[str, float] = {}
        self.lambda_in: dict[str, int] = {}
        self.lambda_out: dict[str, int] = {}
        for container in self.adapter_layer_names:
            setattr(self, container, nn.ParameterDict({}))
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self.num_experts, self.out_features, self.in_features = fused_shape(self.get_base_layer(), parameter_name)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, lambda_in, lambda_out)

    def _create_adapter_weights(self, adapter_name: str, config: Any) -> None:
        raise NotImplementedError

    def pooled_matrix(self, adapter_name: str) -> torch.Tensor:
        """``M`` of every expert, ``[E, out / lambda_out, in / lambda_in]``."""
        raise NotImplementedError

    def update_layer(self, adapter_name: str, config: Any, lambda_in: int, lambda_out: int,
                     inference_mode: bool = False) -> None:
        check_expert_target(self.method_name, self.layer_name, self, self.parameter_name, lambda_in, lambda_out,
                            config.dropout, self.requires_group_alignment)
        self.scaling[adapter_name] = config.scaling
        self.lambda_in[adapter_name] = lambda_in
        self.lambda_out[adapter_name] = lambda_out
        self._create_adapter_weights(adapter_name, config)
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: Optional[torch.device] = None) -> None:
        weight = getattr(self.get_base_layer(), self.parameter_name)
        for container in self.adapter_layer_names:
            parameters = getattr(self, container)
            if adapter_name in parameters and parameters[adapter_name].device.type != "meta":
                parameters[adapter_name] = nn.Parameter(parameters[adapter_name].to(weight.device, weight.dtype),
                                                        requires_grad=parameters[adapter_name].requires_grad)

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The update of every expert, laid out as the fused tensor is (``[E, out, in]`` or transposed)."""
        delta = tiled_delta_weight(self.pooled_matrix(adapter_name).float(), self.lambda_in[adapter_name],
                                   self.lambda_out[adapter_name], self.scaling[adapter_name])
        return delta.transpose(-2, -1) if getattr(self.get_base_layer(), "is_transposed", False) else delta

    def keep_expert_factors(self, experts: range, num_experts: int, local_only: bool) -> list[str]:
        """Cut factors built for ``num_experts`` experts to ``experts`` (this rank's); ``local_only`` marks them
        ``allreduce=False`` (their gradient already sums every rank's tokens). Returns the factors' names."""
        names = []
        for container in self.adapter_layer_names:
            parameters = getattr(self, container)
            for adapter in list(parameters):
                weight = parameters[adapter]
                if weight.shape[0] != len(experts):
                    if weight.shape[0] != num_experts:
                        raise ValueError(f"{self.layer_name}: {container} holds {weight.shape[0]} experts; its layer "
                                         f"has {num_experts}")
                    parameters[adapter] = nn.Parameter(weight.data[experts.start:experts.stop].clone(),
                                                       requires_grad=weight.requires_grad)
                if local_only:
                    parameters[adapter].allreduce = False  # type: ignore[attr-defined]
                names.append(f"{container}.{adapter}")
        self.num_experts = len(experts)
        return names

    def _add_to_base(self, adapter_name: str, sign: float) -> None:
        base = self.get_base_layer()
        quantized = int4_expert_tensor(base, self.parameter_name)
        if quantized is None:
            weight = getattr(base, self.parameter_name)
            weight.data += sign * self.get_delta_weight(adapter_name).to(weight.dtype)
            return
        lambda_in = self.lambda_in[adapter_name]
        if lambda_in % quantized.group_size:
            raise ValueError(f"{self.method_name}: cannot merge exactly into INT4 experts '{self.layer_name}': "
                             f"lambda_in={lambda_in} is not a multiple of group_size={quantized.group_size}. Train "
                             f"with lambda_in a multiple of {quantized.group_size}, or keep the adapter separate")
        quantized.shift_zeros(sign * per_group_delta(self.pooled_matrix(adapter_name).float(), lambda_in,
                                                     self.lambda_out[adapter_name], self.scaling[adapter_name],
                                                     quantized.group_size))

    def unload_and_optionally_merge_module(self, merge: bool, safe_merge: bool,
                                           adapter_names: Optional[list[str]]) -> nn.Module:
        """Merge this wrapper and the wrappers nested inside it (other tensors of the module); the experts module."""
        layer: nn.Module = self
        while isinstance(layer, BaseTunerLayer):
            if merge:
                layer.merge(safe_merge=safe_merge, adapter_names=adapter_names)
            layer = layer.base_layer
        return layer

    @contextmanager
    def _adapted_weight(self, adapters: list[str]) -> Iterator[None]:
        base = self.get_base_layer()
        delta = sum(self.get_delta_weight(name) for name in adapters)
        # Not read through the attribute: inside another wrapper's cached() forward that would cache it unadapted.
        stored = base.parametrizations[self.parameter_name].original if parametrize.is_parametrized(
            base, self.parameter_name) else base._parameters[self.parameter_name]
        quantized = int4_expert_tensor(base, self.parameter_name)
        dtype = quantized.dtype if quantized is not None else stored.dtype
        requires_grad = stored.requires_grad
        parametrize.register_parametrization(base, self.parameter_name, _AddDelta(delta.to(dtype)), unsafe=True)
        base.parametrizations[self.parameter_name].original.requires_grad_(requires_grad)
        try:
            with parametrize.cached():
                yield
        finally:
            chain = base.parametrizations[self.parameter_name]
            if len(chain) == 1:
                parametrize.remove_parametrizations(base, self.parameter_name, leave_parametrized=False)
            else:
                del chain[max(i for i, p in enumerate(chain) if isinstance(p, _AddDelta))]

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        adapters = [name for name in self.active_adapters if name in self.lambda_in]
        if self.merged or not adapters:
            return self.base_layer(x, *args, **kwargs)
        with self._adapted_weight(adapters):
            return self.base_layer(x, *args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.method_name.lower().replace('-', '')}[{self.parameter_name}]." + super().__repr__()
