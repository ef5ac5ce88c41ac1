"""Model FLOPs per token of a transformers decoder, forward and backward, from its config alone (pure).

MFU's numerator: what the model needs, not what the run did, so recomputation is not counted, nor is padding:
``TrainingMetrics`` multiplies these per-token FLOPs by a batch's real tokens only (a variable-length batch's
sample lengths, an attention mask's ones; every position of a batch that marks no padding), each sample's at
its own length.
Matmuls only (norms, activations and the softmax are under 1 % of a step): a matmul of an ``m × n`` weight
costs ``2·m·n`` FLOPs a token forward, backward twice that (input and weight gradients), so training costs
three forwards; a frozen weight (a base under adapters, frozen layers) gets no weight gradient, so its matmul
costs two. Attention's scores and weighted sum are counted over every key a query sees without the causal
mask, as in PaLM's MFU (appendix B: ``6N + 12·L·H·Q·T``), though a causal kernel may skip the masked half: the
whole sequence ``T``, or a sliding-window layer's window ``W`` (``min(W, T)`` keys: the same count as a full
layer where the window spans the sequence). An MoE layer counts its router, the ``top-k`` experts each token
reaches and the shared experts every token passes; the other experts cost nothing for that token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from torch import nn

__all__ = ["SUPPORTED_FAMILIES", "TransformerShape", "frozen_weight_fraction", "training_flops_per_token",
           "transformer_shape"]

_GATED_DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "cohere", "olmo",
                "olmo2", "granite")
_PLAIN_DENSE = ("gpt2",)
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_WINDOW_ON_EVERY_LAYER = ("mistral", "mixtral", "phi3", "qwen3_moe")
"""Families whose model applies ``sliding_window`` to every layer and whose config has no ``layer_types``."""
SUPPORTED_FAMILIES = tuple(sorted(_GATED_DENSE + _PLAIN_DENSE + _MOE))
"""The ``model_type`` values whose FLOPs :func:`transformer_shape` knows how to count."""


@dataclass(frozen=True)
class TransformerShape:
    """The sizes FLOPs depend on. ``moe_layers`` of the ``layers`` are MoE layers (0: dense model); the
    others use the dense MLP of width ``intermediate`` (gated: three matrices, else two). ``sliding_layers`` of
    the ``layers`` attend only the last ``sliding_window`` keys (0: none)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    gated: bool = True
    moe_layers: int = 0
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    shared_expert_gate: bool = False
    sliding_layers: int = 0
    sliding_window: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.sliding_layers <= self.layers or (self.sliding_layers and self.sliding_window < 1):
            raise ValueError(f"sliding_layers={self.sliding_layers} must be 0..layers={self.layers}, with "
                             f"sliding_window >= 1 (got {self.sliding_window}) where it is not 0")

    def weight_flops_per_token(self) -> float:
        """Forward FLOPs of one token's matmuls with weights (projections, MLPs, router, LM head)."""
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        projections = self.hidden * (q_width + 2 * kv_width) + q_width * self.hidden
        dense_mlp = (3 if self.gated else 2) * self.hidden * self.intermediate
        moe_mlp = (self.hidden * self.experts + self.experts_per_token * 3 * self.hidden * self.expert_intermediate
                   + 3 * self.hidden * self.shared_expert_intermediate + self.hidden * self.shared_expert_gate)
        dense_layers = self.layers - self.moe_layers
        multiply_adds = (self.layers * projections + dense_layers * dense_mlp + self.moe_layers * moe_mlp
                         + self.hidden * self.vocab)
        return 2.0 * multiply_adds

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs of one token's attention scores and weighted sum (no weights): over ``seq_len`` keys in a
        full layer, ``min(sliding_window, seq_len)`` in a sliding-window one."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        keys = ((self.layers - self.sliding_layers) * seq_len
                + self.sliding_layers * min(self.sliding_window, seq_len))
        return 2.0 * 2 * self.heads * self.head_dim * keys

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs of one token in a sequence of ``seq_len`` tokens."""
        return self.attention_flops_per_token(seq_len) + self.weight_flops_per_token()


def training_flops_per_token(shape: TransformerShape, seq_len: int, frozen_weight_fraction: float = 0.0) -> float:
    """Forward plus backward FLOPs of one token: three forwards, less the weight gradients that
    ``frozen_weight_fraction`` (0 to 1) of the weight matmuls skip because their weights are frozen."""
    if not 0.0 <= frozen_weight_fraction <= 1.0:
        raise ValueError(f"frozen_weight_fraction must be between 0 and 1 (the share of the weights that need no "
                         f"gradient), got {frozen_weight_fraction}")
    return 3.0 * shape.forward_flops_per_token(seq_len) - frozen_weight_fraction * shape.weight_flops_per_token()


def transformer_shape(config: Any) -> TransformerShape:
    """The shape of a transformers config (a ``PretrainedConfig`` or its ``to_dict()``).

    Raises ``ValueError`` naming the supported families for any other ``model_type``, and naming the key a
    config of a counted family lacks.
    """
    values: Mapping[str, Any] = config if isinstance(config, Mapping) else config.to_dict()
    family = str(values.get("model_type", ""))
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"no FLOP count for model_type={family!r}; counted families: {', '.join(SUPPORTED_FAMILIES)} "
                         "(pass flops_per_token= to TrainingMetrics for another model)")
    try:
        return _family_shape(values, family)
    except KeyError as missing:
        raise ValueError(f"no FLOP count for model_type={family!r}: its config has no {missing} "
                         "(pass flops_per_token= to TrainingMetrics to count it yourself)") from None


def _sliding_attention(values: Mapping[str, Any], family: str, layers: int) -> dict[str, int]:
    """How many layers attend through a sliding window, and its width, as transformers 5 builds the model: the
    ``"sliding_attention"`` entries of ``layer_types`` where the config has them (transformers derives them:
    Gemma2/3's alternation, Qwen2's layers from ``max_window_layers`` on), else every layer of a family that
    windows them all; none without a ``sliding_window`` or with ``use_sliding_window`` off."""
    window = values.get("sliding_window")
    if not window or values.get("use_sliding_window") is False:
        return {}
    layer_types = values.get("layer_types")
    if layer_types is None:
        sliding = layers if family in _WINDOW_ON_EVERY_LAYER else 0
    else:
        sliding = sum(1 for kind in layer_types if kind == "sliding_attention")
    return {"sliding_layers": sliding, "sliding_window": int(window)} if sliding else {}


def _family_shape(values: Mapping[str, Any], family: str) -> TransformerShape:
    """The shape of a config of a counted ``family`` (``KeyError`` for a key it lacks)."""
    if family == "gpt2":
        hidden, heads = int(values["n_embd"]), int(values["n_head"])
        return TransformerShape(layers=int(values["n_layer"]), hidden=hidden, heads=heads, kv_heads=heads,
                                head_dim=hidden // heads, vocab=int(values["vocab_size"]),
                                intermediate=int(values.get("n_inner") or 4 * hidden), gated=False)
    hidden, heads, layers = int(values["hidden_size"]), int(values["num_attention_heads"]), int(
        values["num_hidden_layers"])
    common = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=int(values.get("num_key_value_heads") or heads),
                  head_dim=int(values.get("head_dim") or hidden // heads), vocab=int(values["vocab_size"]),
                  **_sliding_attention(values, family, layers))
    if family in _GATED_DENSE:
        return TransformerShape(intermediate=int(values["intermediate_size"]), **common)
    if family == "mixtral":
        return TransformerShape(intermediate=0, moe_layers=layers, experts=int(values["num_local_experts"]),
                                experts_per_token=int(values["num_experts_per_tok"]),
                                expert_intermediate=int(values["intermediate_size"]), **common)
    if family == "olmoe":
        return TransformerShape(intermediate=0, moe_layers=layers, experts=int(values["num_experts"]),
                                experts_per_token=int(values["num_experts_per_tok"]),
                                expert_intermediate=int(values["intermediate_size"]), **common)
    return _qwen_moe_shape(values, family, common)


def _qwen_moe_shape(values: Mapping[str, Any], family: str, common: dict[str, Any]) -> TransformerShape:
    """Qwen2-MoE and Qwen3-MoE: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` is MoE (the
    others use the dense ``intermediate_size``); Qwen2-MoE adds a gated shared expert to each MoE layer.
    Transformers 5 writes Qwen3-MoE's ``num_experts`` as ``num_local_experts`` in ``to_dict()``."""
    layers = common["layers"]
    step = int(values.get("decoder_sparse_step") or 1)
    dense_only = set(values.get("mlp_only_layers") or ())
    experts = int(values["num_experts"] if "num_experts" in values else values["num_local_experts"])
    moe_layers = sum(1 for index in range(layers)
                     if index not in dense_only and experts > 0 and (index + 1) % step == 0)
    shared: Optional[int] = values.get("shared_expert_intermediate_size") if family == "qwen2_moe" else None
    return TransformerShape(intermediate=int(values["intermediate_size"]), moe_layers=moe_layers, experts=experts,
                            experts_per_token=int(values["num_experts_per_tok"]),
                            expert_intermediate=int(values["moe_intermediate_size"]),
                            shared_expert_intermediate=int(shared or 0), shared_expert_gate=bool(shared), **common)


def frozen_weight_fraction(model: nn.Module) -> float:
    """The share of ``model``'s matmul weights that need no gradient, by element count, for the FLOP count (whose
    frozen matmuls skip their weight gradient): weights of two or more dimensions held by a module other than an
    embedding lookup (a tied LM head's counted), an adapter's own weights left out (the count is the base
    model's: a layer's weights outside its ``base_layer``, as PEFT's tuner layers and their tensor-parallel splits
    hold them). 0 without such weights."""
    adapter_weights: set[int] = set()
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if isinstance(base, nn.Module):
            in_base = {id(param) for param in base.parameters()}
            adapter_weights.update(id(param) for param in module.parameters() if id(param) not in in_base)
    counted: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if not isinstance(module, nn.Embedding):
            counted.update((id(param), param) for param in module.parameters(recurse=False)
                           if param.dim() >= 2 and id(param) not in adapter_weights)
    total = sum(param.numel() for param in counted.values())
    frozen = sum(param.numel() for param in counted.values() if not param.requires_grad)
    return frozen / total if total else 0.0
