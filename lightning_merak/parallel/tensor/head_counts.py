"""How a block's attention modules count their heads, and the counts each tensor-parallel rank keeps.

Attention modules read their head counts from attributes of their own (GPT-2, Phi) or from their config
(transformers 5's Llama, Gemma, Mistral), and some cache derived values (``num_key_value_groups``, ``kv_dim``): all
of them become the rank's share when the block is split.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from torch import nn

__all__ = ["head_count", "local_key_value_heads", "scale_attention_attributes"]

_QUERY_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KEY_VALUE_HEADS = ("num_key_value_heads", "num_kv_heads", "kv_heads")
_WIDTHS = ("split_size", "embed_dim", "all_head_size")
_HEAD_COUNT_ATTRIBUTES = _QUERY_HEADS + _KEY_VALUE_HEADS


def head_count(block: nn.Module, owners: list[str]) -> Optional[int]:
    """The query head count of the attention module among ``owners``, else of any module of ``block``."""
    modules = [block.get_submodule(owner) if owner else block for owner in owners] + list(block.modules())
    holders = modules + [module.config for module in modules if getattr(module, "config", None) is not None]
    for holder in holders:
        for attribute in _QUERY_HEADS:
            value = getattr(holder, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def local_key_value_heads(heads: int, tensor_parallel: int) -> int:
    """Key/value heads per rank: its share, or the one its query heads read when there are fewer than ranks."""
    if heads % tensor_parallel == 0:
        return heads // tensor_parallel
    if tensor_parallel % heads == 0:
        return 1
    raise ValueError(f"tensor_parallel={tensor_parallel} neither divides nor is a multiple of the {heads} key/value "
                     "heads; choose a tensor_parallel that divides the key/value heads or is a multiple of them")


def scale_attention_attributes(block: nn.Module, column_names: list[str], tensor_parallel: int) -> None:
    """Set the head counts and widths the owners of ``column_names`` reshape by to this rank's share.

    An owner that reads head counts from its ``config`` (Phi-3) gets a copy with its share.
    """
    owners = {name.rpartition(".")[0] for name in column_names}
    for owner in owners:
        module = block.get_submodule(owner) if owner else block
        integer = {a: v for a in _HEAD_COUNT_ATTRIBUTES + _WIDTHS + ("num_key_value_groups", "kv_dim", "head_dim")
                   for v in [getattr(module, a, None)] if isinstance(v, int) and not isinstance(v, bool)}
        for attribute in _QUERY_HEADS + _WIDTHS:
            if attribute in integer:
                setattr(module, attribute, integer[attribute] // tensor_parallel)
        for attribute in _KEY_VALUE_HEADS:
            if attribute in integer:
                setattr(module, attribute, local_key_value_heads(integer[attribute], tensor_parallel))
        config = getattr(module, "config", None)
        if config is not None and any(isinstance(getattr(config, a, None), int) for a in _HEAD_COUNT_ATTRIBUTES):
            config = module.config = copy.copy(config)
            for attribute in _QUERY_HEADS:
                if isinstance(getattr(config, attribute, None), int):
                    setattr(config, attribute, getattr(config, attribute) // tensor_parallel)
            for attribute in _KEY_VALUE_HEADS:
                if isinstance(getattr(config, attribute, None), int):
                    setattr(config, attribute, local_key_value_heads(getattr(config, attribute), tensor_parallel))
        # local head counts: the module's, else its scaled config's (multi-query: 1 key/value head per rank)
        query = next((getattr(module, a) for a in _QUERY_HEADS if a in integer), _count(config, _QUERY_HEADS))
        key_value = next((getattr(module, a) for a in _KEY_VALUE_HEADS if a in integer),
                         _count(config, _KEY_VALUE_HEADS))
        if "num_key_value_groups" in integer and query and key_value:
            module.num_key_value_groups = query // key_value
        if "kv_dim" in integer and "head_dim" in integer:
            module.kv_dim = (key_value or 1) * module.head_dim


def _count(config: Any, attributes: tuple[str, ...]) -> Optional[int]:
    """The first of ``attributes`` ``config`` holds as an integer, or None."""
    return next((v for a in attributes for v in [getattr(config, a, None)] if isinstance(v, int)), None)
