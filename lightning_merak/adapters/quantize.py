"""Quantize the linear layers of a model in place: bitsandbytes NF4/FP4/int8 or the project INT4.

The adapters train on top of the result. ``lm_head`` is left in float by default, as in QLoRA.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from .int4 import quantize_linear_layers_int4, replace_submodule
from .int4_experts import quantize_experts_int4
from .resume import refuse_mismatched_checkpoints, restore_packed_4bit

Quantization = Literal["none", "nf4", "fp4", "int8", "int4"]
QUANTIZATIONS = ("none", "nf4", "fp4", "int8", "int4")
BNB_CPU_PACK_ROWS = 32


def bnb_cpu_packable(in_features: int, out_features: int, blocksize: int) -> bool:
    """Whether bitsandbytes' CPU inference repacking (0.50) can take a 4-bit weight of this shape.

    On hosts with AVX512-BF16, an eval-mode forward without autograd repacks the weight for a fused
    kernel, which needs whole blocks of ``BNB_CPU_PACK_ROWS`` output rows and whole quantization blocks
    per input row; any other shape crashes there (``shape '[160, 1]' is invalid`` for 96 -> 160).
    Found by trying nf4/fp4/int8, train and eval, on in/out features 1..256: train mode, forwards
    with autograd and int8 run every shape.
    """
    return out_features % BNB_CPU_PACK_ROWS == 0 and in_features % blocksize == 0


def quantize_model(
    model: nn.Module,
    quantization: Quantization,
    group_size: int = 32,
    double_quant: bool = True,
    skip: tuple[str, ...] = ("lm_head",),
    experts: bool = False,
) -> nn.Module:
    """Replace ``nn.Linear`` layers (except those named in ``skip``) by quantized ones; returns ``model``.

    ``experts=True`` also stores an MoE model's fused 3D expert weights in INT4
    (:func:`~lightning_merak.adapters.int4_experts.quantize_experts_int4`, ``int4`` only: bitsandbytes has no
    layer for a 3D tensor, and no zero-point to merge into).

    ``group_size`` applies to ``int4`` only (bitsandbytes 4-bit always uses blocks of 64) and
    ``double_quant`` to ``nf4``/``fp4`` only. bitsandbytes models get ``is_loaded_in_4bit`` /
    ``is_loaded_in_8bit`` set, so PEFT's LoRA picks its bitsandbytes layers (QLoRA baseline).
    4-bit layers whose shape bitsandbytes' CPU repacking cannot take (:func:`bnb_cpu_packable`)
    keep its generic dequantize-and-matmul path in eval mode too, the one training uses.
    The model's ``load_state_dict`` reads its checkpoints back, packed base included, and refuses one of
    another quantisation or adapter shape (:func:`~lightning_merak.adapters.resume.refuse_mismatched_checkpoints`).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if experts and quantization not in ("none", "int4"):
        raise ValueError(f"quantization={quantization!r} cannot hold fused expert tensors (bitsandbytes quantizes "
                         "Linear layers only); use int4 for quantized experts, or leave the experts in float")
    if quantization == "none":
        return refuse_mismatched_checkpoints(model)
    if quantization == "int4":
        if experts:
            quantize_experts_int4(model, group_size)
        return refuse_mismatched_checkpoints(quantize_linear_layers_int4(model, group_size, skip))
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and name.split(".")[-1] not in skip
    ]
    for name, linear in targets:
        replace_submodule(model, name, quantized_linear(linear, quantization, double_quant))
    setattr(model, "is_loaded_in_8bit" if quantization == "int8" else "is_loaded_in_4bit", True)
    return refuse_mismatched_checkpoints(model)


def prepare_fully_shard(model: nn.Module) -> list[nn.Parameter]:
    """Ready ``model``'s bitsandbytes layers for FSDP2; returns the weights FSDP2 must leave whole (int8's).

    A 4-bit weight's statistics (absmax, nested absmax, code map: ``quant_state``) are a Python attribute of
    the tensor, which FSDP2 drops when it rebuilds the parameter as a sharded ``DTensor`` and gathers a plain
    tensor. They stay whole on the layer (``layer.quant_state``, bitsandbytes' own place for them under FSDP)
    and a forward pre-hook puts them on the gathered codes, which FSDP2 shards like any frozen parameter; a
    state-dict pre-hook puts them on the shard, so checkpoints keep their quantisation state. CPU repacking
    is turned off: it rewrites ``weight.data`` in place, which would write into FSDP2's gathered buffer (eval
    forwards take the dequantize-and-matmul path training uses).

    An int8 layer reads its codes from its own state (``state.CB``, taken from the weight at its first forward)
    and writes them back into ``weight.data`` after every forward, so sharding its weight frees nothing and
    breaks the gathered parameter: it stays whole.
    """
    import bitsandbytes as bnb

    from .base import restore_bnb_cpu_layout  # lazy: PEFT

    whole = []
    for layer in model.modules():
        if isinstance(layer, bnb.nn.Linear8bitLt):
            whole.append(layer.weight)
        elif isinstance(layer, bnb.nn.Linear4bit) and not getattr(layer, _SHARD_READY, False):
            restore_bnb_cpu_layout(layer)
            layer.support_avx512bf16_for_cpu = False
            layer.quant_state = layer.weight.quant_state
            layer.register_forward_pre_hook(_statistics_onto_weight)
            layer.register_state_dict_pre_hook(_statistics_onto_weight)
            setattr(layer, _SHARD_READY, True)
    return whole


_SHARD_READY = "merak_fully_shard_ready"
"""Attribute marking a 4-bit layer :func:`prepare_fully_shard` has readied (its hooks registered once)."""


def _statistics_onto_weight(layer: nn.Module, *args: object) -> None:
    """Give the layer's weight (FSDP2's gathered codes, or its shard) the layer's quantisation statistics."""
    if getattr(layer.weight, "quant_state", None) is None:
        layer.weight.quant_state = layer.quant_state


def quantized_linear(linear: nn.Linear, quantization: Quantization, double_quant: bool = True) -> nn.Module:
    """A bitsandbytes ``nf4``/``fp4``/``int8`` layer computing ``linear`` from its quantised weight (frozen).

    One layer at a time, so a model built on the meta device quantises each rank's part as the whole model does.
    """
    import bitsandbytes as bnb

    device = linear.weight.device
    has_bias = linear.bias is not None
    if quantization == "int8":
        layer = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False, threshold=6.0
        )
        layer.weight = bnb.nn.Int8Params(linear.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
    elif quantization in ("nf4", "fp4"):
        layer = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            compute_dtype=torch.float32,
            compress_statistics=double_quant,
            quant_type=quantization,
        )
        layer.weight = bnb.nn.Params4bit(
            linear.weight.data.clone(),
            requires_grad=False,
            compress_statistics=double_quant,
            quant_type=quantization,
        )
        if not bnb_cpu_packable(linear.in_features, linear.out_features, layer.weight.blocksize):
            layer.support_avx512bf16_for_cpu = False
        restore_packed_4bit(layer)
    else:
        raise ValueError(f"quantized_linear: {quantization!r} is not a bitsandbytes quantization (nf4, fp4, int8)")
    if has_bias:
        layer.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    return layer.to(device)
