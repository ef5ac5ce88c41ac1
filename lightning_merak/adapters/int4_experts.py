"""Fused expert tensors stored in the project INT4 format, dequantized for the forward.

transformers 5 reads a family's routed experts by attribute (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``,
``[E, in, out]`` where the experts module is ``is_transposed``), so the quantized tensor stays an attribute: the
packed codes replace the parameter and a ``torch.nn.utils.parametrize`` parametrization
(:class:`Int4ExpertTensor`) dequantizes them whenever the attribute is read. The eager loop, ``merak_grouped``
and ``merak_ep`` therefore compute with the dequantized weight unchanged.

Each expert is quantized as :func:`~lightning_merak.adapters.int4.quantize_int4` quantizes a Linear weight: groups
of ``G`` consecutive *inputs* of one output row, ``W[e, o, i] = scale[e, o, g] * (q[e, o, i] - zero[e, o, g])``,
zero-points kept in float32. A pooled adapter whose update is constant on every group (``lambda_in % G == 0``)
merges exactly by shifting the zero-points (:meth:`Int4ExpertTensor.shift_zeros`), as into ``QuantLinearInt4``.

bitsandbytes has no layer for a 3D tensor and no zero-point (its merges re-quantize, lossy), so the
quantized expert base is the project INT4 only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from .int4 import check_int4_shape, dequantize_int4, quantize_int4

__all__ = ["FUSED_EXPERT_WEIGHTS", "Int4ExpertTensor", "dequantize_experts_int4", "int4_expert_tensor",
           "quantize_experts_int4"]

FUSED_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
"""The fused 3D expert weights of transformers 5's experts modules (biases are left in float)."""


class Int4ExpertTensor(nn.Module):
    """Parametrization dequantizing packed INT4 codes ``[E, out, in/2]`` to the expert tensor the module reads.

    Holds the scales and float zero-points ``[E, out, in/G]``; ``transposed`` returns ``[E, in, out]`` for experts
    modules that store their weights that way. Once cut to this rank's experts (:meth:`keep_experts`) its buffers are
    this rank's, as the codes are (``allreduce = False``), so no data-parallel broadcast may overwrite them.
    """

    def __init__(self, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, transposed: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.group_size = group_size
        self.transposed = transposed
        self.dtype = dtype
        self.holds_local_experts = False
        """Whether the buffers hold this rank's experts only (:meth:`keep_experts`): not replicated over data
        parallelism (:func:`lightning_merak.util.buffers.replicated_buffers` leaves them out)."""

    @property
    def num_experts(self) -> int:
        return int(self.scales.shape[0])

    def dequantize(self, packed: torch.Tensor) -> torch.Tensor:
        """The float32 ``[E, out, in]`` weights the codes and (shifted) zero-points stand for."""
        return dequantize_experts_int4(packed, self.scales, self.zeros)

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        weight = self.dequantize(packed).to(self.dtype)
        return weight.transpose(-2, -1) if self.transposed else weight

    def shift_zeros(self, group_delta: torch.Tensor) -> None:
        """Add ``group_delta[e, o, g]`` to every weight of group ``(e, o, g)``; codes and scales are untouched."""
        self.zeros.sub_(group_delta.to(self.zeros) / self.scales)

    def keep_experts(self, experts: range) -> None:
        """Keep the scales and zero-points of ``experts`` only (expert parallelism keeps this rank's experts)."""
        self.holds_local_experts = True
        self.scales = self.scales[experts.start:experts.stop].clone()
        self.zeros = self.zeros[experts.start:experts.stop].clone()


def dequantize_experts_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The float32 ``[E, out, in]`` expert weights of packed codes ``[E, out, in/2]`` with their scales and
    zero-points ``[E, out, in/G]``."""
    experts, rows = packed.shape[:2]
    flat = dequantize_int4(packed.reshape(experts * rows, -1), scales.reshape(experts * rows, -1),
                           zeros.reshape(experts * rows, -1))
    return flat.reshape(experts, rows, -1)


def int4_expert_tensor(module: nn.Module, name: str) -> Optional[Int4ExpertTensor]:
    """The :class:`Int4ExpertTensor` behind ``module.<name>``, or None when that tensor is not INT4."""
    if not parametrize.is_parametrized(module, name):
        return None
    return next((p for p in module.parametrizations[name] if isinstance(p, Int4ExpertTensor)), None)


def _expert_weights(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(module name, module, tensor)`` of every float 3D fused expert weight of ``model``."""
    found = []
    for module_name, module in model.named_modules():
        for tensor in FUSED_EXPERT_WEIGHTS:
            param = module._parameters.get(tensor)
            if isinstance(param, nn.Parameter) and param.ndim == 3 and param.dtype.is_floating_point:
                found.append((module_name, module, tensor))
    return found


def quantize_experts_int4(model: nn.Module, group_size: int) -> list[str]:
    """Store every fused 3D expert weight of ``model`` as INT4 (groups of ``group_size`` inputs), in place.

    Every tensor is checked before any is replaced; returns the quantized tensors' names. The codes become
    frozen ``uint8`` parameters under ``<module>.parametrizations.<tensor>.original``.
    """
    targets = _expert_weights(model)
    for module_name, module, tensor in targets:
        shape = getattr(module, tensor).shape
        in_features = shape[1] if getattr(module, "is_transposed", False) else shape[2]
        check_int4_shape(f"{module_name}.{tensor}", in_features, group_size)
    names = []
    for module_name, module, tensor in targets:
        param = getattr(module, tensor)
        transposed = bool(getattr(module, "is_transposed", False))
        weight = param.detach().transpose(-2, -1) if transposed else param.detach()
        experts, rows, columns = weight.shape
        packed, scales, zeros = quantize_int4(weight.reshape(experts * rows, columns), group_size)
        codes = nn.Parameter(packed.reshape(experts, rows, -1), requires_grad=False)
        codes.allreduce = getattr(param, "allreduce", True)  # type: ignore[attr-defined]
        setattr(module, tensor, codes)
        dequant = Int4ExpertTensor(scales.reshape(experts, rows, -1), zeros.reshape(experts, rows, -1), group_size,
                                   transposed, param.dtype)
        parametrize.register_parametrization(module, tensor, dequant, unsafe=True)
        names.append(f"{module_name}.{tensor}" if module_name else tensor)
    return names
