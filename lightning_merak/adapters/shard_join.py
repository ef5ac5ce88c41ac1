"""A layer's whole quantisation put together from its tensor-parallel shards' codes and statistics, or cut into
another degree's shards, none re-quantised.

Each rank of a merak3d run at ``tensor_parallel > 1`` quantises its own shard of a frozen base layer, every
quantisation block inside one shard (:func:`~lightning_merak.adapters.quantize.shard_quantization_problem`), so the
whole layer's codes and statistics are the shards', re-sliced: every stored tensor holds one entry per ``k``
consecutive weights of its shard's row-major weight (a packed byte: two; a bitsandbytes absmax: a block of 64; an
INT4 scale: a group; an LLM.int8 scale: a row). Joining them is a matter of where those runs lie in the whole
weight's row-major order:

- output rows (a column layer): every row is whole entries (``in`` a multiple of the block), so each shard's
  ``(rows, entries per row)`` view is put at the rows it holds: its contiguous part in rank order, or the original
  rows of a fused projection split by units or of shared key/value heads;
- input columns (a row layer): each whole row is the shards' pieces of it side by side, so every tensor is viewed as
  ``(rows, entries per row)`` and concatenated along the row (a block never crosses a shard's row: the shard width
  is a multiple of the block); the int8 row scale is the whole row's on every shard.

bitsandbytes' packed quantisation state (its shape) is rewritten for the whole layer.

:func:`cut_quantized_whole` goes the other way, by the same runs: a rank's shard of the whole layer's codes and
statistics at any degree whose shards hold whole quantisation blocks, which is what quantising that shard alone gives
(:func:`~lightning_merak.adapters.quantize.shard_quantization_problem`). So a checkpoint written at one degree, its
shards joined, gives a run at another degree its own shards bit for bit.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

__all__ = ["cut_quantized_whole", "join_quantized_shards"]


def _column_rows(split: Mapping[str, Any]) -> list[list[int]]:
    """The whole layer's rows each rank of a column split holds: the recorded ones, else its contiguous part."""
    if split["rows"] is not None:
        return split["rows"]
    share = split["shape"][0] // split["degree"]
    return [list(range(rank * share, (rank + 1) * share)) for rank in range(split["degree"])]


