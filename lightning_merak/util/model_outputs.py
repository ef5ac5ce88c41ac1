"""What a transformers causal LM's call returns, read the same way everywhere: logits, the router aux loss,
and the cache turned off for training."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

__all__ = ["logits_of", "no_cache", "router_aux_coefficient", "weighted_router_aux_loss"]


def no_cache(model: nn.Module) -> None:
    """Turn off a transformers model's key/value cache: training, tracing and sub-batches keep none (a cache
    spans the whole batch)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False


AUX_COEFFICIENT_NAMES = ("router_aux_loss_coef", "aux_loss_coef")
"""What transformers' MoE families call the weight of their aux loss (JetMoE: ``aux_loss_coef``)."""


def router_aux_coefficient(model: nn.Module) -> Any:
    """The coefficient a transformers MoE model weights its aux loss with (the model's attribute, else its
    config's, under either of :data:`AUX_COEFFICIENT_NAMES`), or ``None``."""
    config = getattr(model, "config", None)
    for name in AUX_COEFFICIENT_NAMES:
        for owner in (model, config):
            coefficient = getattr(owner, name, None)
            if coefficient is not None:
                return coefficient
    return None


def weighted_router_aux_loss(model: nn.Module, output: Any) -> Optional[torch.Tensor]:
    """``router_aux_loss_coef × aux_loss`` of a transformers MoE output (what its own loss adds with labels),
    or ``None`` where the output carries no aux loss (``output_router_logits=False``, the families' default)."""
    aux = getattr(output, "aux_loss", None)
    if not isinstance(aux, torch.Tensor):
        return None
    coefficient = router_aux_coefficient(model)
    if coefficient is None:
        raise ValueError(f"{type(model).__name__} returned a router aux loss but has no router_aux_loss_coef to "
                         "weight it; set model.config.output_router_logits=False or give the config the coefficient")
    return coefficient * aux


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output: a tensor, or an object with ``.logits`` (transformers)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"the model returned {type(output).__name__}; merak3d needs a logits tensor or an output with .logits"
    )
