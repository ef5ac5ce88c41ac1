"""Which adapter bases can be quantised per tensor-parallel shard, checked before any weight is read.

An adapter model built on meta quantises its frozen base once the weights are in
(:class:`~lightning_merak.adapters.meta.DeferredQuantization`); at ``tensor_parallel > 1`` that is after the split, so
each rank quantises its own shard (:meth:`~lightning_merak.parallel.tensor.layers.QuantizableShard.quantize_shard`)
and no rank ever holds a whole quantised layer. The result is the whole model's quantisation, sliced, where every
quantisation block lies inside one shard (:func:`~lightning_merak.adapters.quantize.shard_quantization_problem`);
elsewhere it would be another model, so it is refused: before launch what neither a column nor a row split could take
(:func:`quantized_base_problem`, the layers' roles are not known yet), once the block's split is planned what its
column and row layers cannot (:func:`quantized_split_problem`), before any weight is materialised.

Since a rank's shard is its slice of the whole layer's quantisation, a checkpoint that holds the whole layer's (written
at ``tensor_parallel=1``, or at another degree, its shards joined as it is read) gives each rank its shard by cutting
it (:func:`shards_from_whole`), once the split says which rows or columns the rank holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["QuantizedShard", "quantized_base_problem", "quantized_shards", "quantized_split_problem", "saved_shards",
           "shard_module_name", "shards_from_whole", "split_shard_name"]

_SHARD = re.compile(r"\.shard_tp(\d+)of(\d+)\.")


def shard_module_name(rank: int, size: int) -> str:
    """The name a split layer registers its quantised shard under: which of the group's shards it is, so that a
    checkpoint keeps every rank's (no two ranks hold the same codes, and each is saved under its own keys)."""
    return f"shard_tp{rank}of{size}"


def split_shard_name(name: str) -> Optional[tuple[str, int, int]]:
    """``(layer, rank, degree)`` of a quantised shard's module name ``<layer>.shard_tp<rank>of<degree>``
    (:func:`shard_module_name`), or None for any other name."""
    match = _SHARD.search(name + ".")
    if match is None or match.end() != len(name) + 1:
        return None
    return name[:match.start()], int(match.group(1)), int(match.group(2))


def saved_shards(keys: Iterable[str], layer_prefix: str) -> dict[tuple[int, int], list[str]]:
    """The keys under ``layer_prefix`` (dot included) of a layer saved as quantised shards, by ``(rank, degree)``."""
    found: dict[tuple[int, int], list[str]] = {}
    for key in keys:
        match = _SHARD.match(key, len(layer_prefix) - 1) if key.startswith(layer_prefix) else None
        if match is not None:
            found.setdefault((int(match.group(1)), int(match.group(2))), []).append(key)
    return found


def _deferred(model: nn.Module) -> Optional[Any]:
    """The model's deferred base quantisation, when it quantises (``after_materialize`` of an adapter model)."""
    hook = getattr(model, "after_materialize", None)
    return hook if getattr(hook, "quantization", "none") != "none" else None


def _base(module: nn.Module) -> nn.Module:
    """A tuner layer's base (PEFT's ``get_base_layer``), else ``module``."""
    return module.get_base_layer() if callable(getattr(module, "get_base_layer", None)) else module


def _problem(hook: Any, name: str, layer: nn.Module, tensor_parallel: int, *, column: bool) -> Optional[str]:
    from lightning_merak.adapters.quantize import shard_quantization_problem  # lazy: PEFT (an adapter model's hook)

    return shard_quantization_problem(hook.quantization, name, layer.in_features, layer.out_features,
                                      tensor_parallel, column=column, group_size=hook.group_size,
                                      double_quant=hook.double_quant)


