"""A checkpoint's quantised base read as float weights, for ``merak-export --merge-adapters``.

An adapter trained on a quantised base (bitsandbytes nf4/fp4/int8, the project's INT4) was trained against the
dequantised weight: its forward computes ``dequantize(codes) x + delta x``. Merging writes that weight,
``dequantize(codes) + delta``, in float, as PEFT's ``merge_and_unload`` dequantises a 4-bit base before adding the
delta (it then quantises again; the export keeps the float sum). The merged weights carry the quantisation
rounding of the base, not the original float weights.

:class:`DequantisedSource` presents a checkpoint's tensors with each quantised layer's codes and statistics
replaced by one float ``weight`` (the layer's unquantised name), read and dequantised when asked for, so the export
treats it as any float base. Each format is dequantised by its own code: bitsandbytes' ``dequantize_4bit`` with the
layer's ``QuantState`` rebuilt from the checkpoint, its ``int8_vectorwise_dequant`` for int8 (codes times the row's
absmax over 127), :func:`~lightning_merak.adapters.int4.dequantize_int4` for INT4. A base quantised per
tensor-parallel shard (``shard_tp<r>of<n>``) is refused: each shard is a separate quantisation, and putting the
dequantised shards back together needs the split's layout, which the checkpoint does not record.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["DequantisedSource"]

_SHARD = re.compile(r"\.shard_tp\d+of\d+$")


class DequantisedSource:
    """``source`` (a checkpoint's tensors read one at a time: ``entries`` and ``read``) with every layer of
    ``quantized`` (layer prefix → nf4, fp4, int8 or int4) as a float ``<layer>.weight``."""

    def __init__(self, source: Any, quantized: dict[str, str]) -> None:
        self.source = source
        self.path = source.path
        self.metadata = source.metadata
        self.layers: dict[str, tuple[str, str]] = {}  # float weight key → (layer prefix, quantisation)
        entries = dict(source.entries)
        for layer, kind in quantized.items():
            if _SHARD.search(layer):
                raise ValueError(
                    f"--merge-adapters: {source.path} holds {layer.rpartition('.')[0]}'s {kind} base as "
                    "tensor-parallel shards, each quantised alone, which a merged export cannot put back together; "
                    "export the adapters alone (merak-export --adapter-only) and merge them onto the base model")
            prefix = layer + "."
            for key in [key for key in entries if key.startswith(prefix) and key[len(prefix):] != "bias"]:
                del entries[key]
            entries[prefix + "weight"] = self._float_entry(layer, kind)
            self.layers[prefix + "weight"] = (layer, kind)
        self.entries = entries

    def _statistics(self, layer: str) -> dict[str, torch.Tensor]:
        """A bitsandbytes 4-bit layer's quantisation state as its state dict holds it (``weight.<name>`` keys)."""
        prefix = layer + ".weight."
        return {key[len(prefix):]: self.source.read(key) for key in self.source.entries if key.startswith(prefix)}

    def _float_entry(self, layer: str, kind: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of ``layer``'s dequantised weight."""
        import torch

        if kind in ("nf4", "fp4"):
            from bitsandbytes.functional import QuantState

            state = QuantState.from_dict(qs_dict=self._statistics(layer), device=torch.device("cpu"))
            return tuple(state.shape), state.dtype
        if kind == "int4":
            rows, half = self.source.entries[layer + ".qweight"][0]
            return (rows, 2 * half), torch.float32
        return self.source.entries[layer + ".weight"][0], torch.float32

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key`` names: a quantised layer's weight dequantised, any other as the checkpoint holds it."""
        if key not in self.layers:
            return self.source.read(key)
        import torch

        layer, kind = self.layers[key]
        if kind == "int4":
            from lightning_merak.adapters.int4 import dequantize_int4  # lazy: torch

            return dequantize_int4(*(self.source.read(f"{layer}.{name}") for name in ("qweight", "scales", "zeros")))
        import bitsandbytes.functional as bnb_functional

        codes = self.source.read(key)
        if kind == "int8":
            return bnb_functional.int8_vectorwise_dequant(codes, self.source.read(layer + ".SCB").float())
        state = bnb_functional.QuantState.from_dict(qs_dict=self._statistics(layer), device=torch.device("cpu"))
        return bnb_functional.dequantize_4bit(codes, state)
