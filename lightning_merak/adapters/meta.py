"""Adapters on a model built on the meta device: attach first, quantise each rank's part once it is real.

PEFT wraps layers without reading their weights, so an adapter attaches to a meta model as to a real one
and the parameter names are those of the whole-model path. Quantisation does read the weights, so it
waits: :func:`attach_on_meta` records it as the model's ``after_materialize`` hook, and the strategy
calls that hook on each part a rank holds once its weights are in (random init or a pretrained
checkpoint's slices). Each layer is quantised as the whole-model path quantises it (the same
bitsandbytes or INT4 call on the same float weight), so the frozen base is identical. Under tensor
parallelism the split comes first and each rank quantises its shard of a split layer (any module offering
``quantize_shard``, :mod:`lightning_merak.parallel.tensor.quantized_shards` says when that equals the whole
model's quantisation, sliced). A checkpoint of such a model holds the packed base: resuming rebuilds and
quantises the float part first, then checks the frozen tensors against the checkpoint and copies the rest
(``restores_from_checkpoint`` is False).

Materialisation initialises each module by the model's own init; adapter weights instead carry a
``materialize_init`` callable drawing what their method draws (LoRA: Kaiming-uniform ``A``, zero ``B``;
Q-BaRA likewise; QA-HiRA zero or Kaiming ``H``), so training starts from the base model. Attached in the
eager build's random stream (:mod:`~lightning_merak.parallel.init_parity`), each layer records the CPU
generator's state where its method drew an adapter's weights, and the materialised weights are drawn from
there: the values the eager build (DDP's model) drew, bit for bit. Attached outside that stream, they are
drawn from per-module seeds instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from peft.tuners.lora import LoraLayer, LoraModel
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import resolve_quantization_backend
from torch import nn

from .base import PooledAdapterLayer, check_target_layer
from .int4 import check_int4_shape, replace_submodule
from .int4_experts import quantize_experts_int4
from .pooled_experts import PooledExpertsLayer
from .quantize import QUANTIZATIONS, WholeRowAbsmax, quantized_shard
from .tp_shards import SplitLayer, adapter_shard_problems, shard_refusal

__all__ = ["AFTER_MATERIALIZE", "EAGER_DRAWS", "MATERIALIZE_INIT", "DeferredQuantization", "attach_on_meta",
           "mark_adapter_inits", "recording_eager_draws"]

AFTER_MATERIALIZE = "after_materialize"
"""Attribute of a model: ``(part) -> None``, run on each part a rank holds once its weights are loaded."""
MATERIALIZE_INIT = "materialize_init"
"""Attribute of a module: ``(module) -> None``, its initialisation after materialisation (instead of the model's)."""


EAGER_DRAWS = "_merak_adapter_draws"
"""Attribute of a tuner layer: by adapter name, the CPU generator state where its method drew that adapter's weights."""

TensorInit = Callable[[torch.Tensor], None]


def kaiming_init(tensor: torch.Tensor) -> None:
    """Kaiming-uniform (a=√5) on each matrix of ``tensor``: ``nn.Linear``'s and LoRA's ``A`` init (per expert for
    factors with leading expert dimensions, as their layers draw them)."""
    for matrix in tensor.view(-1, *tensor.shape[-2:]):
        nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))


def zero_init(tensor: torch.Tensor) -> None:
    """Zeros: adapter outputs start at zero."""
    nn.init.zeros_(tensor)


def normal_init(tensor: torch.Tensor, std: float) -> None:
    """Normal(0, std) (LoRA's ``init_lora_weights="gaussian"``)."""
    nn.init.normal_(tensor, std=std)


def init_parameters(init: TensorInit, eager_draws: dict[str, torch.Tensor], module: nn.Module) -> None:
    """A ``materialize_init``: ``init`` on each of ``module``'s own parameters, one named in ``eager_draws`` drawn
    from the CPU generator state there (where the eager build drew it), the others from the current generator."""
    for name, param in module.named_parameters(recurse=False):
        if name in eager_draws:
            _draw_from(eager_draws[name], init, param.data)
        else:
            init(param.data)


