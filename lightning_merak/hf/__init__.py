"""Hugging Face checkpoints in (:func:`load_pretrained`, shard by shard) and out (``merak-export``).

Attributes import on first use, so ``merak-export --help`` imports no torch.
"""

from lightning_merak.util.lazy import lazy_attributes

__all__ = [
    "ExportReport",
    "LoadReport",
    "check_vocabulary",
    "export_checkpoint",
    "load_pretrained",
    "load_pretrained_experts",
    "load_rank_pretrained",
    "model_record",
    "pretrained_causal_lm",
    "pretrained_config",
]

__getattr__ = lazy_attributes(__name__, {
    "ExportReport": ".export",
    "export_checkpoint": ".export",
    "LoadReport": ".checkpoint",
    "load_pretrained": ".checkpoint",
    "load_pretrained_experts": ".experts",
    "load_rank_pretrained": ".pretrained",
    "model_record": "lightning_merak.checkpoint.names",
    "check_vocabulary": ".pretrained",
    "pretrained_causal_lm": ".pretrained",
    "pretrained_config": ".pretrained",
})
