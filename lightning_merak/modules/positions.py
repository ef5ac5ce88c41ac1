"""How many positions a transformers model can embed, for refusing a longer sequence before launch.

A model with a table of positions (GPT-2's ``wpe``, OPT's learned positions, GPT-J's sine table) fails on a
longer sequence with an index error inside the first forward, on every rank. Rotary and ALiBi models compute
positions as they go and run at any length, so they are not limited here (beyond ``max_position_embeddings`` a
pretrained model is past what it was trained on: a notice, not a refusal).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

__all__ = ["POSITION_LIMIT_KEYS", "beyond_trained_positions", "position_limit", "sequence_length_problem"]

POSITION_LIMIT_KEYS = ("n_positions", "max_position_embeddings", "max_sequence_length")
"""The config fields transformers' families size their position tables by, in the order they are read."""


def _holds_position_table(model: nn.Module) -> bool:
    """Whether the model embeds positions from a table: an embedding other than the tokens' named for positions
    (``wpe``, ``embed_positions``, ``position_embeddings``), or a buffer of precomputed positions."""
    tokens = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and module is not tokens and ("pos" in leaf or leaf == "wpe"):
            return True
    return any("positions" in name.rsplit(".", 1)[-1] and buffer.dim() >= 2 for name, buffer in model.named_buffers())


def position_limit(config: Any) -> Optional[tuple[str, int]]:
    """``(field, value)`` of the first config field that sizes the position table, or None."""
    for key in POSITION_LIMIT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


def sequence_length_problem(model: nn.Module, seq_len: int, field: str = "data.seq_len") -> Optional[str]:
    """Why ``model`` cannot run sequences of ``seq_len`` tokens (its position table is shorter), or None; ``field``
    is the setting that asks for that length."""
    config = getattr(model, "config", None)
    limit = position_limit(config) if config is not None else None
    if limit is None or seq_len <= limit[1] or not _holds_position_table(model):
        return None
    key, value = limit
    return (f"{field}={seq_len} is longer than the {value} positions {type(model).__name__} embeds "
            f"(model.config.{key}={value}, a learned or precomputed position table); use {field}<={value}, "
            f"or model.config.{key}={seq_len} for a model initialised at random")


def beyond_trained_positions(model: nn.Module, seq_len: int, field: str = "data.seq_len") -> Optional[str]:
    """A notice for a model that runs past ``max_position_embeddings`` without a table, or None."""
    limit = position_limit(getattr(model, "config", None))
    if limit is None or seq_len <= limit[1]:
        return None
    return (f"{field}={seq_len} is beyond model.config.{limit[0]}={limit[1]}; the model computes its positions "
            "and runs, but a pretrained one was not trained on them")