def _draw_from(rng_state: torch.Tensor, init: TensorInit, tensor: torch.Tensor) -> None:
    """``init`` on ``tensor`` as the eager build drew it: on a CPU twin (same shape, strides and dtype, so the
    generator moves as it did) from CPU generator state ``rng_state``, copied in; the generator left where it was."""
    twin = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        init(twin)
    with torch.no_grad():
        tensor.copy_(twin)


def _lora_inits(layer: nn.Module, config: Any) -> dict[str, tuple[TensorInit, dict[str, torch.Tensor]]]:
    init = config.init_lora_weights
    if config.use_dora or init not in (True, "gaussian"):
        raise ValueError(f"adapter=lora on the meta device supports init_lora_weights True or 'gaussian' without "
                         f"DoRA (got init_lora_weights={init!r}, use_dora={config.use_dora}); build the model whole "
                         "(strategy=ddp) for other initialisations")
    draws = layer.__dict__.get(EAGER_DRAWS, {})
    inits: dict[str, tuple[TensorInit, dict[str, torch.Tensor]]] = {}
    for adapter in layer.lora_A:
        draw = kaiming_init if init is True else functools.partial(normal_init, std=1 / layer.r[adapter])
        inits[f"lora_A.{adapter}"] = draw, {"weight": draws[adapter]} if adapter in draws else {}
        inits[f"lora_B.{adapter}"] = zero_init, {}
    if len(getattr(layer, "lora_embedding_A", ())):  # an embedding's factors: A zero, B normal, for either init
        inits["lora_embedding_A"] = zero_init, {}
        inits["lora_embedding_B"] = functools.partial(normal_init, std=1.0), draws
    return inits


def _pooled_inits(layer: PooledAdapterLayer | PooledExpertsLayer,
                  config: Any) -> dict[str, tuple[TensorInit, dict[str, torch.Tensor]]]:
    """Mirrors the layers' ``_create_adapter_weights``: Q-BaRA ``A`` Kaiming, ``B`` zero; QA-HiRA ``H`` by ``init``."""
    kaiming = {"qbara_A"} | ({"qahira_H"} if getattr(config, "init", "zero") == "kaiming" else set())
    draws = layer.__dict__.get(EAGER_DRAWS, {})
    return {container: (kaiming_init, draws) if container in kaiming else (zero_init, {})
            for container in layer.adapter_layer_names}


def mark_adapter_inits(model: nn.Module) -> None:
    """Give every adapter weight of the PEFT ``model`` its method's ``materialize_init`` (from the eager build's
    draws where :func:`recording_eager_draws` recorded them)."""
    configs = getattr(model, "peft_config", {})
    for layer in model.modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        config = configs[layer.active_adapters[0]]
        inits = (_pooled_inits(layer, config) if isinstance(layer, (PooledAdapterLayer, PooledExpertsLayer))
                 else _lora_inits(layer, config))
        for path, (init, draws) in inits.items():
            setattr(layer.get_submodule(path), MATERIALIZE_INIT, functools.partial(init_parameters, init, draws))


_ADAPTER_DRAWING_METHODS = ((LoraLayer, "reset_lora_parameters"), (PooledAdapterLayer, "update_layer"),
                            (PooledExpertsLayer, "update_layer"))
"""Where each adapter method's weights draw, starting with their first random value: LoRA's reset (its factors'
``nn.Linear`` constructors drew before, values it overwrites), the pooled layers' ``_create_adapter_weights``."""


