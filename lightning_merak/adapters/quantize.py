"""Quantize the linear layers of a model in place: bitsandbytes NF4/FP4/int8 or the project INT4.

The adapters train on top of the result. ``lm_head`` is left in float by default, as in QLoRA.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Literal, Optional

import torch
from torch import nn

from .bnb_layout import keep_bnb_training_layout
from .int4 import QuantLinearInt4, quantize_linear_layers_int4, replace_submodule
from .int4_experts import quantize_experts_int4
from .resume import refuse_mismatched_checkpoints, restore_packed_4bit

Quantization = Literal["none", "nf4", "fp4", "int8", "int4"]
QUANTIZATIONS = ("none", "nf4", "fp4", "int8", "int4")
BNB_4BIT_BLOCK = 64
"""Weights per absmax of a bitsandbytes 4-bit weight, over its row-major flattening (transformers has no option)."""


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
    4-bit layers keep bitsandbytes' dequantize-and-matmul path in eval mode too, the one training uses
    (:func:`keep_bnb_training_layout`).
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

    whole = []
    for layer in model.modules():
        if isinstance(layer, bnb.nn.Linear8bitLt):
            whole.append(layer.weight)
        elif isinstance(layer, bnb.nn.Linear4bit) and not getattr(layer, _SHARD_READY, False):
            keep_bnb_training_layout(layer)
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
    Drawing nothing (:func:`_undrawn`), so adapters attached after quantising draw what a meta build's draw.
    """
    with _undrawn():
        return _bnb_linear(linear, quantization, double_quant)


def _undrawn() -> ContextManager[None]:
    """Meanwhile the CPU generator is kept where it was: a bitsandbytes layer's constructor draws an ``nn.Linear``
    init its quantised weight replaces, which an adapter model built on meta, quantised only once materialised (after
    its adapters drew), never draws."""
    return torch.random.fork_rng(devices=[])


def _bnb_linear(linear: nn.Linear, quantization: Quantization, double_quant: bool) -> nn.Module:
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
        keep_bnb_training_layout(layer)
        restore_packed_4bit(layer)
    else:
        raise ValueError(f"quantized_linear: {quantization!r} is not a bitsandbytes quantization (nf4, fp4, int8)")
    if has_bias:
        layer.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    return layer.to(device)


def shard_quantization_problem(quantization: str, name: str, in_features: int, out_features: int,
                               tensor_parallel: int, *, column: bool, contiguous: bool = True,
                               group_size: int = 32, double_quant: bool = False) -> Optional[str]:
    """Why quantising each tensor-parallel shard of ``name`` would not give the whole model's quantisation, or None:
    every problem of :func:`double_quant_problem` and :func:`shard_block_problem`, named together."""
    problems = [problem for problem in (
        double_quant_problem(quantization, double_quant, tensor_parallel),
        shard_block_problem(quantization, name, in_features, tensor_parallel, column=column, contiguous=contiguous,
                            group_size=group_size)) if problem is not None]
    return "; and ".join(problems) or None


def double_quant_problem(quantization: str, double_quant: bool, tensor_parallel: int) -> Optional[str]:
    """Why bitsandbytes' double quantisation cannot quantise tensor-parallel shards, or None.

    It rounds the absmax themselves in blocks of 256 around one offset (their mean) per weight tensor; a row shard's
    absmax are strided through those blocks, and every shard's mean is its own, so it is refused at any role
    (measured: per-shard nested statistics move weights by up to 2x the nested rounding, adapter gradients by 8%).
    """
    if quantization not in ("nf4", "fp4") or not double_quant or tensor_parallel <= 1:
        return None
    return (f"tensor_parallel={tensor_parallel} would round the {quantization} block statistics per shard (double "
            "quantisation keeps them in 8-bit blocks of 256 around one offset per whole weight, which no shard "
            "holds), so no shard would be the whole model's quantisation; set adapter.double_quant=false (absmax in "
            "float32: 4.5 instead of 4.13 bits a weight), or tensor_parallel=1")


