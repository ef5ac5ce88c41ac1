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
absmax over 127), :func:`~lightning_merak.adapters.int4.dequantize_int4` for INT4.

A base quantised per tensor-parallel shard (``<layer>.shard_tp<r>of<n>``, merak3d at ``tensor_parallel > 1``) holds
one quantisation per shard, each with its own statistics. Every quantisation block lies inside one shard (the split
checks it before training), so the shards' codes and statistics, re-sliced by the split the checkpoint's model record
holds (:data:`~lightning_merak.checkpoint.names.QUANTIZED_SPLITS_KEY`), are the whole layer's quantisation:
:func:`~lightning_merak.adapters.shard_join.join_quantized_shards` joins them as a resume at ``tensor_parallel=1``
does, and the layer is dequantised once. The merged export then equals that of the same run at
``tensor_parallel=1``. A checkpoint written before the record existed is refused, naming ``--adapter-only``.

Fused expert tensors stored in the project INT4 (:mod:`~lightning_merak.adapters.int4_experts`: packed codes under
``<experts>.parametrizations.<tensor>.original``, the parametrization's scales and zero-points beside them) are read
as the float ``<experts>.<tensor>`` the experts module reads, ``[E, in, out]`` for an ``is_transposed`` one.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

__all__ = ["DequantisedSource", "int4_expert_tensors"]

_PARAMETRIZED = ".parametrizations."


def int4_expert_tensors(keys: Iterable[str]) -> dict[str, tuple[str, str, str]]:
    """The fused expert tensors ``keys`` (a checkpoint's) store in the project INT4, by the prefix of each one's
    parametrization (``<experts>.parametrizations.<tensor>``): the keys of its packed codes (``.original``) and of
    the dequantising parametrization's ``scales`` and ``zeros`` beside them."""
    keys = set(keys)
    found = {}
    for scales in sorted(key for key in keys if _PARAMETRIZED in key and key.endswith(".scales")):
        prefix = scales.removesuffix(".scales").rpartition(".")[0]  # less the parametrization's index
        codes, zeros = prefix + ".original", scales.removesuffix(".scales") + ".zeros"
        if codes in keys and zeros in keys:
            found[prefix] = (codes, scales, zeros)
    return found


class DequantisedSource:
    """``source`` (a checkpoint's tensors read one at a time: ``entries`` and ``read``) with every layer of
    ``quantized`` (layer prefix → nf4, fp4, int8 or int4) as a float ``<layer>.weight``; a layer saved as
    tensor-parallel shards (``<layer>.shard_tp<r>of<n>``) as one float weight put together from them; and every
    INT4 expert tensor of ``int4_experts`` (:func:`int4_expert_tensors`) as its float tensor, transposed where its
    experts module (a name of ``transposed``, the model's modules with ``is_transposed``) is."""

    def __init__(self, source: Any, quantized: dict[str, str],
                 int4_experts: Optional[dict[str, tuple[str, str, str]]] = None,
                 transposed: Collection[str] = ()) -> None:
        import torch

        from lightning_merak.checkpoint.names import (  # lazy: torch
            MODEL_RECORD_KEY,
            QUANTIZED_SPLITS_KEY,
            recorded_split,
        )
        from lightning_merak.parallel.tensor.quantized_shards import split_shard_name  # lazy: torch

        self.source = source
        self.path = source.path
        self.metadata = source.metadata
        splits = (self.metadata.get(MODEL_RECORD_KEY) or {}).get(QUANTIZED_SPLITS_KEY) or {}
        # float weight key → (quantisation, the layer prefix of each quantised part in rank order, split or None)
        self.layers: dict[str, tuple[str, list[str], Optional[dict[str, Any]]]] = {}
        entries = dict(source.entries)
        shards: dict[str, dict[int, str]] = {}
        for layer, kind in quantized.items():
            shard = split_shard_name(layer)
            if shard is not None:
                shards.setdefault(shard[0], {})[shard[1]] = layer
                continue
            self._replace(entries, layer, kind, [layer], None, self._float_entry(layer, kind))
        for layer, parts in shards.items():
            kind = quantized[next(iter(parts.values()))]
            split = recorded_split(splits, layer)
            if split is None:
                raise ValueError(
                    f"--merge-adapters: {source.path} holds {layer}'s {kind} base as tensor-parallel shards but does "
                    "not record how the layer was split (a checkpoint saved before the split was recorded); resume "
                    "and save it again at the same tensor_parallel, or export the adapters alone (merak-export "
                    "--adapter-only) and merge them onto the base model")
            if sorted(parts) != list(range(split["degree"])):
                raise ValueError(f"--merge-adapters: {source.path} holds shards {sorted(parts)} of {layer}, its split "
                                 f"records {split['degree']}; the checkpoint is incomplete")
            ordered = [parts[rank] for rank in range(split["degree"])]
            _, dtype = self._float_entry(ordered[0], kind)
            self._replace(entries, layer, kind, ordered, split, (tuple(split["shape"]), dtype))
        self.experts: dict[str, tuple[tuple[str, str, str], bool]] = {}
        """Float expert tensor key → the keys of its codes, scales and zero-points, and whether it is transposed."""
        for prefix, parts in (int4_experts or {}).items():
            module, _, tensor = prefix.rpartition(_PARAMETRIZED)
            bare = ".".join(part for part in module.split(".") if part != "base_layer")  # PEFT's wrappers left out
            flipped = any(bare == name or bare.endswith("." + name) for name in transposed)
            experts, rows, half = entries[parts[0]][0]
            for key in [key for key in entries if key.startswith(prefix + ".")]:
                del entries[key]
            entries[f"{module}.{tensor}"] = ((experts, 2 * half, rows) if flipped else (experts, rows, 2 * half),
                                             torch.float32)
            self.experts[f"{module}.{tensor}"] = (parts, flipped)
        self.entries = entries

    def _replace(self, entries: dict[str, Any], layer: str, kind: str, parts: list[str],
                 split: Optional[dict[str, Any]], entry: tuple[tuple[int, ...], torch.dtype]) -> None:
        """``entries`` with the quantised tensors of ``parts`` (all but a bias) replaced by ``<layer>.weight``."""
        for part in parts:
            prefix = part + "."
            for key in [key for key in entries if key.startswith(prefix) and key[len(prefix):] != "bias"]:
                del entries[key]
        entries[layer + ".weight"] = entry
        self.layers[layer + ".weight"] = (kind, parts, split)

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
        if key in self.experts:
            from lightning_merak.adapters.int4_experts import dequantize_experts_int4  # lazy: torch

            parts, flipped = self.experts[key]
            weight = dequantize_experts_int4(*(self.source.read(part) for part in parts))
            return weight.transpose(-2, -1).contiguous() if flipped else weight
        if key not in self.layers:
            return self.source.read(key)
        kind, parts, split = self.layers[key]
        if split is None:
            return _dequantise(kind, self._quantized_tensors(parts[0]))
        from lightning_merak.adapters.shard_join import join_quantized_shards  # lazy: torch

        return _dequantise(kind, join_quantized_shards(kind, split, [self._quantized_tensors(part) for part in parts]))

    def _quantized_tensors(self, layer: str) -> dict[str, torch.Tensor]:
        """One quantised ``layer``'s codes and statistics (a whole layer, or one rank's shard), named as its state
        dict names them."""
        prefix = layer + "."
        return {key[len(prefix):]: self.source.read(key) for key in self.source.entries
                if key.startswith(prefix) and key[len(prefix):] != "bias"}


def _dequantise(kind: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float weight of one quantised layer from its codes and statistics (``tensors``, state-dict names)."""
    import torch

    if kind == "int4":
        from lightning_merak.adapters.int4 import dequantize_int4  # lazy: torch

        return dequantize_int4(tensors["qweight"], tensors["scales"], tensors["zeros"])
    import bitsandbytes.functional as bnb_functional

    if kind == "int8":
        return bnb_functional.int8_vectorwise_dequant(tensors["weight"], tensors["SCB"].float())
    statistics = {name[len("weight."):]: tensor for name, tensor in tensors.items() if name.startswith("weight.")}
    state = bnb_functional.QuantState.from_dict(qs_dict=statistics, device=torch.device("cpu"))
    return bnb_functional.dequantize_4bit(tensors["weight"], state)