@contextlib.contextmanager
def recording_eager_draws() -> Iterator[None]:
    """Meanwhile, adapter layers record (:data:`EAGER_DRAWS`) the CPU generator's state where their method drew an
    adapter's weights, if that draw moved it (a meta build in the eager random stream, or an eager build)."""
    originals = [(cls, name, cls.__dict__[name]) for cls, name in _ADAPTER_DRAWING_METHODS]

    def recording(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def record(layer: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
            before = torch.get_rng_state()
            result = method(layer, adapter_name, *args, **kwargs)
            if not torch.equal(before, torch.get_rng_state()):
                layer.__dict__.setdefault(EAGER_DRAWS, {})[adapter_name] = before
            return result
        return record

    for cls, name, method in originals:
        setattr(cls, name, recording(method))
    try:
        yield
    finally:
        for cls, name, method in originals:
            setattr(cls, name, method)


@dataclass(frozen=True)
class DeferredQuantization:
    """The base quantisation of an adapter model built on meta, applied to each part a rank holds (callable)."""

    quantization: str
    group_size: int = 32
    double_quant: bool = True
    skip: tuple[str, ...] = ("lm_head",)
    experts: bool = False
    """Also store the fused expert weights in INT4 (``int4`` only), as ``quantize_model(experts=True)`` does."""

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")

    @property
    def restores_from_checkpoint(self) -> bool:
        """Whether a checkpoint of the model can fill its float part before this runs (not once quantised)."""
        return self.quantization == "none"

    def quantize_linear(self, linear: nn.Linear, whole_row_absmax: Optional[WholeRowAbsmax] = None) -> nn.Module:
        """``linear`` (a whole layer or one tensor-parallel shard) quantised as this option quantises a base."""
        return quantized_shard(linear, self.quantization, double_quant=self.double_quant,  # type: ignore[arg-type]
                               group_size=self.group_size, whole_row_absmax=whole_row_absmax)

    def __call__(self, part: nn.Module) -> None:
        """Quantise ``part``'s frozen base layers in place, then rebind the adapters to the quantised bases.

        Layers tensor parallelism split (any module with ``quantize_shard`` and ``split_geometry``) quantise this
        rank's shard of their weight, all checked first (whole quantisation blocks per shard); whole layers are
        replaced as the whole-model path replaces them.
        """
        if self.quantization == "none":
            return
        targets = _base_linears(part, self.skip)
        shards = [(name, module) for name, module in part.named_modules()
                  if callable(getattr(module, "quantize_shard", None)) and getattr(module, "weight", None) is not None
                  and not _skipped(name, self.skip)]
        for degree, layers in _split_layers(shards).items():  # the build checked its plan: a layer split elsewhere
            problem = shard_refusal(adapter_shard_problems(layers, degree, self))  # is checked here
            if problem is not None:
                raise ValueError(problem)
        if self.quantization == "int4":
            for name, linear in targets:
                check_int4_shape(name, linear.in_features, self.group_size)
            if self.experts:  # under their adapters, whose update is added to the weight only during a forward
                quantize_experts_int4(part, self.group_size)
        for name, linear in targets:
            replace_submodule(part, name, self.quantize_linear(linear))
        for _, split in shards:
            split.quantize_shard(self.quantize_linear)
        _rebind_adapters(part, {name for name, _ in targets})
        base = part.get_base_model() if hasattr(part, "get_base_model") else part
        if self.quantization in ("nf4", "fp4", "int8"):
            setattr(base, "is_loaded_in_8bit" if self.quantization == "int8" else "is_loaded_in_4bit", True)


def _split_layers(shards: list[tuple[str, nn.Module]]) -> dict[int, list[SplitLayer]]:
    """The tensor-parallel shards of a part (name, module with ``split_geometry``) as split layers, by degree."""
    layers: dict[int, list[SplitLayer]] = {}
    for name, split in shards:
        column, in_features, out_features, parts, contiguous = split.split_geometry()
        within_block = _BLOCK_PREFIX.sub("", name.removesuffix(".base_layer"), count=1)  # one problem per layer kind
        layers.setdefault(parts, []).append(SplitLayer(within_block, in_features, out_features, column, contiguous))
    return layers


_BLOCK_PREFIX = re.compile(r"^(.*?\.)?\d+\.")
"""The path to a layer's block (``base_model.model.model.layers.3.``): up to its first numbered step."""


def _base_linears(part: nn.Module, skip: tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
    """The float linear layers the whole-model path quantises: all but adapter weights and those ``skip`` names
    (a tuner layer's ``base_layer`` judged by the tuner layer's name, as before the adapter wrapped it). A LoRA layer
    split by tensor parallelism is no tuner layer any more, but keeps PEFT's ``lora_`` names for its factors."""
    adapter_weights = {id(sub) for layer in part.modules() if isinstance(layer, BaseTunerLayer)
                       for container in layer.adapter_layer_names for sub in getattr(layer, container).modules()}
    return [(name, module) for name, module in part.named_modules()
            if type(module) is nn.Linear and id(module) not in adapter_weights
            and not any(step.startswith("lora_") for step in name.split(".")) and not _skipped(name, skip)]


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    """Whether the layer at ``name`` stays float: its name (a tuner layer's, for its base) ends with one of ``skip``."""
    return name.removesuffix(".base_layer").split(".")[-1] in skip


def _rebind_adapters(part: nn.Module, quantized: set[str]) -> None:
    """After their bases were quantised: pooled layers pick the quantised backend (and recheck INT4 alignment);
    a LoRA layer whose base is among the ``quantized`` names is replaced by PEFT's class for that base (as
    ``get_peft_model`` on a quantised model picks), keeping all its adapter weights and settings. LoRA layers on
    bases left as they were (an embedding, a skipped head) keep the class PEFT gave them, and their weights."""
    for name, layer in list(part.named_modules()):
        if isinstance(layer, PooledAdapterLayer):
            layer.quantization_backend = resolve_quantization_backend(layer.get_base_layer())
            for adapter in layer.lambda_in:
                check_target_layer(layer.method_name, layer.layer_name, layer, layer.lambda_in[adapter],
                                   layer.lambda_out[adapter], layer.requires_group_alignment)
        elif isinstance(layer, LoraLayer) and f"{name}.base_layer" in quantized:
            adapter = layer.active_adapters[0]
            config = _peft_config_of(part, adapter)
            base = layer.get_base_layer()
            kind = type(base).__name__
            replacement = LoraModel._create_new_module(
                config, adapter, base, r=layer.r[adapter], lora_alpha=layer.lora_alpha[adapter],
                loaded_in_4bit=kind == "Linear4bit", loaded_in_8bit=kind == "Linear8bitLt")
            for attribute in (*layer.adapter_layer_names, *layer.other_param_names):
                setattr(replacement, attribute, getattr(layer, attribute))
            replace_submodule(part, name, replacement)


def _peft_config_of(part: nn.Module, adapter: str) -> Any:
    configs = getattr(part, "peft_config", None)
    if not configs or adapter not in configs:
        raise ValueError(f"the part holds LoRA layers but no PEFT config for adapter {adapter!r}")
    return configs[adapter]


def attach_on_meta(option: Any, model: nn.Module) -> nn.Module:
    """Wrap the meta ``model`` with the adapter ``option`` (an ``adapter=`` option) leaving its base in float,
    and record the option's quantisation as the model's ``after_materialize`` hook.

    Refuses, before any weight exists, what the option would refuse on a quantised base.
    """
    quantization = option.quantization.value
    if option.name == "lora" and quantization == "int4":
        raise ValueError("adapter=lora: PEFT LoRA has no layer for the project INT4 base; use nf4/fp4/int8/none")
    with recording_eager_draws():
        wrapped = dataclasses.replace(option, quantization=type(option.quantization)("none")).apply(model)
    experts = [layer for layer in wrapped.modules() if isinstance(layer, PooledExpertsLayer)]
    deferred = DeferredQuantization(quantization, option.group_size, option.double_quant,
                                    experts=bool(experts) and quantization == "int4")
    if quantization == "int4":
        _check_int4_alignment(wrapped, option.group_size, deferred.skip)
        for layer in experts:
            check_int4_shape(layer.layer_name, layer.in_features, option.group_size)
    mark_adapter_inits(wrapped)
    setattr(wrapped, AFTER_MATERIALIZE, deferred)
    return wrapped


def _check_int4_alignment(model: nn.Module, group_size: int, skip: tuple[str, ...]) -> None:
    """The INT4 checks quantising the whole model makes first: every quantised width and QA-HiRA's pooling."""
    for name, linear in _base_linears(model, skip):
        check_int4_shape(name, linear.in_features, group_size)
    for layer in model.modules():
        if isinstance(layer, (PooledAdapterLayer, PooledExpertsLayer)) and layer.requires_group_alignment:
            for lambda_in in layer.lambda_in.values():
                if lambda_in % group_size:
                    raise ValueError(
                        f"{layer.method_name}: layer '{layer.layer_name}' will be INT4 with group_size={group_size}, "
                        f"misaligned with lambda_in={lambda_in}: the exact merge needs lambda_in to be a multiple of "
                        f"the group size. Set lambda_in={group_size} or quantize with a group size dividing "
                        f"{lambda_in}.")