def _shard_shapes(split: Mapping[str, Any]) -> list[tuple[int, int]]:
    """Each rank's ``(rows, columns)`` of the whole ``split["shape"]`` weight."""
    out_features, in_features = split["shape"]
    if split["dim"] == 1:
        return [(out_features, in_features // split["degree"])] * split["degree"]
    return [(len(rows), in_features) for rows in _column_rows(split)]


def _join(name: str, parts: Sequence[torch.Tensor], split: Mapping[str, Any], rowwise: bool) -> torch.Tensor:
    """The whole layer's ``name`` from the shards' ``parts`` (one entry per run of weights, see the module)."""
    out_features, in_features = split["shape"]
    shapes = _shard_shapes(split)
    per = shapes[0][0] * shapes[0][1] // parts[0].numel()  # weights an entry stands for
    if any(columns % per for _, columns in shapes):
        raise ValueError(f"{name}: an entry stands for {per} weights, which straddle the shards' rows of "
                         f"{shapes[0][1]}; resume at the tensor_parallel that wrote the checkpoint")
    whole_shape = (out_features, in_features // per) if rowwise else (-1, *parts[0].shape[1:])
    views = [part.reshape(rows, columns // per) for part, (rows, columns) in zip(parts, shapes)]
    if split["dim"] == 1:
        return torch.cat(views, 1).reshape(whole_shape)
    whole = torch.empty(out_features, in_features // per, dtype=parts[0].dtype)
    for rows, view in zip(_column_rows(split), views):  # a row several ranks hold is the same on each
        whole[torch.tensor(rows)] = view
    return whole.reshape(whole_shape)


def _same(name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """A tensor every shard holds alike (a code book, a row layer's whole-row scale)."""
    if any(not torch.equal(part, parts[0]) for part in parts[1:]):
        raise ValueError(f"{name} differs between the tensor-parallel shards, which quantised one layer alike; the "
                         "checkpoint was not written by one merak3d run")
    return parts[0].clone()


def join_quantized_shards(kind: str, split: Mapping[str, Any],
                          shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole layer's quantised tensors (named as its state dict names them) from ``shards``, each rank's in
    order, named the same; ``kind`` is nf4, fp4, int8 or int4 and ``split`` the recorded split
    (:meth:`~lightning_merak.parallel.tensor.layers.QuantizableShard.quantized_split`)."""
    if len(shards) != split["degree"]:
        raise ValueError(f"{len(shards)} shards of a layer split {split['degree']} ways")

    def parts(name: str) -> list[torch.Tensor]:
        return [shard[name] for shard in shards]

    if kind == "int4":
        return {name: _join(name, parts(name), split, rowwise=True) for name in ("qweight", "scales", "zeros")}
    if kind == "int8":
        scales = (_same("SCB", parts("SCB")) if split["dim"] == 1
                  else _join("SCB", [part.reshape(-1, 1) for part in parts("SCB")], split, rowwise=True).reshape(-1))
        joined = {"weight": _join("weight", parts("weight"), split, rowwise=True), "SCB": scales}
        if "weight_format" in shards[0]:
            joined["weight_format"] = _same("weight_format", parts("weight_format"))
        return joined
    from bitsandbytes.utils import pack_dict_to_tensor, unpack_tensor_to_dict

    packed = f"weight.quant_state.bitsandbytes__{kind}"
    state = unpack_tensor_to_dict(shards[0][packed])
    if "nested_absmax" in shards[0] or any(key.startswith("nested") for key in state):
        raise ValueError("double-quantised shards hold nested statistics per shard, which do not join into the whole "
                         "layer's; resume at the tensor_parallel that wrote the checkpoint")
    state["shape"] = tuple(split["shape"])
    return {"weight": _join("weight", parts("weight"), split, rowwise=False),
            "weight.absmax": _join("weight.absmax", parts("weight.absmax"), split, rowwise=False),
            "weight.quant_map": _same("weight.quant_map", parts("weight.quant_map")),
            packed: pack_dict_to_tensor(state)}


def _cut(name: str, whole: torch.Tensor, split: Mapping[str, Any], rank: int, rowwise: bool) -> torch.Tensor:
    """Rank ``rank``'s part of the whole layer's ``name`` (one entry per run of weights, see the module)."""
    out_features, in_features = split["shape"]
    rows, columns = _shard_shapes(split)[rank]
    per = out_features * in_features // whole.numel()  # weights an entry stands for
    if columns % per:
        raise ValueError(f"{name}: the checkpoint holds an entry per {per} weights, which straddle this run's shards "
                         f"of {rows}x{columns}; resume with the quantization and group_size of the run that wrote it")
    shape = (rows, columns // per) if rowwise else (-1, *whole.shape[1:])
    view = whole.reshape(out_features, in_features // per)
    if split["dim"] == 1:
        return view[:, rank * columns // per:(rank + 1) * columns // per].reshape(shape).clone()
    return view[torch.tensor(_column_rows(split)[rank])].reshape(shape)


def cut_quantized_whole(kind: str, split: Mapping[str, Any], rank: int,
                        whole: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of the whole layer's quantised tensors ``whole`` (any of those its state dict holds,
    named alike), split as ``split`` records (:meth:`~lightning_merak.parallel.tensor.layers.QuantizableShard.
    quantized_split`): the inverse of :func:`join_quantized_shards`; ``kind`` is nf4, fp4, int8 or int4."""
    shard: dict[str, torch.Tensor] = {}
    for name, tensor in whole.items():
        if name.startswith("weight.nested"):
            raise ValueError("the checkpoint's base is double-quantised: its block statistics are rounded around one "
                             "offset per whole weight, which no shard holds; resume it at tensor_parallel=1")
        if name in ("weight.quant_map", "weight_format") or (name == "SCB" and split["dim"] == 1):
            shard[name] = tensor.clone()  # alike on every shard: a code book, a row layer's whole-row scale
        elif name == "SCB":
            shard[name] = _cut(name, tensor.reshape(-1, 1), split, rank, rowwise=True).reshape(-1)
        elif name.startswith("weight.quant_state."):
            from bitsandbytes.utils import pack_dict_to_tensor, unpack_tensor_to_dict

            state = unpack_tensor_to_dict(tensor)
            state["shape"] = _shard_shapes(split)[rank]
            shard[name] = pack_dict_to_tensor(state)
        else:  # codes and block statistics: one entry per run of weights
            shard[name] = _cut(name, tensor, split, rank, rowwise=kind in ("int4", "int8"))
    return shard
