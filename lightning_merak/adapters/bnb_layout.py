"""bitsandbytes 4-bit layers kept in the layout their training path reads (its CPU inference repacking undone and
turned off). Imports neither PEFT nor bitsandbytes: a model with bitsandbytes layers has imported it already."""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["keep_bnb_training_layout", "restore_bnb_cpu_layout"]


def keep_bnb_training_layout(model: nn.Module) -> None:
    """Keep every bitsandbytes 4-bit layer of ``model`` on its dequantize-and-matmul path, in eval mode too.

    Why: on hosts with AVX512-BF16, bitsandbytes 0.50 repacks a 4-bit weight in place at an eval-mode forward
    without autograd, for a fused inference kernel, and from then on every forward of the layer, training ones
    included, runs that kernel, which has no backward: after a validation loop the gradient stops at each frozen
    base layer (the adapters below it train on a wrong gradient, silently), and a base with a bias fails
    (``a view of a leaf Variable ... in-place``). A layer already repacked is unpacked first.
    """
    if "bitsandbytes" not in sys.modules:  # no bitsandbytes layer without it
        return
    import bitsandbytes as bnb

    for layer in model.modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            restore_bnb_cpu_layout(layer)
            layer.support_avx512bf16_for_cpu = False


def restore_bnb_cpu_layout(base_layer: nn.Module) -> None:
    """Undo bitsandbytes' in-place CPU repacking (done by eval-mode forwards on AVX512-BF16 hosts).

    PEFT's dequantize ignores the packed layout and would read garbage, so this runs before any merge.
    """
    weight = getattr(base_layer, "weight", None)
    quant_state = getattr(weight, "quant_state", None)
    if not getattr(quant_state, "packing_format_for_cpu", False):
        return
    import bitsandbytes.functional as bnb_functional

    if not hasattr(bnb_functional, "_convert_weight_packed_for_cpu_inverse"):
        raise RuntimeError(
            "bitsandbytes repacked this 4-bit weight for CPU inference and offers no inverse; "
            "merge in train() mode before any eval forward"
        )
    weight.data, weight.quant_state = bnb_functional._convert_weight_packed_for_cpu_inverse(weight.data, quant_state)
