"""``model.path``: what ``merak-train`` does with a local pretrained transformers directory.

Under DDP every rank loads the whole model (:func:`pretrained_causal_lm`, i.e. ``from_pretrained``).
Under merak3d the model is built from :func:`pretrained_config` (on the meta device), split, and each
rank fills only its shards with :func:`load_rank_pretrained` (its experts only under expert parallelism).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from lightning_merak.checkpoint.names import build_meta_model
from lightning_merak.hf.checkpoint import PretrainedFiles, check_pretrained_files, mismatch_fix
from lightning_merak.hf.experts import load_pretrained_experts, plan_experts
from lightning_merak.parallel.init_parity import eager_init_suspended
from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE

__all__ = ["check_pretrained_weights", "check_vocabulary", "load_rank_pretrained", "pretrained_causal_lm",
           "pretrained_config", "validated_config"]


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


def _absolute(path: Union[str, Path]) -> Path:
    """``path`` made absolute: transformers records the folder it loads from (``_name_or_path``), where
    ``merak-export`` later finds the tokenizer files, and a relative one would be looked up from the export's folder."""
    return Path(os.path.abspath(Path(path).expanduser()))


def pretrained_config(path: Union[str, Path], overrides: Optional[Mapping[str, Any]] = None) -> Any:
    """The transformers config saved in ``path``, with ``overrides`` (``model.config``) applied."""
    from transformers import AutoConfig

    return validated_config(lambda: AutoConfig.from_pretrained(_absolute(path), **dict(overrides or {})),
                            f"model.config over model.path={path}")


def causal_only_as_decoder(model_type: str) -> bool:
    """Whether transformers' causal-LM class for ``model_type`` is an encoder family's (BERT, RoBERTa, ELECTRA, ...),
    causal only with ``config.is_decoder`` set: its constructor reads the flag (to warn, or to set it itself)."""
    import inspect

    import transformers  # lazy: transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # lazy: transformers

    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)
    try:
        return model_class is not None and "is_decoder" in inspect.getsource(model_class.__init__)
    except (OSError, TypeError):  # no source to read: such families ship theirs with transformers
        return False


def refuse_bidirectional_override(model_type: str, overrides: Mapping[str, Any]) -> None:
    """Refuse ``model.config.is_decoder`` other than true for an encoder family: its causal-LM head would attend to
    the later tokens it is trained to predict."""
    if overrides.get("is_decoder", True) is not True:
        raise ValueError(f"model.config.is_decoder={overrides['is_decoder']!r}: {model_type}'s causal-LM head "
                         "attends to later tokens unless is_decoder=true; drop the key (it is set for you)")


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
    context: the meta device under merak3d, whose ranks then load their shards). Weights that are not the
    config's model are refused first, before any process starts (:func:`check_pretrained_weights`).
    """
    from transformers import AutoModelForCausalLM

    config = pretrained_config(path, overrides)
    check_vocabulary(data_vocab_size, config, path)
    if causal_only_as_decoder(config.model_type):  # an encoder checkpoint (BERT...) saved with is_decoder=False
        refuse_bidirectional_override(config.model_type, overrides or {})
        config.is_decoder = True
    if not weights:
        with eager_init_suspended():  # the checkpoint replaces every weight: no eager draws on meta
            structure = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        try:
            check_pretrained_weights(path, structure, overrides)
        except NotImplementedError as error:  # a family whose tensors transformers converts, not just renames:
            raise ValueError(f"model.path={path}: {error}") from None  # merak3d's ranks read renamed ones only
        return structure
    try:
        check_pretrained_weights(path, build_meta_model(config), overrides)
    except NotImplementedError:  # from_pretrained converts them; its loading report is checked below
        pass
    model, report = AutoModelForCausalLM.from_pretrained(_absolute(path), config=config, dtype=torch.float32,
                                                         output_loading_info=True)
    problems = [f"{kind.replace('_', ' ')} {sorted(map(str, report[kind]))[:8]}" for kind in _LOADING_PROBLEMS
                if report.get(kind)]
    if problems:  # what from_pretrained would otherwise initialise at random, or drop, with a logged warning
        raise ValueError(f"model.path={path}: its weights do not match {type(model).__name__} built from its "
                         f"config.json{' and model.config' if overrides else ''} ({'; '.join(problems)}); "
                         f"{mismatch_fix(overrides)}")
    return model


_LOADING_PROBLEMS = ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
"""What ``from_pretrained``'s loading report lists that it would otherwise only log."""


def check_pretrained_weights(path: Union[str, Path], model: nn.Module,
                             overrides: Optional[Mapping[str, Any]] = None) -> None:
    """Refuse, before any process starts and reading only the files' headers, weights in ``path`` that are not the
    unsplit ``model``'s (meta is fine): a shard the index names but the folder lacks, a tensor missing or left over
    (another architecture's weights), a shape that differs. Under merak3d the ranks would find them only after launch;
    ``from_pretrained`` would initialise a missing tensor at random and drop an unexpected one, logging a warning.
    ``overrides`` (``model.config``, which built ``model``) are named as the likely cause of a mismatch."""
    try:
        files = PretrainedFiles.open(Path(path).expanduser())
        layouts = plan_experts(model, files.shapes)
        check_pretrained_files(files, model, {name: layout.keys() for name, layout in layouts.items()}, overrides)
    except ValueError as error:
        raise ValueError(f"model.path={path}: {error}") from None


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
