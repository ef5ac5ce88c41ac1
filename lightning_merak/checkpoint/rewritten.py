"""Reading a checkpoint whose quantised adapter base a meta model's float tensors cannot take as they are.

An adapter model built on meta holds float weights until its ``after_materialize`` hook quantises its frozen base;
the checkpoint holds the quantised tensors. :func:`saved_storage_where_rewritten` points the load at those instead
(read at their saved shape and dtype), and the build then compares them with what it rebuilt from the float weights
(:class:`~lightning_merak.parallel.materialize.RestoreAfterRewrite`).

A base quantised per tensor-parallel shard (``<layer>.shard_tp<r>of<n>``) is read as this rank's shard when the run
has the degree that wrote it. A run at any other degree reads every shard and puts the whole layer's codes and
statistics together (:func:`~lightning_merak.adapters.shard_join.join_quantized_shards`, by the split the checkpoint
records): the shards are the whole layer's quantisation, sliced, so the result is what a ``tensor_parallel=1`` run
saves, bit for bit. At ``tensor_parallel=1`` the rebuilt base must equal it; above 1 this layout's shards are only
known once the model is split, after the checkpoint is read, so the build cuts each rank's shard from the whole layer
(:func:`~lightning_merak.parallel.tensor.quantized_shards.shards_from_whole`) and the rebuilt shard must equal that. A
``tensor_parallel=1`` checkpoint's whole layers are cut the same way. A degree whose shards would not hold whole
quantisation blocks is refused by the build before any weight is materialised, as for a fresh run; a double-quantised
base (only ``tensor_parallel=1`` writes one) is refused before it is read by a run that does not double-quantise (any
above 1).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_merak.checkpoint.names import recorded_split
from lightning_merak.parallel.tensor.quantized_shards import saved_shards, shard_module_name

__all__ = ["ShardJoin", "join_saved_shards", "saved_storage_where_rewritten"]


@dataclass(frozen=True)
class ShardJoin:
    """A layer read as all of its tensor-parallel shards, to be put together once loaded."""

    layer: str
    kind: str
    split: dict[str, Any]
    """How the layer was split (:data:`~lightning_merak.checkpoint.names.QUANTIZED_SPLITS_KEY`)."""


def _join_or_refuse(layer: str, shards: dict[tuple[int, int], list[str]], tensor_rank: Optional[tuple[int, int]],
                    splits: dict[str, Any]) -> Optional[ShardJoin]:
    """How this run reads ``layer``'s shards: None for its own (same degree), else a join of all of them (refused
    where the checkpoint does not record the split)."""
    degree = next(iter(shards))[1]
    this = 1 if tensor_rank is None else tensor_rank[1]
    if this == degree:
        return None
    split = recorded_split(splits, layer)
    if split is None:
        raise ValueError(
            f"the checkpoint holds {layer}'s quantised base as {degree} tensor-parallel shards, each quantised alone, "
            f"and does not record how the layer was split, which reading them at another degree needs; resume it at "
            f"tensor_parallel={degree} (this run: {this}), or start from the pretrained weights with its adapters "
            "alone (merak-export --adapter-only)")
    from lightning_merak.adapters.resume import quantized_layers  # lazy: PEFT

    keys = [key for part in shards.values() for key in part]
    kind = set(quantized_layers(key.removeprefix("model.") for key in keys).values())
    if len(kind) != 1:
        raise ValueError(f"the checkpoint holds {layer}'s shards as {sorted(kind)}; resume from one run's checkpoint")
    return ShardJoin(layer, kind.pop(), split)


def _refuse_double_quantised(layer: str, saved_keys: Any, double_quant: bool) -> None:
    """A layer's base the checkpoint holds double-quantised, read by a run that quantises without it: refused (the
    codes alike, the statistics are not)."""
    if not double_quant and f"model.{layer}.weight.nested_absmax" in saved_keys:
        raise ValueError(
            f"the checkpoint holds {layer}'s base double-quantised (its block statistics rounded around one offset per "
            "whole weight), which this run does not (adapter.double_quant=false, as tensor_parallel>1 needs); resume "
            "it at tensor_parallel=1 with adapter.double_quant=true, or start from the pretrained weights with its "
            "adapters alone (merak-export --adapter-only)")


def saved_storage_where_rewritten(model_state: dict[str, torch.Tensor], metadata: Any,
                                  tensor_rank: Optional[tuple[int, int]], splits: Optional[dict[str, Any]] = None,
                                  double_quant: bool = True) -> list[ShardJoin]:
    """Read a tensor as saved where a meta model's float tensor differs in shape or dtype: its ``after_materialize``
    hook rewrites it (a quantised adapter base, packed), and the build compares it with the rewritten one.

    A float weight the checkpoint does not hold was rewritten into other tensors of its layer (the project's INT4:
    codes, scales, zeros), or into one quantised shard per tensor-parallel rank (``shard_tp<r>of<n>``): those are
    read instead, this rank's shard only (``tensor_rank``: its ``(rank, degree)`` in the tensor-parallel group) at
    the degree that wrote them, else every shard, to be joined by :func:`join_saved_shards` (``splits``: the
    checkpoint's recorded splits). A base the checkpoint holds double-quantised is refused unless this run
    double-quantises too (``double_quant``). Returns those joins.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved_keys = metadata.state_dict_metadata
    ordered = sorted(saved_keys)  # the keys under a layer's prefix are one run of it
    joins = []
    for key, target in list(model_state.items()):
        layer = key.rpartition(".")[0]
        if f"model.{key}" not in saved_keys and target.is_floating_point() and layer:
            prefix = f"model.{layer}."
            under = itertools.takewhile(lambda name: name.startswith(prefix),
                                        ordered[bisect.bisect_left(ordered, prefix):])
            extra = [name for name in under if name[len("model."):] not in model_state
                     and isinstance(saved_keys[name], TensorStorageMetadata)]
            shards = saved_shards(extra, prefix)
            if shards:
                join = _join_or_refuse(layer, shards, tensor_rank, splits or {})
                if join is None:
                    extra = shards[tensor_rank]
                else:
                    joins.append(join)
                    extra = [name for part in shards.values() for name in part]
            if extra:
                del model_state[key]
                for name in extra:
                    stored = saved_keys[name]
                    model_state[name[len("model."):]] = torch.empty(stored.size, dtype=stored.properties.dtype)
            continue
        saved = saved_keys.get(f"model.{key}")
        if target.is_floating_point() and isinstance(saved, TensorStorageMetadata) and (
                tuple(saved.size) != tuple(target.shape) or saved.properties.dtype != target.dtype):
            _refuse_double_quantised(layer, saved_keys, double_quant)
            model_state[key] = torch.empty(saved.size, dtype=saved.properties.dtype)
    return joins


def join_saved_shards(model_state: dict[str, torch.Tensor], joins: list[ShardJoin]) -> None:
    """Replace, in the loaded ``model_state``, each of ``joins``' shards by the whole layer's tensors, as a
    ``tensor_parallel=1`` checkpoint holds them (bitsandbytes: the codes, under ``weight``; INT4: codes, scales and
    zeros), which a run above 1 cuts its own shard from once split."""
    if not joins:
        return
    from lightning_merak.adapters.shard_join import join_quantized_shards  # lazy: PEFT

    for join in joins:
        shards = []
        for rank in range(join.split["degree"]):
            prefix = f"{join.layer}.{shard_module_name(rank, join.split['degree'])}."
            shards.append({key[len(prefix):]: model_state.pop(key) for key in list(model_state)
                           if key.startswith(prefix)})
        whole = join_quantized_shards(join.kind, join.split, shards)
        if join.kind != "int4":
            whole = {"weight": whole["weight"]}
        model_state.update({f"{join.layer}.{name}": tensor for name, tensor in whole.items()})
