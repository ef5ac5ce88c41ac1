"""What a checkpoint records of the run that saved it, held against a run resuming it: the model's architecture
(the transformers config of :func:`~lightning_merak.checkpoint.names.model_record`) and the optimizer's parameter
groups (their names).

A resume into another architecture must be refused, not trusted to the load: merak3d reads only the tensors the
model asks for, so a model with fewer layers or another head split loads what it names and trains on, another
function than the checkpoint's. A resume with another optimizer must be refused before its state is paired with this
run's parameter groups, where it fails deep in torch (or, its groups truncated, in the learning-rate schedule); one
of the same group names but another class (AdamW's groups resumed by SGD) is told by the settings its groups hold,
which the load puts in place of this optimizer's, whose step then misses its own. Pure: plain dicts in, messages out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

__all__ = ["ARCHITECTURE_FIELDS", "architecture_differences", "architecture_problem", "group_names",
           "optimizer_groups_problem", "optimizer_settings_problem"]

ARCHITECTURE_FIELDS = (
    "model_type", "num_hidden_layers", "n_layer", "hidden_size", "n_embd", "intermediate_size", "n_inner", "ffn_dim",
    "num_attention_heads", "n_head", "num_key_value_heads", "multi_query", "head_dim", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "first_k_dense_replace",
    "decoder_sparse_step", "mlp_only_layers", "layer_types",
)
"""transformers config fields that decide which tensors a model holds and what it computes with them (names over
the families: Llama's and GPT-2's); dropout, positions' reach and caching are left out, a resume may change them,
and so is the vocabulary, which the data sets (the tensors' shapes tell it)."""


def architecture_differences(saved: Mapping[str, Any], model: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(field, saved value, model value)`` of each :data:`ARCHITECTURE_FIELDS` entry both configs hold and differ
    in; only ``model_type`` when that differs (the other fields then mean other things)."""
    fields = ["model_type"] if saved.get("model_type") != model.get("model_type") else ARCHITECTURE_FIELDS
    return [(field, saved.get(field), model.get(field)) for field in fields
            if field in saved and field in model and saved[field] != model[field]]


def architecture_problem(saved: Optional[Mapping[str, Any]], model: Optional[Mapping[str, Any]]) -> Optional[str]:
    """Why a model of transformers config ``model`` cannot resume a checkpoint whose recorded config is ``saved``
    (either None: nothing to compare), naming each field that differs and its setting; None if it can."""
    if saved is None or model is None:
        return None
    differences = architecture_differences(saved, model)
    if not differences:
        return None
    shown = "; ".join(f"{field} is {saved_value!r} there and {model_value!r} here"
                      for field, saved_value, model_value in differences)
    settings = " ".join(f"model.config.{field}={saved_value!r}" for field, saved_value, _ in differences
                        if field != "model_type")
    model_setting = f"a {saved['model_type']} model: the model option and model.config it was trained with" \
        if differences[0][0] == "model_type" else settings
    return (f"the checkpoint was saved from another model: {shown}; the load would read only the tensors this model "
            f"names and train another function than the checkpoint's. Resume with the model it was trained with "
            f"({model_setting}), or start afresh from its weights (merak-export, then model.path)")


def group_names(groups: Sequence[Mapping[str, Any]]) -> list[Optional[str]]:
    """The ``name`` of each parameter group (None where a group has none)."""
    return [group.get("name") for group in groups]


def optimizer_groups_problem(saved: Sequence[Optional[str]], run: Sequence[Optional[str]],
                             fix: str) -> Optional[str]:
    """Why an optimizer with parameter groups named ``run`` cannot take a saved state whose groups are named
    ``saved`` (another count, or other names), with ``fix``; None if it can."""
    if list(saved) == list(run):
        return None
    return (f"the checkpoint's optimizer has {len(saved)} parameter groups {list(saved)}, this run's {len(run)} "
            f"{list(run)}: it was trained with another optimizer, whose state this one cannot take; {fix}")



def _settings(group: Mapping[str, Any]) -> frozenset[str]:
    """The setting names of a parameter group (its keys but the parameters)."""
    return frozenset(group) - {"params", "param_names"}


def optimizer_settings_problem(saved: Sequence[Mapping[str, Any]], run: Sequence[Mapping[str, Any]],
                               fix: str) -> Optional[str]:
    """Why an optimizer whose parameter groups are ``run`` cannot take a saved state whose groups are ``saved`` (of
    the same names): a group holds settings this optimizer has not and lacks some of its own, those of another
    class, which the load would put in place of this one's; with ``fix``. None if not: settings only one side holds
    are another torch release's (each adds, and fills in what an older state lacks)."""
    for saved_group, run_group in zip(saved, run):
        foreign = sorted(_settings(saved_group) - _settings(run_group))
        missing = sorted(_settings(run_group) - _settings(saved_group))
        if foreign and missing:
            return (f"the checkpoint's optimizer groups hold settings this optimizer has not ({', '.join(foreign)}) "
                    f"and lack its own ({', '.join(missing)}): it was trained with another optimizer, whose state "
                    f"this one cannot take; {fix}")
    return None