def shard_block_problem(quantization: str, name: str, in_features: int, tensor_parallel: int, *, column: bool,
                        contiguous: bool = True, group_size: int = 32) -> Optional[str]:
    """Why a quantisation block of ``name`` would cross its tensor-parallel shards, or None.

    A shard's dequantised weight equals its slice of the whole model's where every quantisation block of the whole
    lies inside one shard and is read back alike. INT4 groups are ``group_size`` inputs of one row, so a row layer's
    shard width ``in / tp`` must be a multiple of the group. bitsandbytes 4-bit blocks are 64 consecutive weights of
    the row-major weight, but its CPU kernel (0.50) dequantises weight ``(i, j)`` with absmax
    ``i * (in // 64) + j // 64`` (``in`` a multiple of 16): its own block's only where every row is whole blocks.
    Elsewhere a column shard, its rows numbered from 0, reads other absmax for them than the whole layer does (every
    rank but the first), however its rows were chosen. So a column shard needs ``in`` a multiple of 64, a row shard
    ``in / tp`` (tests/test_adapters_tp_quantized.py). ``contiguous`` (this rank holds its part of the rows in order)
    only words the message. LLM.int8 scales whole rows: a column shard holds whole rows, a row shard takes the whole
    row's absmax from the group (:func:`quantized_shard`), so int8 always splits exactly.
    """
    if quantization in ("none", "int8") or tensor_parallel <= 1:
        return None
    block, what = ((group_size, f"int4's group_size={group_size}") if quantization == "int4"
                   else (BNB_4BIT_BLOCK, f"{quantization}'s block of {BNB_4BIT_BLOCK}"))
    if not column:
        width = in_features // tensor_parallel
        if width % block == 0:
            return None
        problem = (f"tensor_parallel={tensor_parallel} splits {name}'s {in_features} input columns into {width}, "
                   f"not a multiple of {what}")
        fits = [d for d in range(1, tensor_parallel) if in_features % d == 0 and (in_features // d) % block == 0]
    elif quantization == "int4" or in_features % block == 0:
        return None
    else:
        rows = (f"splits {name} by its output rows" if contiguous else
                f"gives each rank reordered rows of {name} (fused projections or shared key/value heads)")
        problem = (f"tensor_parallel={tensor_parallel} {rows}, whose {in_features} inputs are not a multiple of "
                   f"{what}: a block runs on into the next row, and bitsandbytes dequantises a row's blocks by the "
                   "row's index in its shard")
        fits = []
    fix = f"use tensor_parallel={max(fits)}" if fits else "use tensor_parallel=1"
    if quantization == "int4":
        fix += f" or an adapter.group_size dividing {in_features // tensor_parallel}"
    return f"{problem} (each shard is quantised on its own); {fix}, or quantization=none"


WholeRowAbsmax = Callable[[torch.Tensor], torch.Tensor]
"""``(this shard's per-row absmax) -> the whole row's``: a row-parallel shard takes the max over its group."""


def quantized_shard(linear: nn.Linear, quantization: Quantization, *, double_quant: bool = True,
                    group_size: int = 32, whole_row_absmax: Optional[WholeRowAbsmax] = None) -> nn.Module:
    """The quantised layer computing ``linear`` (a whole weight, or one tensor-parallel shard of it), bias-less
    shards included: bitsandbytes' or the project's INT4, as :func:`quantize_model` builds them.

    ``whole_row_absmax`` (a shard of a row-parallel layer) makes an int8 shard use its whole row's absmax, so its codes
    and scales are the whole layer's slice (LLM.int8's ``round(127 * w / absmax)``, bitsandbytes' own formula, on
    the fp16 weight); 4-bit and INT4 statistics are per block, per shard (:func:`shard_quantization_problem`).
    """
    if quantization == "int4":
        return QuantLinearInt4.from_linear(linear, group_size)
    if quantization != "int8" or whole_row_absmax is None:
        return quantized_linear(linear, quantization, double_quant)
    import bitsandbytes as bnb

    weight = linear.weight.data.to(torch.float16)
    absmax = whole_row_absmax(weight.abs().amax(dim=1).float())
    codes = torch.round(weight * (127.0 / absmax.unsqueeze(-1))).to(torch.int8)
    with _undrawn():
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                    has_fp16_weights=False, threshold=6.0, device=linear.weight.device)
    layer.weight = bnb.nn.Int8Params(codes, requires_grad=False, has_fp16_weights=False, CB=codes, SCB=absmax)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    return layer