def quantized_base_problem(model: nn.Module, trunk_path: str, tensor_parallel: int) -> Optional[str]:
    """Why a linear layer of ``model``'s blocks could not be quantised per shard in either role, or None."""
    hook = _deferred(model)
    if hook is None or tensor_parallel <= 1:
        return None
    for name, module in model.named_modules():
        if not name.startswith(trunk_path + ".") or type(module) is not nn.Linear or name.split(".")[-1] in hook.skip:
            continue
        if any(step.startswith("lora_") for step in name.split(".")):
            continue
        as_row = _problem(hook, name, module, tensor_parallel, column=False)
        if as_row is not None and _problem(hook, name, module, tensor_parallel, column=True) is not None:
            return as_row
    return None


def quantized_split_problem(model: nn.Module, block: nn.Module, plan: Any, tensor_parallel: int) -> Optional[str]:
    """Why ``block``'s split ``plan`` (a :class:`~lightning_merak.parallel.tensor.blocks.TensorParallelPlan`) cannot
    quantise ``model``'s frozen base per shard, or None. A column layer's rule does not depend on which rows a rank
    holds (:func:`~lightning_merak.adapters.quantize.shard_quantization_problem`)."""
    from lightning_merak.adapters.tp_shards import (  # lazy: PEFT (an adapter model's hook)
        adapter_shard_problems,
        shard_refusal,
        split_layer,
    )

    hook = _deferred(model)
    if hook is None or tensor_parallel <= 1:
        return None
    layers = []
    for name in [*plan.column, *plan.row]:
        base = _base(block.get_submodule(name))
        if type(base) is not nn.Linear:
            return (f"tensor_parallel={tensor_parallel}: {name} is a {type(base).__name__}, which a "
                    f"{hook.quantization} base keeps in float at tensor_parallel=1 but the split would quantise; use "
                    "tensor_parallel=1, or quantization=none")
        layers.append(split_layer(name, block.get_submodule(name), column=name in plan.column))
    return shard_refusal(adapter_shard_problems(layers, tensor_parallel, hook))


@dataclass(frozen=True)
class QuantizedShard:
    """This rank's quantised shard of a split layer, as :func:`shards_from_whole` cuts it from the whole layer's."""

    layer: str
    """The split layer's unsplit name."""
    kind: str
    """nf4, fp4, int8 or int4."""
    rank: int
    split: dict[str, Any]
    """:meth:`~lightning_merak.parallel.tensor.layers.QuantizableShard.quantized_split`."""

    @property
    def prefix(self) -> str:
        """Where this shard's tensors are named: ``<layer>.shard_tp<rank>of<degree>.``."""
        return f"{self.layer}.{shard_module_name(self.rank, self.split['degree'])}."


def quantized_shards(model: nn.Module, original_name: Callable[[str], str]) -> list[QuantizedShard]:
    """The quantised shards ``model`` (a rank's part, its names mapped to the unsplit ones by ``original_name``)
    holds."""
    shards = []
    for name, module in model.named_modules():
        split = module.quantized_split() if callable(getattr(module, "quantized_split", None)) else None
        if split is not None:
            from lightning_merak.adapters.resume import base_quantization  # lazy: PEFT (a quantised shard exists)

            kind = base_quantization(module.quantized)
            shards.append(QuantizedShard(original_name(name), str(kind), dist.get_rank(module.group), split))
    return shards


def shards_from_whole(state: Mapping[str, torch.Tensor], shards: Iterable[QuantizedShard],
                      names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Those of ``names`` (``<layer>.shard_tp<r>of<n>.<tensor>``) that are ``shards``' tensors, cut from the whole
    layer's quantised tensors in ``state`` (``<layer>.<tensor>``), where ``state`` holds them: the whole layer's
    quantisation sliced as quantising this rank's shard alone slices it."""
    from lightning_merak.adapters.shard_join import cut_quantized_whole  # lazy: PEFT

    names = list(names)
    cut: dict[str, torch.Tensor] = {}
    for shard in shards:
        wanted = [name[len(shard.prefix):] for name in names if name.startswith(shard.prefix)]
        whole = {tensor: state[f"{shard.layer}.{tensor}"] for tensor in wanted if f"{shard.layer}.{tensor}" in state}
        if whole:
            cut.update({shard.prefix + tensor: value for tensor, value in
                        cut_quantized_whole(shard.kind, shard.split, shard.rank, whole).items()})
    return cut
