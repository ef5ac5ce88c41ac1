"""Model FLOPs per token of a transformers decoder, forward and backward, from its config alone (pure).

MFU's numerator: what the model needs, not what the run did, so recomputation is not counted, nor is padding:
``TrainingMetrics`` multiplies these per-token FLOPs by a batch's real tokens only (a variable-length batch's
sample lengths, an attention mask's ones; every position of a batch that marks no padding), each sample's at
its own length.
Matmuls only (norms, activations and the softmax are under 1 % of a step): a matmul of an ``m × n`` weight
costs ``2·m·n`` FLOPs a token forward, backward twice that (input and weight gradients), so training costs
three forwards. Attention's scores and weighted sum are counted over the whole sequence, as in PaLM's MFU
(appendix B: ``6N + 12·L·H·Q·T``), though a causal kernel may skip the masked half. An MoE layer counts its
router, the ``top-k`` experts each token reaches and the shared experts every token passes; the other
experts cost nothing for that token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = ["SUPPORTED_FAMILIES", "TransformerShape", "training_flops_per_token", "transformer_shape"]

_GATED_DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "cohere", "olmo",
                "olmo2", "granite")
_PLAIN_DENSE = ("gpt2",)
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
SUPPORTED_FAMILIES = tuple(sorted(_GATED_DENSE + _PLAIN_DENSE + _MOE))
"""The ``model_type`` values whose FLOPs :func:`transformer_shape` knows how to count."""


@dataclass(frozen=True)
class TransformerShape:
    """The sizes FLOPs depend on. ``moe_layers`` of the ``layers`` are MoE layers (0: dense model); the
    others use the dense MLP of width ``intermediate`` (gated: three matrices, else two)."""

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

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs of one token in a sequence of ``seq_len`` tokens."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        projections = self.hidden * (q_width + 2 * kv_width) + q_width * self.hidden
        scores_and_values = 2 * q_width * seq_len
        dense_mlp = (3 if self.gated else 2) * self.hidden * self.intermediate
        moe_mlp = (self.hidden * self.experts + self.experts_per_token * 3 * self.hidden * self.expert_intermediate
                   + 3 * self.hidden * self.shared_expert_intermediate + self.hidden * self.shared_expert_gate)
        dense_layers = self.layers - self.moe_layers
        multiply_adds = (self.layers * (projections + scores_and_values) + dense_layers * dense_mlp
                         + self.moe_layers * moe_mlp + self.hidden * self.vocab)
        return 2.0 * multiply_adds


def training_flops_per_token(shape: TransformerShape, seq_len: int) -> float:
    """Forward plus backward FLOPs of one token: three forwards."""
    return 3.0 * shape.forward_flops_per_token(seq_len)


def transformer_shape(config: Any) -> TransformerShape:
    """The shape of a transformers config (a ``PretrainedConfig`` or its ``to_dict()``).

    Raises ``ValueError`` naming the supported families for any other ``model_type``.
    """
    values: Mapping[str, Any] = config if isinstance(config, Mapping) else config.to_dict()
    family = str(values.get("model_type", ""))
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"no FLOP count for model_type={family!r}; counted families: {', '.join(SUPPORTED_FAMILIES)} "
                         "(pass flops_per_token= to TrainingMetrics for another model)")
    if family == "gpt2":
        hidden, heads = int(values["n_embd"]), int(values["n_head"])
        return TransformerShape(layers=int(values["n_layer"]), hidden=hidden, heads=heads, kv_heads=heads,
                                head_dim=hidden // heads, vocab=int(values["vocab_size"]),
                                intermediate=int(values.get("n_inner") or 4 * hidden), gated=False)
    hidden, heads, layers = int(values["hidden_size"]), int(values["num_attention_heads"]), int(
        values["num_hidden_layers"])
    common = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=int(values.get("num_key_value_heads") or heads),
                  head_dim=int(values.get("head_dim") or hidden // heads), vocab=int(values["vocab_size"]))
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
    others use the dense ``intermediate_size``); Qwen2-MoE adds a gated shared expert to each MoE layer."""
    layers = common["layers"]
    step = int(values.get("decoder_sparse_step") or 1)
    dense_only = set(values.get("mlp_only_layers") or ())
    experts = int(values["num_experts"])
    moe_layers = sum(1 for index in range(layers)
                     if index not in dense_only and experts > 0 and (index + 1) % step == 0)
    shared: Optional[int] = values.get("shared_expert_intermediate_size") if family == "qwen2_moe" else None
    return TransformerShape(intermediate=int(values["intermediate_size"]), moe_layers=moe_layers, experts=experts,
                            experts_per_token=int(values["num_experts_per_tok"]),
                            expert_intermediate=int(values["moe_intermediate_size"]),
                            shared_expert_intermediate=int(shared or 0), shared_expert_gate=bool(shared), **common)
