"""What Q-BaRA and QA-HiRA share: config fields, the PEFT tuner layer and the tuner model.

The two methods differ only in the pooled matrix ``M`` (``B @ A`` or ``H``); everything else
(pooling, expansion, scaling, validation, merging into float, bitsandbytes or INT4 bases) lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

import torch
from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer, _maybe_include_all_linear_layers
from peft.utils import (
    INCLUDE_LINEAR_LAYERS_SHORTHAND,
    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING,
    TaskType,
    resolve_quantization_backend,
)
from peft.utils.constants import SEQ_CLS_HEAD_NAMES
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from lightning_merak.util.values import is_count, is_finite_number

from .bnb_layout import keep_bnb_training_layout, restore_bnb_cpu_layout
from .int4 import QuantLinearInt4
from .pooled_experts import (
    MergesIntoBase,
    PooledExpertsLayer,
    check_expert_target,
    expert_tensor_names,
    inject_expert_layers,
)
from .pooling import expand_outputs, per_group_delta, pool_inputs, tiled_delta_weight
from .resume import refuse_mismatched_checkpoints


@dataclass
class PooledAdapterConfig(PeftConfig):
    """Fields common to the pooled adapters.

    ``r`` and ``alpha`` give the scaling ``alpha / r`` (the nominal LoRA rank); ``lambda_in`` pools
    inputs, ``lambda_out`` expands outputs. ``lambda_overrides`` maps a module-name suffix (e.g.
    ``"down_proj"``) to ``[lambda_in, lambda_out]`` to hold a parameter budget per layer; a key matching no
    adapted module is refused when the adapter is added to a model.

    ``alpha`` must be finite and non-zero (zero would leave the model unchanged whatever is learned); a
    negative ``alpha`` is accepted: it only flips the sign of the learned update, which training absorbs.
    """

    target_modules: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Module names (suffixes) or a regex; default: LoRA's per-architecture list"}
    )
    exclude_modules: Optional[Union[list[str], str]] = field(default=None, metadata={"help": "Modules to skip"})
    target_parameters: Optional[list[str]] = field(
        default=None, metadata={"help": "Fused 3D expert weights to adapt, one pooled adapter per expert "
                                "(e.g. ['experts.gate_up_proj', 'experts.down_proj']); needs dropout=0"}
    )
    r: int = field(default=8, metadata={"help": "Nominal LoRA rank; the scaling is alpha / r"})
    alpha: float = field(default=16.0, metadata={"help": "Scaling numerator"})
    dropout: float = field(default=0.0, metadata={"help": "Dropout on the pooled input"})
    lambda_in: int = field(default=2, metadata={"help": "Input pooling factor"})
    lambda_out: int = field(default=2, metadata={"help": "Output expansion factor"})
    lambda_overrides: dict[str, list[int]] = field(
        default_factory=dict, metadata={"help": "Module-name suffix -> [lambda_in, lambda_out]"}
    )
    init: str = field(default="zero", metadata={"help": "Initialisation scheme"})
    modules_to_save: Optional[list[str]] = field(
        default=None, metadata={"help": "Modules besides the adapted ones to train fully and save (PEFT's "
                                "ModulesToSaveWrapper), e.g. a classifier head; SEQ_CLS adds 'classifier' and 'score'"}
    )

    method_name: ClassVar[str] = "pooled adapter"
    init_choices: ClassVar[tuple[str, ...]] = ("zero",)

    def __post_init__(self) -> None:
        super().__post_init__()
        method = self.method_name
        if not _is_positive_int(self.r):
            raise ValueError(f"{method}: r must be positive and an integer (the nominal LoRA rank), got r={self.r!r}; "
                             "e.g. r=8")
        if not is_finite_number(self.alpha) or self.alpha == 0:
            raise ValueError(f"{method}: alpha={self.alpha!r} must be a finite non-zero number (the adapter's output "
                             "is scaled by alpha / r; 0 leaves the model unchanged), e.g. alpha=16.0")
        if not is_finite_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{method}: dropout={self.dropout!r} must be a number in [0, 1), e.g. dropout=0.0")
        if self.init not in self.init_choices:
            raise ValueError(f"{method}: init must be one of {self.init_choices}, got {self.init!r}")
        if self.target_parameters and self.dropout:
            raise ValueError(f"{method}: dropout={self.dropout} with target_parameters: the update of a "
                             "fused expert tensor is added to its weight, which cannot carry dropout. Set dropout=0")
        for label, factor in (("lambda_in", self.lambda_in), ("lambda_out", self.lambda_out)):
            if not _is_positive_int(factor):
                raise ValueError(f"{method}: {label}={factor!r} must be a positive integer (a pooling factor "
                                 f"dividing the adapted layers' features), e.g. {label}=2")
        if not isinstance(self.lambda_overrides, dict):
            raise ValueError(f"{method}: lambda_overrides={self.lambda_overrides!r} must map module-name suffixes "
                             "to [lambda_in, lambda_out], e.g. lambda_overrides={'down_proj': [2, 2]}")
        for name, pair in self.lambda_overrides.items():
            if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(map(_is_positive_int, pair)):
                raise ValueError(f"{method}: lambda_overrides[{name!r}]={pair!r} must be two positive integers "
                                 f"[lambda_in, lambda_out], e.g. lambda_overrides={{{name!r}: [2, 2]}}")

    @classmethod
    def check_kwargs(cls, **kwargs: Any) -> dict[str, Any]:
        """Drop ``init_choices``, a class constant that configs saved by earlier versions wrote as a field."""
        kwargs.pop("init_choices", None)
        return super().check_kwargs(**kwargs)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def lambdas_for(self, module_name: str) -> tuple[int, int]:
        """``(lambda_in, lambda_out)`` for a module, honouring ``lambda_overrides`` (longest suffix wins)."""
        matches = [suffix for suffix in self.lambda_overrides if names_module(suffix, module_name)]
        if not matches:
            return self.lambda_in, self.lambda_out
        lambda_in, lambda_out = self.lambda_overrides[max(matches, key=len)]
        return lambda_in, lambda_out


def _is_positive_int(value: object) -> bool:
    return is_count(value) and value > 0  # type: ignore[operator]


def names_module(suffix: str, module_name: str) -> bool:
    """Whether ``suffix`` names ``module_name`` as PEFT's targets do: the whole name, or its tail after a dot."""
    return module_name == suffix or module_name.endswith("." + suffix)


