"""Checks shared by both block-scope Lancets (DeepSpeed-MoE layers and ``merak_ep`` experts): what a decoder
layer's call must look like to be split into sub-batches along the batch."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from transformers.cache_utils import Cache

__all__ = ["Chunks", "batch_size", "cache_argument", "check_chunks", "enclosing_block", "split_batch"]

Chunks = Union[int, str]
# Keyword names transformers has given a block's key/value cache: ``past_key_values`` before, ``cache`` in v5.24.
# A ``Cache`` object is recognised by its type as well, so a further rename cannot slip past the check.
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def check_chunks(chunks: Chunks) -> None:
    """Refuse a sub-batch count that is neither ``"auto"`` nor a positive integer."""
    if chunks != "auto" and not (isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1):
        raise ValueError(f"chunks={chunks!r}: use 'auto' or an integer >= 1 (the number of sub-batches)")


def cache_argument(args: tuple, kwargs: dict[str, Any]) -> Optional[str]:
    """The name (or position) of a key/value cache given to a block, if any.

    Sub-batches would each append their keys to the one whole-batch cache, so later sub-batches
    would attend to earlier ones' tokens: a wrong result, not an error, hence refused up front.
    """
    for name, value in kwargs.items():
        if value is not None and (name in _CACHE_ARGUMENTS or isinstance(value, Cache)):
            return name
    return next((f"positional argument {i}" for i, value in enumerate(args) if isinstance(value, Cache)), None)


def batch_size(args: tuple, kwargs: dict[str, Any]) -> Optional[int]:
    """The first dimension of a block call's first tensor argument: the batch the sub-batches split."""
    leaves, _ = tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    return tensors[0].shape[0] if tensors and tensors[0].ndim > 0 else None


def split_batch(block: Any, args: tuple, kwargs: dict[str, Any], chunks: Optional[int]) -> int:
    """The batch of a block call that Lancet splits, after refusing a call it cannot split: a key/value cache,
    no batch-first tensor, or (with ``chunks`` fixed) a batch ``chunks`` does not divide."""
    cache = cache_argument(args, kwargs)
    if cache is not None:
        raise ValueError(
            f"{type(block).__name__} got a key/value cache ({cache}), which spans the whole batch and "
            f"cannot be shared by Lancet sub-batches; run with use_cache=False (model.config.use_cache=False)")
    batch = batch_size(args, kwargs)
    if batch is None:
        raise ValueError(f"{type(block).__name__}.forward got no batch-first tensor to split into sub-batches")
    if chunks is not None and batch % chunks:
        raise ValueError(
            f"a batch of {batch} samples cannot be split into {chunks} Lancet sub-batches; "
            f"choose chunks that divide the micro-batch size (or chunks='auto')")
    return batch


def enclosing_block(modules: dict[str, nn.Module], name: str) -> Optional[nn.Module]:
    """The nearest ancestor of the module called ``name`` (or the module itself) held by an ``nn.ModuleList`` or
    ``nn.Sequential``: the decoder layer a block-scope Lancet splits. ``modules`` is ``dict(model.named_modules())``;
    ``None`` where no such ancestor exists."""
    parts = name.split(".") if name else []
    for cut in range(len(parts), 0, -1):
        if isinstance(modules[".".join(parts[: cut - 1])], (nn.ModuleList, nn.Sequential)):
            return modules[".".join(parts[:cut])]
    return None
