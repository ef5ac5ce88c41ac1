"""Quantization-aware PEFT adapters: Q-BaRA and QA-HiRA (arXiv 2407.17029), plus a pure-torch INT4 base.

Importing this package registers ``QBARA`` and ``QAHIRA`` with PEFT, so ``get_peft_model``,
``save_pretrained``, ``PeftModel.from_pretrained`` and ``merge_and_unload`` work as for LoRA.
"""

from .base import PooledAdapterConfig, PooledAdapterLayer, PooledAdapterModel, check_target_layer
from .bnb_layout import keep_bnb_training_layout
from .int4 import (
    QuantLinearInt4,
    dequantize_int4,
    load_int4_model,
    quantize_int4,
    quantize_linear_layers_int4,
    save_int4_model,
)
from .int4_experts import quantize_experts_int4
from .pooling import expand_outputs, per_group_delta, pool_inputs, qbara_rank, tiled_delta_weight
from .qahira import QAHIRA_PEFT_TYPE, QAHiRAConfig, QAHiRAExperts, QAHiRALinear, QAHiRAModel
from .qbara import QBARA_PEFT_TYPE, QBaRAConfig, QBaRAExperts, QBaRALinear, QBaRAModel
from .quantize import QUANTIZATIONS, quantize_model
from .registration import register_peft_methods

register_peft_methods()

__all__ = [
    "QAHIRA_PEFT_TYPE",
    "QBARA_PEFT_TYPE",
    "QUANTIZATIONS",
    "PooledAdapterConfig",
    "PooledAdapterLayer",
    "PooledAdapterModel",
    "QAHiRAConfig",
    "QAHiRAExperts",
    "QAHiRALinear",
    "QAHiRAModel",
    "QBaRAConfig",
    "QBaRAExperts",
    "QBaRALinear",
    "QBaRAModel",
    "QuantLinearInt4",
    "check_target_layer",
    "dequantize_int4",
    "expand_outputs",
    "keep_bnb_training_layout",
    "load_int4_model",
    "per_group_delta",
    "pool_inputs",
    "qbara_rank",
    "quantize_experts_int4",
    "quantize_int4",
    "quantize_linear_layers_int4",
    "quantize_model",
    "register_peft_methods",
    "save_int4_model",
    "tiled_delta_weight",
]