def check_lambda_overrides(method: str, config: PooledAdapterConfig, adapted: list[str]) -> None:
    """Refuse ``lambda_overrides`` keys naming none of the ``adapted`` modules (they would be silently ignored)."""
    unmatched = [key for key in config.lambda_overrides if not any(names_module(key, name) for name in adapted)]
    if unmatched:
        suffixes = sorted({name.rpartition(".")[2] for name in adapted})
        raise ValueError(
            f"{method}: lambda_overrides keys {unmatched} match no adapted module (a key is a module's name or its "
            f"tail after a dot); the adapted modules end in {', '.join(suffixes) or 'nothing'}. Remove the keys, "
            "fix their names, or add their layers to target_modules / target_parameters."
        )


def _in_out_features(base_layer: nn.Module) -> tuple[int, int]:
    if isinstance(base_layer, Conv1D):  # GPT-2's layer stores its weight as (in, out): y = x @ W + b
        return base_layer.nx, base_layer.nf
    return base_layer.in_features, base_layer.out_features


def check_target_layer(
    method: str, name: str, module: nn.Module, lambda_in: int, lambda_out: int, require_group_alignment: bool
) -> None:
    """Raise a clear error, naming the layer and the fix, when ``method`` cannot adapt ``module``."""
    base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
    if not isinstance(base, (nn.Linear, Conv1D, QuantLinearInt4)):
        raise TypeError(
            f"{method}: layer '{name}' is a {type(base).__name__}; supported base layers are nn.Linear, "
            "transformers' Conv1D (GPT-2), bitsandbytes Linear4bit/Linear8bitLt and QuantLinearInt4. Remove it "
            "from target_modules or list it in exclude_modules."
        )
    in_features, out_features = _in_out_features(base)
    for label, features, factor in (("in", in_features, lambda_in), ("out", out_features, lambda_out)):
        if features % factor != 0:
            suffix = name.rsplit(".", 1)[-1]
            raise ValueError(
                f"{method}: layer '{name}' has {label}_features={features}, not divisible by "
                f"lambda_{label}={factor}. Pick lambda_{label} dividing {features}, set "
                f"lambda_overrides={{'{suffix}': [lambda_in, lambda_out]}}, or exclude the layer."
            )
    if require_group_alignment and isinstance(base, QuantLinearInt4) and lambda_in % base.group_size != 0:
        raise ValueError(
            f"{method}: layer '{name}' is INT4 with group_size={base.group_size}, misaligned with "
            f"lambda_in={lambda_in}: the exact merge needs lambda_in to be a multiple of the group size. "
            f"Set lambda_in={base.group_size} or quantize with a group size dividing {lambda_in}."
        )


