"""Model families and layer kinds tensor parallelism refuses, checked on the config before any process starts.

The automatic split (:mod:`~lightning_merak.parallel.tensor.blocks`) pairs column and row linear layers by data
flow. Mixers that are not such pairs (state-space scans, convolutions over projected channels, linear attention),
projections every head reads (multi-head latent attention's compressed keys and values) and layouts fixed for the
whole width would only be found out at the first batch, after the processes started, some of them after minutes of
probing. They are refused from the config instead, naming the reason, so ``merak-train`` and the strategy's
``validate_before_launch`` stop before launch and the planner leaves their degrees out.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_merak.parallel.tensor.head_counts import local_key_value_heads

__all__ = ["UNSEQUENCED_FAMILIES", "UNSPLIT_FAMILIES", "UNSPLIT_LAYER_KINDS", "UNSPLIT_OPTIONS",
           "check_sequence_parallel_family", "check_tensor_parallel_degree", "unsplit_reason"]

_MAMBA = "Mamba mixers (convolution and state-space scan) are not column/row linear pairs"
_LATENT_ATTENTION = ("multi-head latent attention: every head reads its compressed key/value projection "
                     "(kv_a_proj_with_mqa) and its shared rotary key")
_SHARED_KEYS_VALUES = ("later layers reuse earlier layers' keys and values, handed over in a KVSharingDict "
                       "outside the blocks' inputs and outputs")

UNSPLIT_FAMILIES = {
    "afmoe": "its MoE router, mlp.router.gate, sits in the shared experts' split span but needs all its outputs",
    "axk1": _LATENT_ATTENTION,
    "axk2": _LATENT_ATTENTION,
    "bailing_hybrid": "its linear-attention layers keep per-head gate biases and state outside nn.Linear pairs",
    "codegen": ("its attention reads the fused qkv_proj as mp_num=4 interleaved [q | v | k] groups of the whole "
                "width, a layout a rank's share of the heads does not keep"),
    "deepseek_v2": _LATENT_ATTENTION,
    "deepseek_v3": _LATENT_ATTENTION,
    "deepseek_v32": _LATENT_ATTENTION,
    "diffllama": "differential attention's lambda parameters are shared by all heads inside the attention",
    "doge": "its dynamic mask projection reads every value head",
    "dots3_note_text": _LATENT_ATTENTION,
    "falcon_h1": ("every layer runs a Mamba-2 mixer (fused in_proj, convolution and state-space scan) beside its "
                  "attention, and such mixers are not column/row linear pairs"),
    "falcon_mamba": _MAMBA,
    "gemma3n_text": _SHARED_KEYS_VALUES,
    "gemma4_text": _SHARED_KEYS_VALUES,
    "gemma4_unified_text": _SHARED_KEYS_VALUES,
    "glm4_moe_lite": _LATENT_ATTENTION,
    "glm_moe_dsa": _LATENT_ATTENTION,
    "hy_v4": _LATENT_ATTENTION,
    "jamba": _MAMBA,
    "jetmoe": "its mixture-of-attention-heads layers hold no column/row linear pairs",
    "kimi_linear": ("its full-attention layers are multi-head latent attention (every head reads the compressed "
                    "key/value projection kv_a_proj_with_mqa), its others Kimi delta attention (convolutions and a "
                    "recurrent scan)"),
    "lfm3": "its short-convolution layers mix the projected channels outside nn.Linear pairs",
    "llama4_text": "its MoE router returns a tuple from inside the split span",
    "longcat_flash": _LATENT_ATTENTION,
    "mamba": _MAMBA,
    "mamba2": "Mamba-2 mixers (fused in_proj, convolution and state-space scan) are not column/row linear pairs",
    "minicpm3": _LATENT_ATTENTION,
    "minimax": "its lightning (linear) attention keeps state outside nn.Linear pairs",
    "recurrent_gemma": "its recurrent blocks (convolution and RG-LRU) are not column/row linear pairs",
    "rwkv": "RWKV time mixing is not column/row linear pairs",
    "xlstm": "xLSTM cells are not column/row linear pairs",
    "youtu": _LATENT_ATTENTION,
}
"""transformers families the pipeline tracer cuts (or may) but tensor parallelism cannot split, with the reason
(the coverage sweep in ``tests/test_tp_families.py`` and ``docs/design/tensor-parallel.md``)."""

UNSPLIT_LAYER_KINDS = {
    "linear_attention": "state-space, gated delta-net or other linear-attention mixers (convolutions, recurrent scans)",
    "conv": "short-convolution mixers over the projected channels",
}
"""Layer kinds of hybrid families (``config.layer_types`` or ``layers_block_type``: Qwen3-Next, Qwen3.5, Nemotron-H,
Granite-4.0-H, Bamba, Zamba, OLMo-Hybrid, LFM2) that do not split; a config without such layers is not refused
for its family (Granite-4.0's attention-only models, LFM2 with attention layers alone split exactly)."""


UNSPLIT_OPTIONS = {
    ("stablelm", "qk_layernorm"): ("its per-head query/key LayerNorms (qk_layernorm=True, StableLM 2) are one "
                                   "ModuleList over every head, which no rank's heads select"),
}
"""``(family, config flag)`` → why the family, which splits otherwise, does not with the flag set."""

UNSEQUENCED_FAMILIES = {
    "bloom": "its attention (BloomAttention) adds the residual to its row layer's output before returning it",
    "mpt": "its MLP (MptMLP) adds the residual to its row layer's output before returning it",
    "opt": "its decoder layer holds the MLP's fc1 and fc2 itself, with no MLP submodule to gather the sequence at",
}
"""Families that split by tensor parallelism but not with ``sequence_parallel``, whose gathers and reduce-scatters
need each attention/MLP submodule to take the hidden states and return its row layer's output unchanged."""


def check_sequence_parallel_family(config: Any, tensor_parallel: int) -> None:
    """Refuse, before any work, ``sequence_parallel`` for a family whose blocks do not fit it (found at the first
    batch otherwise, after launch)."""
    for holder in _configs(config) if config is not None else []:
        family = getattr(holder, "model_type", None)
        if family in UNSEQUENCED_FAMILIES:
            raise ValueError(f"sequence_parallel with tensor_parallel={tensor_parallel}: {family} cannot be split "
                             f"along the sequence ({UNSEQUENCED_FAMILIES[family]}); use sequence_parallel=False")


def _configs(config: Any) -> list[Any]:
    """``config`` and, for a multimodal one, its language model's (whose family and layers the trunk has)."""
    text = getattr(config, "text_config", None)
    return [config] if text is None or text is config else [config, text]


def unsplit_reason(config: Any) -> Optional[tuple[str, str]]:
    """``(family, reason)`` when ``config``'s family, or one of its layer kinds, does not split; else None."""
    configs = _configs(config)
    for holder in configs:
        family = getattr(holder, "model_type", None)
        if family in UNSPLIT_FAMILIES:
            return family, UNSPLIT_FAMILIES[family]
        for (flagged, flag), reason in UNSPLIT_OPTIONS.items():
            if family == flagged and getattr(holder, flag, False) is True:
                return family, reason
    for holder in configs:
        for attribute in ("layer_types", "layers_block_type"):
            kinds = getattr(holder, attribute, None)
            if not isinstance(kinds, (list, tuple)):
                continue
            for kind, reason in UNSPLIT_LAYER_KINDS.items():
                layers = [index for index, value in enumerate(kinds) if value == kind]
                if layers:
                    shown = ", ".join(map(str, layers[:8])) + (", …" if len(layers) > 8 else "")
                    where = f"layer{'s' if len(layers) > 1 else ''} {shown} in config.{attribute}"
                    return getattr(config, "model_type", None) or type(config).__name__, (
                        f"its {kind} layers ({where}) are {reason}, not column/row linear pairs")
    return None


def check_tensor_parallel_degree(config: Any, tensor_parallel: int) -> None:
    """Refuse, before any work, a family that does not split or a degree its head counts and widths rule out."""
    if tensor_parallel == 1 or config is None:
        return
    unsplit = unsplit_reason(config)
    if unsplit is not None:
        family, reason = unsplit
        raise ValueError(f"tensor_parallel={tensor_parallel}: {family} cannot be split by tensor parallelism "
                         f"({reason}); use tensor_parallel=1")
    for attribute in ("num_attention_heads", "n_head", "n_heads", "intermediate_size", "hidden_size"):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and value % tensor_parallel:
            raise ValueError(
                f"tensor_parallel={tensor_parallel} does not divide {attribute}={value}; choose a "
                f"tensor_parallel that divides it"
            )
    for attribute in ("num_key_value_heads", "num_kv_heads"):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            local_key_value_heads(value, tensor_parallel)
