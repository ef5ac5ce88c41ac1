"""The built-in causal LM with a fixed optimizer, for runs compared step by step with a single-process reference."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_merak.modules.causal_lm import CausalLMModule

__all__ = ["FIXED_OPTIMIZERS", "FixedOptimizerModule"]

FIXED_OPTIMIZERS = {"sgd": (torch.optim.SGD, 0.5), "adam": (torch.optim.Adam, 0.01)}
"""Each optimizer :class:`FixedOptimizerModule` takes, with its default learning rate."""


class FixedOptimizerModule(CausalLMModule):
    """:class:`CausalLMModule` trained by plain SGD (or Adam) at one learning rate over its trainable parameters.

    No learning-rate schedule, so a distributed run's steps match a reference that steps the same optimizer by hand
    (SGD's weights follow the gradients linearly; Adam's state is what checkpoints carry)."""

    def __init__(self, model: Optional[nn.Module], optimizer: str = "sgd", *, lr: Optional[float] = None,
                 **kwargs: Any) -> None:
        if optimizer not in FIXED_OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r}; choose one of {', '.join(FIXED_OPTIMIZERS)}")
        super().__init__(model, **kwargs)
        self.optimizer_name = optimizer
        self.lr = FIXED_OPTIMIZERS[optimizer][1] if lr is None else lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer_class = FIXED_OPTIMIZERS[self.optimizer_name][0]
        return optimizer_class([param for param in self.model.parameters() if param.requires_grad], lr=self.lr)
