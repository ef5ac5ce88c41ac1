"""Block-wise asymmetric INT4 weights in pure torch (CPU and GPU), with export and load.

A weight ``W`` of shape ``(d_out, d_in)`` is cut into groups of ``G`` consecutive inputs per row and
stored as ``W[o, i] = scale[o, g] * (q[o, i] - zero[o, g])`` with ``g = i // G``, 4-bit codes ``q``
packed two per byte. The zero-point is kept as a float: quantization starts from an integer zero
(GPTQ/HQQ compatible), and an adapter whose update is constant on every group is merged *exactly*
by shifting it, ``zero' = zero - c / scale`` (see :meth:`QuantLinearInt4.shift_zeros`).

Export format (``save_int4_model``): a directory with the transformers ``config.json``,
``model.safetensors`` (codes as uint8, scales and zeros as float32) and ``merak_int4.json``
naming the quantized modules and their group size; :func:`load_int4_model` reads it back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

INT4_LEVELS = 15
EXPORT_FORMAT = "merak-int4-asym"
EXPORT_MANIFEST = "merak_int4.json"
EXPORT_WEIGHTS = "model.safetensors"


def check_int4_shape(name: str, in_features: int, group_size: int) -> None:
    """Raise a ValueError naming ``name`` when its inputs cannot be split into whole groups."""
    is_int = isinstance(group_size, int) and not isinstance(group_size, bool)
    if not is_int or group_size < 2 or group_size % 2 != 0:
        raise ValueError(f"{name}: INT4 group_size must be an even integer >= 2 (codes are packed two per byte), "
                         f"got {group_size!r}; e.g. group_size=32")
    if in_features % group_size != 0:
        raise ValueError(
            f"{name}: in_features={in_features} is not divisible by the INT4 group_size={group_size}; "
            f"pick a group size that divides {in_features} or leave this layer unquantized"
        )


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in [0, 15] two per byte along the last dimension (even index in the low nibble)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max INT4 quantization per (row, group): returns ``(packed codes, scales, zeros)``."""
    out_features, in_features = weight.shape
    check_int4_shape("quantize_int4", in_features, group_size)
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    # The range always contains 0 (as in GPTQ) so the integer zero-point lies in [0, 15].
    low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
    scales = ((high - low) / INT4_LEVELS).clamp(min=torch.finfo(torch.float32).tiny ** 0.5)
    zeros = torch.round(-low / scales).clamp(0, INT4_LEVELS)
    codes = torch.round(groups / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).clamp(0, INT4_LEVELS)
    codes = codes.to(torch.uint8).reshape(out_features, in_features)
    return pack_int4(codes), scales, zeros


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Reference dequantization ``scale * (q - zero)`` in float32, shape ``(d_out, d_in)``."""
    codes = unpack_int4(packed).float()
    out_features, in_features = codes.shape
    num_groups = scales.shape[-1]
    grouped = codes.reshape(out_features, num_groups, in_features // num_groups)
    weight = scales.float().unsqueeze(-1) * (grouped - zeros.float().unsqueeze(-1))
    return weight.reshape(out_features, in_features)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class QuantLinearInt4(nn.Module):
    """A linear layer whose weight is block-wise asymmetric INT4 (reference dequantize + matmul).

    Codes, scales and zero-points are frozen parameters (``requires_grad=False``, so no optimizer takes them):
    under ``data_parallel_sharding="full"`` FSDP2 shards them over the data-parallel ranks like any frozen
    weight and gathers them whole for the forward (a group of uint8 and float tensors is gathered as bytes).
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool = True) -> None:
        super().__init__()
        check_int4_shape(type(self).__name__, in_features, group_size)
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        num_groups = in_features // group_size
        # frozen parameters, not buffers: FSDP2 (data_parallel_sharding="full") shards parameters only
        self.qweight = _frozen(torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.scales = _frozen(torch.ones(out_features, num_groups))
        self.zeros = _frozen(torch.zeros(out_features, num_groups))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> QuantLinearInt4:
        """Quantize an ``nn.Linear`` (its weight is not modified)."""
        layer = cls(linear.in_features, linear.out_features, group_size, bias=linear.bias is not None)
        layer.to(linear.weight.device)
        packed, scales, zeros = quantize_int4(linear.weight, group_size)
        with torch.no_grad():
            layer.qweight.copy_(packed)
            layer.scales.copy_(scales)
            layer.zeros.copy_(zeros)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach().float())
        return layer

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4(self.qweight, self.scales, self.zeros)

    def shift_zeros(self, group_delta: torch.Tensor) -> None:
        """Add ``group_delta[o, g]`` to every weight of group ``(o, g)`` without touching codes or scales."""
        with torch.no_grad():
            self.zeros.sub_(group_delta.to(self.zeros) / self.scales)

    def to_linear(self) -> nn.Linear:
        """A dense float32 ``nn.Linear`` with the dequantized weight (exact, compression lost)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=self.qweight.device)
        linear.weight.data.copy_(self.dequantize())
        if self.bias is not None:
            linear.bias.data.copy_(self.bias.detach())
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def quantize_linear_layers_int4(model: nn.Module, group_size: int, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Replace every ``nn.Linear`` whose name does not end with an entry of ``skip`` by a QuantLinearInt4, in place.

    All layers are validated before any is replaced.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.split(".")[-1] not in skip
    ]
    for name, module in targets:
        check_int4_shape(name, module.in_features, group_size)
    for name, module in targets:
        replace_submodule(model, name, QuantLinearInt4.from_linear(module, group_size))
    return model


def replace_submodule(model: nn.Module, name: str, new_module: nn.Module) -> None:
    parent_name, _, child_name = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child_name, new_module)


def save_int4_model(model: nn.Module, directory: str | Path) -> Path:
    """Export a transformers model with QuantLinearInt4 layers (merged or not) in the project INT4 format."""
    from safetensors.torch import save_model

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not hasattr(model, "config") or not hasattr(model.config, "save_pretrained"):
        raise TypeError("save_int4_model needs a transformers PreTrainedModel (it writes its config.json)")
    modules = {name: m.group_size for name, m in model.named_modules() if isinstance(m, QuantLinearInt4)}
    if not modules:
        raise ValueError("the model has no QuantLinearInt4 layer; quantize it first (quantize_linear_layers_int4)")
    model.config.save_pretrained(directory)
    save_model(model, str(directory / EXPORT_WEIGHTS))
    manifest = {"format": EXPORT_FORMAT, "version": 1, "bits": 4, "zero_point": "float32", "modules": modules}
    (directory / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=2))
    return directory


def load_int4_model(directory: str | Path) -> nn.Module:
    """Rebuild a causal LM saved by :func:`save_int4_model` (architecture from config.json, nothing downloaded)."""
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    manifest = json.loads((directory / EXPORT_MANIFEST).read_text())
    if manifest.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{directory}: not a {EXPORT_FORMAT} export (format={manifest.get('format')!r})")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    for name, group_size in manifest["modules"].items():
        linear = model.get_submodule(name)
        shell = QuantLinearInt4(linear.in_features, linear.out_features, group_size, bias=linear.bias is not None)
        replace_submodule(model, name, shell)
    load_model(model, str(directory / EXPORT_WEIGHTS))
    return model.eval()
