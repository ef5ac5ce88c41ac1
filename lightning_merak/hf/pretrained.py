"""``model.path``: what ``merak-train`` does with a local pretrained transformers directory.

Under DDP every rank loads the whole model (:func:`pretrained_causal_lm`, i.e. ``from_pretrained``).
Under merak3d the model is built from :func:`pretrained_config` (on the meta device), split, and each
rank fills only its shards with :func:`load_rank_pretrained` (its experts only under expert parallelism).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from lightning_merak.hf.experts import load_pretrained_experts
from lightning_merak.parallel.init_parity import eager_init_suspended
from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE

__all__ = ["check_vocabulary", "load_rank_pretrained", "pretrained_causal_lm", "pretrained_config", "validated_config"]


def _validation_errors() -> tuple[type[Exception], ...]:
    """What a transformers config raises for values it rejects: ValueError, and (transformers 5's strict
    dataclasses) huggingface_hub's validation errors, which are not ValueErrors."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # huggingface_hub before strict dataclasses
        return (ValueError,)
    return (ValueError, StrictDataclassError)


def validated_config(make: Callable[[], Any], what: str) -> Any:
    """``make()``, a transformers config; a value it rejects is refused as a ValueError that names ``what`` (the
    options that set it), before any process starts, instead of a validator's traceback."""
    try:
        return make()
    except _validation_errors() as error:
        reason = str(error.__cause__ or error).strip()
        raise ValueError(f"{what} is not a valid configuration: {reason}") from error


def pretrained_config(path: Union[str, Path], overrides: Optional[Mapping[str, Any]] = None) -> Any:
    """The transformers config saved in ``path``, with ``overrides`` (``model.config``) applied."""
    from transformers import AutoConfig

    return validated_config(lambda: AutoConfig.from_pretrained(Path(path).expanduser(), **dict(overrides or {})),
                            f"model.config over model.path={path}")


def check_vocabulary(data_vocab_size: int, config: Any, path: Union[str, Path]) -> None:
    """Refuse data whose token ids the checkpoint's embedding cannot look up."""
    model_vocab = getattr(config, "vocab_size", None)
    if model_vocab is not None and data_vocab_size > model_vocab:
        raise ValueError(
            f"the data has a vocabulary of {data_vocab_size} tokens but the checkpoint in {path} embeds "
            f"{model_vocab}; tokenize with the checkpoint's tokenizer (data=text data.tokenizer_path={path}) "
            f"or, for generated data, set data.vocab_size<={model_vocab}"
        )


def pretrained_causal_lm(path: Union[str, Path], data_vocab_size: int,
                         overrides: Optional[Mapping[str, Any]] = None, *, weights: bool = True) -> nn.Module:
    """The pretrained model of ``path`` in float32, as ``AutoModelForCausalLM.from_pretrained(path)`` loads it.

    With ``weights=False`` only its structure is built (``from_config``, in the caller's device
    context: the meta device under merak3d, whose ranks then load their shards).
    """
    from transformers import AutoModelForCausalLM

    config = pretrained_config(path, overrides)
    check_vocabulary(data_vocab_size, config, path)
    if not weights:
        with eager_init_suspended():  # the checkpoint replaces every weight: no eager draws on meta
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(Path(path).expanduser(), config=config, dtype=torch.float32)


def load_rank_pretrained(model: nn.Module, tensors: Mapping[str, torch.Tensor], path: Union[str, Path],
                         layout_changes: Optional[Mapping[str, Any]] = None) -> Any:
    """Fill this rank's ``tensors`` of ``model`` from ``path``: merak3d's pretrained seam, MoE models included.

    Expert parameters are read for the experts
    :func:`~lightning_merak.plugins.moe.experts.enable.enable_expert_parallel` left on this rank (every
    expert without expert parallelism); everything else as
    :func:`~lightning_merak.hf.checkpoint.load_pretrained` reads it. Returns the
    :class:`~lightning_merak.hf.experts.ExpertLoadReport`.
    """
    places = {(shard.ep_rank, shard.ep_size) for module in model.modules()
              if (shard := getattr(module, SHARD_ATTRIBUTE, None)) is not None}
    if len(places) > 1:
        raise ValueError(f"experts modules of one model sit at different expert-parallel places {sorted(places)}; "
                         "enable expert parallelism once per model (enable_expert_parallel)")
    ep_rank, ep_size = places.pop() if places else (0, 1)
    return load_pretrained_experts(tensors, path, ep_rank=ep_rank, ep_size=ep_size, layout_changes=layout_changes)
