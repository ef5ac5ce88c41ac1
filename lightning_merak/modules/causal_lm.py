"""Causal language models built from transformers config classes, and their LightningModule.

Models are built with random weights from a config (nothing is downloaded), so the
same code runs offline, in CI and on a cluster. :class:`CausalLMModule` implements
:class:`~lightning_merak.protocols.module_contract.Merak3DModule`, the small contract merak3d relies on
(``model``, ``split_batch``, ``loss_from_logits``, ``compute_loss``: what a strategy that runs the model in
pieces feeds, scores and replaces). Without any strategy the module trains on one device like any other
LightningModule.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_merak.checkpoint.names import MODEL_RECORD_KEY, model_record
from lightning_merak.hf.pretrained import load_rank_pretrained
from lightning_merak.modules.config import ModelConfig, TrainerConfig
from lightning_merak.util.model_outputs import logits_of, weighted_router_aux_loss

__all__ = ["CausalLMModule", "build_causal_lm"]


def build_causal_lm(config: ModelConfig, vocab_size: int) -> nn.Module:
    """A randomly initialised ``AutoModelForCausalLM`` for ``config.model_type``.

    ``vocab_size`` comes from the data so embeddings and LM head always fit the tokens.
    """
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in CONFIG_MAPPING:
        known = ", ".join(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)[:40])
        raise ValueError(
            f"model.model_type={config.model_type!r} is not a transformers model type; "
            f"causal-LM types include: {known}, ..."
        )
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"model.model_type={config.model_type!r} has no causal-LM head in transformers; "
            "choose a decoder model type such as llama, gpt2, mistral or qwen2"
        )
    kwargs = dict(config.config)
    kwargs["vocab_size"] = vocab_size
    model_config = CONFIG_MAPPING[config.model_type](**kwargs)
    return AutoModelForCausalLM.from_config(model_config)


class CausalLMModule(pl.LightningModule):
    """Next-token prediction on blocks of token ids, with AdamW and warm-up + cosine decay.

    It implements :class:`~lightning_merak.protocols.module_contract.Merak3DModule`, merak3d's contract:
    ``model``, :meth:`split_batch`, :meth:`loss_from_logits` and :meth:`compute_loss`.

    Pass the ``model``, or a ``model_factory`` that :meth:`configure_model` calls inside the strategy's
    sharded context (on the meta device under merak3d, so no rank builds the whole model). With
    ``pretrained_path`` (a local transformers directory), merak3d fills each rank's part from it
    (:meth:`load_pretrained_weights`). For adapters the factory returns
    :func:`~lightning_merak.adapters.meta.attach_on_meta` of the model: each rank then quantises its own part.
    """

    def __init__(self, model: Optional[nn.Module], optim: TrainerConfig,
                 model_factory: Optional[Callable[[], nn.Module]] = None,
                 pretrained_path: Optional[str] = None) -> None:
        super().__init__()
        if model is None and model_factory is None:
            raise ValueError("CausalLMModule needs a model or a model_factory")
        self.model = model
        self.optim = optim
        self.model_factory = model_factory
        self._router_aux_loss: Optional[torch.Tensor] = None
        self.pretrained_path = pretrained_path

    def configure_model(self) -> None:
        """Build the model from ``model_factory`` once, in the context the strategy sets (meta under merak3d)."""
        if self.model is None and self.model_factory is not None:
            self.model = self.model_factory()

    def load_pretrained_weights(self, tensors: dict[str, torch.Tensor], layout_changes: dict[str, Any]) -> None:
        """merak3d's pretrained seam: fill this rank's ``tensors`` (by unsplit name; shards as DTensors)
        from ``pretrained_path``, undoing the split's ``layout_changes``. Without a path, the random init stays."""
        if self.pretrained_path is None:
            return
        load_rank_pretrained(self.model, tensors, self.pretrained_path, layout_changes)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the transformers config (and adapter configs) so ``merak-export`` can write a Hugging Face
        directory from the checkpoint alone."""
        record = model_record(self.model) if self.model is not None else None
        if record is not None:
            checkpoint[MODEL_RECORD_KEY] = record

    def split_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(model inputs, targets)``: both are the token ids; the loss shifts them."""
        (input_ids,) = batch
        return input_ids, input_ids

    def loss_from_logits(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of predicting token ``t+1`` from tokens ``<= t``."""
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), targets[:, 1:].reshape(-1))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits; a transformers MoE model's weighted router aux loss (``output_router_logits=True``) is kept
        for :meth:`compute_loss`."""
        output = self.model(input_ids)
        self._router_aux_loss = weighted_router_aux_loss(self.model, output)
        return logits_of(output)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """Loss of one batch: cross-entropy plus the router aux loss, as transformers' own loss with labels.
        Parallel strategies may replace it to run the model in pieces."""
        inputs, targets = self.split_batch(batch)
        loss = self.loss_from_logits(self(inputs), targets)
        return loss if self._router_aux_loss is None else loss + self._router_aux_loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._router_aux_loss = None
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        if self._router_aux_loss is not None:
            self.log("train/router_aux_loss", self._router_aux_loss.detach(), sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.compute_loss(batch), prog_bar=True, sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Logits of the batch's inputs."""
        return self(self.split_batch(batch)[0])

    def configure_optimizers(self) -> dict[str, Any]:
        decay, no_decay = [], []
        for param in self.model.parameters():
            if param.requires_grad:
                (decay if param.ndim >= 2 else no_decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.optim.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.optim.learning_rate,
        )
        warmup = max(1, self.optim.warmup_steps)
        total = max(warmup + 1, self.optim.max_steps)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / (total - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