def include_all_linear_layers(config: PooledAdapterConfig, model: nn.Module) -> None:
    """Resolve ``target_modules="all-linear"`` as PEFT does, counting QuantLinearInt4 as linear: PEFT's resolution
    knows only nn.Linear and Conv1D, so on an INT4 base it would leave nothing to adapt (NoMatchingPeftModuleError).
    The output head (and a SEQ_CLS classifier) stays out, as in PEFT; so do layers already inside a tuner layer."""
    target = config.target_modules
    if not (isinstance(target, str) and target.lower() == INCLUDE_LINEAR_LAYERS_SHORTHAND):
        return
    heads = [model.get_output_embeddings()] if isinstance(model, PreTrainedModel) else []
    if config.task_type == TaskType.SEQ_CLS:
        heads += [getattr(model, name, None) for name in SEQ_CLS_HEAD_NAMES]
    wrapped = [module.get_base_layer() for module in model.modules() if isinstance(module, BaseTunerLayer)]
    int4 = {name for name, module in model.named_modules() if isinstance(module, QuantLinearInt4)
            and not any(module is other for other in heads + wrapped)}
    _maybe_include_all_linear_layers(config, model)
    config.target_modules = set(config.target_modules) | int4


def shared_parameters(model: nn.Module) -> dict[int, list[str]]:
    """The names of every parameter held under more than one name (tied weights), by the parameter's ``id``."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return {key: found for key, found in names.items() if len(found) > 1}


def check_untied_target(method: str, name: str, module: nn.Module, tied: dict[int, list[str]]) -> None:
    """Refuse a target whose weight another module shares (``lm_head`` with tied word embeddings): the adapter
    trains, but merging it adds its update to the shared weight, so the merged model's input embeddings change too
    and it no longer computes what the adapted model did."""
    base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
    weight = getattr(base, "weight", None)
    others = [other.rpartition(".")[0] for other in tied.get(id(weight), []) if not other.startswith(f"{name}.")]
    if others:
        suffix = name.rsplit(".", 1)[-1]
        raise ValueError(
            f"{method}: layer '{name}' shares its weight with '{others[0]}' (tied word embeddings): merging the "
            f"adapter would change '{others[0]}' too, so the merged model would not compute what the adapted one "
            f"did. Remove '{suffix}' from target_modules, or untie the weights before adapting (give '{name}' its "
            "own copy of the weight and set config.tie_word_embeddings=False)."
        )


class PooledAdapterLayer(MergesIntoBase, nn.Module, BaseTunerLayer):
    """PEFT tuner layer: ``y = base(x) + s * E_out(M @ dropout(P_in(x)))``.

    Subclasses name their parameter dicts in ``adapter_layer_names`` (each name carries the PEFT
    prefix) and define how ``M`` is built and applied.
    """

    other_param_names = ("scaling", "lambda_in", "lambda_out", "adapter_dropout")
    method_name = "pooled adapter"
    requires_group_alignment = False

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: PooledAdapterConfig,
        lambda_in: int,
        lambda_out: int,
        layer_name: str,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.layer_name = layer_name
        keep_bnb_training_layout(self.get_base_layer())
        self.quantization_backend = resolve_quantization_backend(self.get_base_layer())
        self.scaling: dict[str, float] = {}
        self.lambda_in: dict[str, int] = {}
        self.lambda_out: dict[str, int] = {}
        self.adapter_dropout = nn.ModuleDict({})
        for container in self.adapter_layer_names:
            setattr(self, container, nn.ParameterDict({}))
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self.in_features, self.out_features = _in_out_features(self.get_base_layer())
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, lambda_in, lambda_out)

    def _create_adapter_weights(self, adapter_name: str, config: PooledAdapterConfig) -> None:
        raise NotImplementedError

    def pooled_matrix(self, adapter_name: str) -> torch.Tensor:
        """``M`` of shape ``(d_out / lambda_out, d_in / lambda_in)``."""
        raise NotImplementedError

    def pooled_product(self, adapter_name: str, pooled: torch.Tensor) -> torch.Tensor:
        """``M @ pooled`` on the last dimension, without forming ``M`` when it is factored."""
        raise NotImplementedError

    def update_layer(
        self,
        adapter_name: str,
        config: PooledAdapterConfig,
        lambda_in: int,
        lambda_out: int,
        inference_mode: bool = False,
    ) -> None:
        check_target_layer(
            self.method_name, self.layer_name, self, lambda_in, lambda_out, self.requires_group_alignment
        )
        self.scaling[adapter_name] = config.scaling
        self.lambda_in[adapter_name] = lambda_in
        self.lambda_out[adapter_name] = lambda_out
        dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.adapter_dropout.update(nn.ModuleDict({adapter_name: dropout}))
        self._create_adapter_weights(adapter_name, config)
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        return tiled_delta_weight(
            self.pooled_matrix(adapter_name).float(),
            self.lambda_in[adapter_name],
            self.lambda_out[adapter_name],
            self.scaling[adapter_name],
        )

    def _add_to_base(self, adapter_name: str, sign: float) -> None:
        """Merge (``sign=1``) or unmerge: exact for float and INT4 bases (zero-point shift), re-quantizing (lossy)
        for bnb."""
        base = self.get_base_layer()
        if isinstance(base, QuantLinearInt4):
            lambda_in = self.lambda_in[adapter_name]
            if lambda_in % base.group_size != 0:
                raise ValueError(
                    f"{self.method_name}: cannot merge exactly into INT4 layer '{self.layer_name}': "
                    f"lambda_in={lambda_in} is not a multiple of group_size={base.group_size}. Train with "
                    f"lambda_in a multiple of {base.group_size}, or dequantize the base (QuantLinearInt4.to_linear)."
                )
            group_delta = per_group_delta(
                self.pooled_matrix(adapter_name).float(),
                lambda_in,
                self.lambda_out[adapter_name],
                self.scaling[adapter_name],
                base.group_size,
            )
            base.shift_zeros(sign * group_delta)
            return
        delta = sign * self.get_delta_weight(adapter_name)
        if isinstance(base, Conv1D):
            delta = delta.T  # the delta is (out, in) as nn.Linear's weight; Conv1D's is (in, out)
        if self.quantization_backend is None:
            base.weight.data += delta.to(base.weight.dtype)
            return
        if not self.quantization_backend.supports_merge:
            raise TypeError(f"{self.method_name}: layer '{self.layer_name}' ({type(base).__name__}) cannot be merged")
        restore_bnb_cpu_layout(base)
        weight = self.quantization_backend.get_base_weight(base).float()
        self.quantization_backend.set_base_weight(self, weight + delta.to(weight.device))

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        input_dtype = x.dtype
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        result_dtype = result.dtype
        if self.quantization_backend is not None:
            result = self.quantization_backend.maybe_clone_base_result(result)
        for adapter_name in self.active_adapters:
            if adapter_name not in self.lambda_in:
                continue
            adapter_input = self._cast_input_dtype(x, self.adapter_dtype(adapter_name))
            pooled = self.adapter_dropout[adapter_name](pool_inputs(adapter_input, self.lambda_in[adapter_name]))
            update = expand_outputs(self.pooled_product(adapter_name, pooled), self.lambda_out[adapter_name])
            result = result + update * self.scaling[adapter_name]
        return result.to(result_dtype).to(input_dtype)

    def adapter_dtype(self, adapter_name: str) -> torch.dtype:
        return getattr(self, self.adapter_layer_names[0])[adapter_name].dtype

    def __repr__(self) -> str:
        return f"{self.method_name.lower().replace('-', '')}." + super().__repr__()


class PooledAdapterModel(BaseTuner):
    """PEFT tuner for a pooled adapter: validates every target first, then wraps it.

    ``target_modules`` name Linear layers (``layer_cls``), ``target_parameters`` fused 3D expert weights
    (``experts_layer_cls``, one adapter per expert: :mod:`~lightning_merak.adapters.pooled_experts`).
    """

    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    layer_cls: type[PooledAdapterLayer]
    experts_layer_cls: type[PooledExpertsLayer]

    @staticmethod
    def _check_target_module_exists(peft_config: PeftConfig, key: str) -> Any:
        """PEFT's suffix match, never inside a parametrization (INT4 experts' ``parametrizations.down_proj`` is
        the fused tensor's dequantization, not a ``down_proj`` Linear)."""
        if ".parametrizations." in f".{key}":
            return False
        return BaseTuner._check_target_module_exists(peft_config, key)

    def _prepare_model(self, peft_config: PooledAdapterConfig, model: nn.Module) -> None:
        include_all_linear_layers(peft_config, model)
        targets = list(peft_config.target_parameters or [])
        adapted, expert_weights = [], []
        tied = shared_parameters(model)
        for key, module in model.named_modules():
            position = key.replace(".base_layer", "")
            for tensor in expert_tensor_names(module) if targets else ():
                name = f"{position}.{tensor}"
                expert_weights.append(name)
                if any(names_module(target, name) for target in targets):
                    adapted.append(name)
                    check_expert_target(self.experts_layer_cls.method_name, name, module, tensor,
                                        *peft_config.lambdas_for(name), dropout=peft_config.dropout,
                                        require_group_alignment=self.experts_layer_cls.requires_group_alignment)
            if not key or not self._check_target_module_exists(peft_config, key):
                continue
            adapted.append(key)
            check_target_layer(
                self.layer_cls.method_name,
                key,
                module,
                *peft_config.lambdas_for(key),
                require_group_alignment=self.layer_cls.requires_group_alignment,
            )
            check_untied_target(self.layer_cls.method_name, key, module, tied)
        unmatched = [target for target in targets if not any(names_module(target, name) for name in expert_weights)]
        if unmatched:  # PEFT would adapt nothing for them, without a word
            found = sorted({".".join(name.rsplit(".", 2)[-2:]) for name in expert_weights})
            raise ValueError(f"{self.layer_cls.method_name}: target_parameters {unmatched} name no fused expert weight "
                             f"of {type(model).__name__}; "
                             + (f"its expert weights end in {', '.join(found)}" if found
                                else "it has none (a dense model: adapt its linear layers with target_modules)"))
        check_lambda_overrides(self.layer_cls.method_name, peft_config, adapted)
        refuse_mismatched_checkpoints(model)  # an adapter saved from another model is refused, not half-loaded

    def _create_and_replace(
        self,
        peft_config: PooledAdapterConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        **optional_kwargs: Any,
    ) -> None:
        lambda_in, lambda_out = peft_config.lambdas_for(current_key)
        parameter_name = optional_kwargs.get("parameter_name")
        layer_cls = self.layer_cls if parameter_name is None else self.experts_layer_cls
        if isinstance(target, layer_cls) and getattr(target, "parameter_name", None) == parameter_name:
            target.update_layer(adapter_name, peft_config, lambda_in, lambda_out)
            return
        if parameter_name is None:
            new_module = self.layer_cls(target, adapter_name, peft_config, lambda_in, lambda_out,
                                        layer_name=current_key)
        else:
            new_module = self.experts_layer_cls(target, adapter_name, peft_config, lambda_in, lambda_out,
                                                layer_name=current_key, parameter_name=parameter_name)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    def _inject_parameters(
        self, peft_config: PooledAdapterConfig, model: nn.Module, adapter_name: str, low_cpu_mem_usage: bool
    ) -> list[str]:
        """Wrap the fused expert weights ``target_parameters`` names (PEFT's own injection nests LoRA's only)."""
        return inject_expert_layers(self, peft_config, model, adapter_name)

    def _replace_module(self, parent: nn.Module, child_name: str, new_module: nn.Module, child: nn.Module) -> None:
        if isinstance(child, BaseTunerLayer) and new_module is child.get_base_layer():
            # Unloading puts the base layer back as is; PEFT's default would copy a ``weight`` INT4 layers and
            # experts modules lack.
            setattr(parent, child_name, new_module)
            return
        super()._replace_module(parent, child_name, new_module, child)
