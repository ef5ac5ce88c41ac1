"""How many positions a transformers model can embed, for refusing a longer sequence before launch.

A model with a table of positions (GPT-2's ``wpe``, OPT's learned positions, GPT-J's sine table) fails on a
longer sequence with an index error inside the first forward, on every rank. Rotary and ALiBi models compute
positions as they go and run at any length, so they are not limited here (beyond ``max_position_embeddings`` a
pretrained model is past what it was trained on: a notice, not a refusal).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lightning_merak.parallel.micro_batching.plan import ALIGN, round_up

__all__ = ["POSITION_LIMIT_KEYS", "beyond_trained_positions", "padded_length_problem", "position_limit",
           "sequence_length_problem"]

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


def _table_limit(model: nn.Module, length: int) -> Optional[tuple[str, int]]:
    """``(field, value)`` of ``model``'s position table where ``length`` tokens overrun it, else None."""
    config = getattr(model, "config", None)
    limit = position_limit(config) if config is not None else None
    if limit is None or length <= limit[1] or not _holds_position_table(model):
        return None
    return limit


def sequence_length_problem(model: nn.Module, seq_len: int, field: str = "data.seq_len") -> Optional[str]:
    """Why ``model`` cannot run sequences of ``seq_len`` tokens (its position table is shorter), or None; ``field``
    is the setting that asks for that length."""
    limit = _table_limit(model, seq_len)
    if limit is None:
        return None
    key, value = limit
    return (f"{field}={seq_len} is longer than the {value} positions {type(model).__name__} embeds "
            f"(model.config.{key}={value}, a learned or precomputed position table); use {field}<={value}, "
            f"or model.config.{key}={seq_len} for a model initialised at random")


def padded_length_problem(model: nn.Module, max_length: int, multiple: int = 1,
                          field: str = "data.max_length") -> Optional[str]:
    """Why ``model`` cannot run variable-length batches of samples of up to ``max_length`` tokens, or None: they are
    padded to a multiple of 8 (and of ``multiple``: a context-parallel split's chunks), and the padded positions are
    embedded too, so a table whose size is no such multiple is overrun by a sample that fits it."""
    padded = round_up(round_up(max_length), multiple)
    limit = _table_limit(model, padded)
    if limit is None:
        return None
    key, value = limit
    fitting = value // ALIGN * ALIGN
    while fitting and round_up(fitting, multiple) > value:
        fitting -= ALIGN
    shorter = f"use {field}<={fitting}, or " if fitting else ""
    rounding = f"a multiple of {ALIGN}" + (f", then of {multiple}" if multiple > 1 else "")
    return (f"{field}={max_length} pads each batch to {padded} tokens ({rounding}), past the {value} positions "
            f"{type(model).__name__} embeds (model.config.{key}={value}, a learned or precomputed position table); "
            f"{shorter}model.config.{key}={padded} for a model initialised at random")


def beyond_trained_positions(model: nn.Module, seq_len: int, field: str = "data.seq_len") -> Optional[str]:
    """A notice for a model that runs past ``max_position_embeddings`` without a table, or None."""
    limit = position_limit(getattr(model, "config", None))
    if limit is None or seq_len <= limit[1]:
        return None
    return (f"{field}={seq_len} is beyond model.config.{limit[0]}={limit[1]}; the model computes its positions "
            "and runs, but a pretrained one was not trained on them")
