"""fp8 training of the blocks' linear layers with torchao (``strategy.float8=rowwise|tensorwise|mxfp8``).

Each ``nn.Linear`` inside a transformer block whose shape benefits (:func:`benefits_from_float8`) is swapped for
torchao's float8 training layer: inputs, weights and output gradients are cast to fp8 with dynamic scales (one per
tensor for ``tensorwise``, one per row for ``rowwise``, one per 32 elements for ``mxfp8``) and multiplied by fp8
GEMMs; the master weights, their gradients and the optimizer stay in the run's precision, so checkpoints, ZeRO and
FSDP2 see ordinary parameters under unchanged names. Embeddings, the LM head, norms and routers stay as they are.

Which layers: both dimensions a multiple of 16 (the fp8 GEMM needs it) and both at least
:data:`MIN_FEATURES` — below that the casts and scale reductions cost more than the fp8 GEMM saves (torchao's
roofline tables put the break-even near K = N = 1024 on H100-class GPUs). A layer split over tensor-parallel ranks
(``ColumnParallelLinear`` / ``RowParallelLinear``) is judged by the GEMM each rank runs, its shard's shape, and
keeps its own collectives: only its local matmul becomes torchao's fp8 matmul (:class:`Float8Matmul`). Scales are
then taken over what each rank multiplies — its shard of the weight, of a row layer's input and of a column
layer's output gradient — so never coarser than the whole layer's: results stay close to one fp8 process, not
bit-equal (as under data parallelism, where rowwise weight-gradient scales span only a rank's tokens). A split
layer's weight gradient is formed in the fp8 backward, not deferred behind its group's input-gradient collective
(``tp_overlap``'s weight-gradient overlap leaves such layers out). A device is checked before any work: a
tiny fp8 GEMM (``torch._scaled_mm``) must run on it (CUDA: compute capability 8.9 or newer; CPU: torch's own
kernel, correct but not faster — for tests), and ``mxfp8`` needs CUDA compute capability 10.0 (Blackwell).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

from lightning_merak.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["FLOAT8_RECIPES", "MIN_FEATURES", "Float8Matmul", "benefits_from_float8", "convert_blocks_to_float8",
           "float8_layout_problem", "float8_problem"]

FLOAT8_RECIPES = ("tensorwise", "rowwise", "mxfp8")
MIN_FEATURES = 1024
"""The smallest input and output width converted (see the module's docstring)."""


def benefits_from_float8(layer: nn.Module, min_features: int = MIN_FEATURES) -> bool:
    """Whether ``layer`` is an ``nn.Linear`` whose fp8 GEMM runs (dimensions multiples of 16) and pays (both at
    least ``min_features``)."""
    if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
        if layer.quantized is not None:  # a quantised frozen shard (an adapter's base) runs its own GEMM
            return False
        dims = layer.local_features()
    elif isinstance(layer, nn.Linear):
        dims = (layer.in_features, layer.out_features)
    else:
        return False
    return all(dim % 16 == 0 and dim >= min_features for dim in dims)


def float8_layout_problem(recipe: str, tensor_parallel: int) -> Optional[str]:
    """Why ``recipe`` cannot train at ``tensor_parallel``, whatever the device, or None."""
    if recipe not in FLOAT8_RECIPES:
        return f"float8={recipe!r} is not a recipe here; choose one of {', '.join(FLOAT8_RECIPES)} or null"
    if recipe == "mxfp8" and tensor_parallel > 1:
        return (f"float8='mxfp8' does not run at tensor_parallel={tensor_parallel} (torchao's MXFP8 training swaps "
                "whole layers, which tensor parallelism has already split); use float8='rowwise' or tensor_parallel=1")
    return None


def float8_problem(recipe: str, device: torch.device) -> Optional[str]:
    """Why ``recipe`` cannot train on ``device`` here, or None (the layout: :func:`float8_layout_problem`)."""
    if recipe not in FLOAT8_RECIPES:
        return float8_layout_problem(recipe, 1)
    if importlib.util.find_spec("torchao") is None:
        return "float8 training needs torchao; install it with pip install 'lightning-merak[fp8]'"
    if recipe == "mxfp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (10, 0):
            return ("float8='mxfp8' needs a CUDA device of compute capability 10.0 or newer (Blackwell), for its "
                    f"block-scaled fp8 GEMMs; this run's device is {_describe(device)}; use float8='rowwise'")
        return None
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return (f"float8={recipe!r} needs fp8 tensor cores (CUDA compute capability 8.9 or newer: Ada, Hopper); "
                f"this run's device is {_describe(device)}; set float8=null")
    try:
        ones = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        scale = torch.ones((), device=device)
        torch._scaled_mm(ones, ones.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    except (RuntimeError, AttributeError, TypeError) as error:
        return f"float8={recipe!r}: this torch cannot multiply fp8 matrices on {_describe(device)} ({error})"
    return None


def convert_blocks_to_float8(blocks: Iterable[tuple[str, nn.Module]], recipe: str,
                             min_features: int = MIN_FEATURES) -> list[str]:
    """Swap the linear layers of each ``(name, block)`` that :func:`benefits_from_float8` for torchao's fp8
    training layers, in place; returns the converted layers' names (``name.layer``)."""
    def keep(module: nn.Module, fqn: str) -> bool:
        return benefits_from_float8(module, min_features)

    converted: list[str] = []
    for name, block in blocks:
        chosen = [(layer_name, layer) for layer_name, layer in block.named_modules() if keep(layer, layer_name)]
        split = [layer for _, layer in chosen if isinstance(layer, (ColumnParallelLinear, RowParallelLinear))]
        if split and recipe == "mxfp8":
            raise ValueError(float8_layout_problem(recipe, 2))
        for layer in split:
            layer.float8_matmul = Float8Matmul(recipe, *layer.local_features())
        if len(split) < len(chosen):  # whole nn.Linear layers: torchao swaps them
            if recipe == "mxfp8":
                _convert_mxfp8(block, keep)
            else:
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training

                convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name(recipe),
                                           module_filter_fn=keep)
        converted += [f"{name}.{layer_name}" for layer_name, _ in chosen]
    return converted


class Float8Matmul:
    """torchao's fp8 matmul, called with a tensor-parallel layer's local tensors.

    It runs the autograd function torchao's float8 training layer runs, with that layer's configuration (taken from
    a layer built on the meta device for the shard's shape), so casts, scales and the fp8 backward are torchao's;
    nothing is swapped on a shared module, so sub-batch threads may call it at once. The function is internal to
    torchao (tested with 0.18) and looked up when made, refused with the version otherwise.
    """

    def __init__(self, recipe: str, in_features: int, out_features: int) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        try:
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        except ImportError as error:
            raise ValueError(f"float8={recipe!r} at tensor_parallel>1 needs torchao's float8 matmul (tested with "
                             f"torchao 0.18): {error}; use tensor_parallel=1 or torchao 0.18") from error
        template = nn.Sequential(nn.Linear(in_features, out_features, bias=False, device="meta"))
        layer = convert_to_float8_training(template, config=Float8LinearConfig.from_recipe_name(recipe))[0]
        self.recipe, self._function = recipe, matmul_with_hp_or_float8_args
        self._mm_config, self._config = layer.linear_mm_config, layer.config

    def __call__(self, tensor: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        device = tensor.device.type
        if torch.is_autocast_enabled(device):  # as torchao's layer: compute in the autocast dtype
            tensor = tensor.to(torch.get_autocast_dtype(device))
        output = self._function.apply(tensor, weight.t(), self._mm_config, self._config)
        return output + bias.to(output.dtype) if bias is not None else output

    def __repr__(self) -> str:
        return f"Float8Matmul({self.recipe})"


def _convert_mxfp8(block: nn.Module, keep: object) -> None:
    """torchao's MXFP8 training (a prototype: looked up where it lives in the tested torchao, refused elsewhere)."""
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_
    except ImportError as error:
        raise ValueError(f"float8='mxfp8' needs torchao's MXFP8 training (tested with torchao 0.18): {error}; "
                         "use float8='rowwise'") from error
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL)
    quantize_(block, config, filter_fn=keep)


def _describe(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type.upper()
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
