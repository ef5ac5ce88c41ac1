"""Causal language models built from transformers config classes, and their LightningModule.

Models are built with random weights from a config (nothing is downloaded), so the
same code runs offline, in CI and on a cluster. :class:`CausalLMModule` implements
:class:`~lightning_merak.protocols.module_contract.Merak3DModule`, the small contract merak3d relies on
(``model``, ``split_batch``, ``loss_from_logits``, ``compute_loss``: what a strategy that runs the model in
pieces feeds, scores and replaces). Without any strategy the module trains on one device like any other
LightningModule.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
import sys
from collections.abc import Mapping
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_merak.checkpoint.names import MODEL_RECORD_KEY, model_record
from lightning_merak.hf.pretrained import (
    causal_only_as_decoder,
    load_rank_pretrained,
    refuse_bidirectional_override,
    validated_config,
)
from lightning_merak.modules.config import ModelConfig, OptimConfig, Schedule
from lightning_merak.modules.muon import MuonWithAdamW, not_linear_maps
from lightning_merak.modules.schedules import warmup_schedule
from lightning_merak.plugins.moe.aux_gradient import scale_aux_gradients_by_loss
from lightning_merak.util.model_outputs import logits_of, weighted_router_aux_loss

__all__ = ["CausalLMModule", "build_causal_lm", "build_optimizer", "scores_next_token"]


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
    if causal_only_as_decoder(config.model_type):
        refuse_bidirectional_override(config.model_type, kwargs)
        kwargs["is_decoder"] = True
    family_defaults = CONFIG_MAPPING[config.model_type]()
    for key in ("bos_token_id", "eos_token_id"):  # GPT-2's 50256 in a 256-token vocabulary names no token
        default = getattr(family_defaults, key, None)
        if key not in kwargs and isinstance(default, int) and not 0 <= default < vocab_size:
            kwargs[key] = None
    model_config = validated_config(lambda: CONFIG_MAPPING[config.model_type](**kwargs),
                                    f"model.config for model.model_type={config.model_type!r}")
    check_undeclared_config_fields(config.model_type, family_defaults, model_config, config.config)
    padding = getattr(model_config, "pad_token_id", None)
    if isinstance(padding, int) and not 0 <= padding < vocab_size:  # the embedding's padding row
        if "pad_token_id" in config.config:
            raise ValueError(f"model.config sets pad_token_id={padding}, outside the data's vocabulary of {vocab_size} "
                             f"tokens; set model.config.pad_token_id=null (or an id below {vocab_size})")
        # the family's default names a token this vocabulary does not have: no row to keep from training
        rank_zero_info(f"{config.model_type}'s default pad_token_id={padding} lies outside the data's vocabulary of "
                       f"{vocab_size} tokens: the model is built without a padding row (model.config.pad_token_id "
                       "sets one)")
        model_config.pad_token_id = None
    requested = getattr(model_config, "dtype", None)
    if requested not in (None, torch.float32, "float32"):  # transformers would build the parameters in it
        rank_zero_info(f"model.config names dtype {requested}: the model is built in float32, as from_pretrained "
                       "loads it, and trainer.precision sets how it trains (bf16-true: bfloat16 parameters; "
                       "bf16-mixed: float32 parameters under bfloat16 autocast)")
    return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)


def check_undeclared_config_fields(model_type: str, family_defaults: Any, built: Any,
                                   fields: Mapping[str, Any]) -> None:
    """Refuse a ``model.config`` field that ``model_type``'s config does not declare but resembles one it does (a
    misspelt ``num_hiden_layers``: transformers keeps an unknown keyword as an attribute, and the model would train
    at the family's default depth without a word), naming the field meant; warn about other undeclared fields the
    config kept (the model reads one only where its code looks it up, as some families do ``head_dim``)."""
    from transformers import PretrainedConfig  # lazy: transformers

    declared = set(family_defaults.to_dict()) | set(getattr(family_defaults, "attribute_map", {}))
    for config_class in (type(family_defaults), PretrainedConfig):
        declared |= set(inspect.signature(config_class.__init__).parameters)
    kept = sorted(name for name in set(fields) - declared if name in vars(built))  # not taken in by the config
    misspelt = {name: close[0] for name in kept
                if (close := difflib.get_close_matches(name, sorted(declared), n=1, cutoff=0.85))}
    if misspelt:
        raise ValueError("; ".join(f"model.config.{name} is not a field of {type(family_defaults).__name__} "
                                   f"(model.model_type={model_type}): did you mean model.config.{meant}?"
                                   for name, meant in misspelt.items()))
    if kept:
        rank_zero_warn(f"model.config.{', model.config.'.join(kept)}: not declared by "
                       f"{type(family_defaults).__name__}; kept on the config, read only where the model's code looks "
                       "it up")


_BATCH_FORMS = ("a tensor of token ids [samples, tokens], a tuple (input_ids,) or (input_ids, labels), or a dict "
                "with input_ids (and labels)")


def _token_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`CausalLMModule.split_batch`: ``(input_ids, labels or input_ids)``, refused naming the forms read."""
    if isinstance(batch, torch.Tensor):
        parts: tuple[Any, ...] = (batch,)
    elif isinstance(batch, Mapping):
        unread = sorted(set(batch) - {"input_ids", "labels", "attention_mask"})
        mask = batch.get("attention_mask")
        if "input_ids" not in batch or unread:
            raise ValueError(f"CausalLMModule reads {_BATCH_FORMS}; the batch's dict has keys {sorted(batch)}")
        if isinstance(mask, torch.Tensor) and not bool(mask.all()):
            raise ValueError("CausalLMModule trains on whole blocks of tokens: an attention_mask with padding would "
                             "be ignored; pack the documents into full blocks (the project's data modules do), or "
                             "drop the padded positions from the loss with labels=-100 and an all-ones mask")
        parts = (batch["input_ids"],) + ((batch["labels"],) if batch.get("labels") is not None else ())
    elif hasattr(batch, "__iter__") and hasattr(batch, "__len__") and len(batch) in (1, 2):
        parts = tuple(batch)  # a tuple, a list, or what iterates as one (micro-batching's VariableBatch: its probe)
    else:
        raise ValueError(f"CausalLMModule reads {_BATCH_FORMS}; got a {type(batch).__name__}"
                         + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    input_ids = parts[0]
    labels = parts[1] if len(parts) == 2 else input_ids
    for name, tensor in (("input_ids", input_ids), ("labels", labels)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype.is_floating_point or tensor.ndim != 2:
            what = (f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor)
                    else f"a {type(tensor).__name__}")
            raise ValueError(f"CausalLMModule's {name} must be integer token ids of shape [samples, tokens], got "
                             f"{what}; it reads {_BATCH_FORMS}")
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match input_ids of shape "
                         f"{tuple(input_ids.shape)}: the loss shifts the labels by one token itself")
    return input_ids, labels


def _keep_bnb_training_layout(module: nn.Module) -> None:
    """Before an evaluation loop: bitsandbytes 4-bit bases stay on the path training takes, so the training after
    it still back-propagates through them (:func:`~lightning_merak.adapters.bnb_layout.keep_bnb_training_layout`)."""
    if "bitsandbytes" in sys.modules:  # a model with bitsandbytes layers has imported it
        from lightning_merak.adapters.bnb_layout import keep_bnb_training_layout  # lazy: PEFT (the package's)

        keep_bnb_training_layout(module)


class CausalLMModule(pl.LightningModule):
    """Next-token prediction on blocks of token ids, with the optimizer and schedule of ``optim``
    (:class:`~lightning_merak.modules.config.OptimConfig`; default AdamW, warm-up then cosine decay).

    It implements :class:`~lightning_merak.protocols.module_contract.Merak3DModule`, merak3d's contract:
    ``model``, :meth:`split_batch`, :meth:`loss_from_logits` and :meth:`compute_loss`.

    Pass the ``model``, or a ``model_factory`` that :meth:`configure_model` calls inside the strategy's
    sharded context (on the meta device under merak3d, so no rank builds the whole model). With
    ``pretrained_path`` (a local transformers directory), merak3d fills each rank's part from it
    (:meth:`load_pretrained_weights`). For adapters the factory returns
    :func:`~lightning_merak.adapters.meta.attach_on_meta` of the model: each rank then quantises its own part.

    The schedule's length is the Trainer's (``estimated_stepping_batches``): ``max_steps`` goes to the Trainer alone.
    """

    def __init__(self, model: Optional[nn.Module], optim: Optional[OptimConfig] = None,
                 model_factory: Optional[Callable[[], nn.Module]] = None,
                 pretrained_path: Optional[str] = None) -> None:
        super().__init__()
        if model is None and model_factory is None:
            raise ValueError("CausalLMModule needs a model or a model_factory")
        self.model = model
        self.optim = optim if optim is not None else OptimConfig()
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

    def on_validation_model_eval(self) -> None:
        super().on_validation_model_eval()
        _keep_bnb_training_layout(self)

    def on_test_model_eval(self) -> None:
        super().on_test_model_eval()
        _keep_bnb_training_layout(self)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the transformers config (and adapter configs) so ``merak-export`` can write a Hugging Face
        directory from the checkpoint alone."""
        record = model_record(self.model) if self.model is not None else None
        if record is not None:
            checkpoint[MODEL_RECORD_KEY] = record

    def split_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(model inputs, targets)`` of a batch of token ids ``[samples, tokens]``: a tensor, a tuple
        ``(input_ids,)`` or ``(input_ids, labels)``, or a dict with ``input_ids`` (``labels``, an all-ones
        ``attention_mask``), as transformers' collators give them. Without labels the targets are the token ids;
        the loss shifts them and ignores ``-100``."""
        return _token_batch(batch)

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
        if getattr(self.model.forward, "scores_shards", False):  # context parallel: no rank holds every logit
            output = self.model(input_ids=inputs, labels=targets)  # the same mean cross-entropy, per shard
            self._router_aux_loss = weighted_router_aux_loss(self.model, output)  # already in its loss
            return output.loss
        loss = self.loss_from_logits(self(inputs), targets)
        return loss if self._router_aux_loss is None else loss + self._router_aux_loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._router_aux_loss = None
        loss = self.compute_loss(batch)
        scale_aux_gradients_by_loss(loss)  # swapped DeepSpeed-MoE blocks: their aux gradient scaled as this loss is
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
        """``optim``'s optimizer (no weight decay on biases and norms) and its schedule, stepped every optimizer
        step and ending at the Trainer's last (``estimated_stepping_batches``)."""
        decay, no_decay = [], []
        for param in self.model.parameters():
            if param.requires_grad:
                (decay if param.ndim >= 2 else no_decay).append(param)
        optimizer = build_optimizer(self.optim, decay, no_decay,
                                    _embedding_parameters(self.model) | not_linear_maps(self.model))
        if self.optim.total_steps is not None:
            total: float = self.optim.total_steps
        elif self._trainer is not None:
            total = self.trainer.estimated_stepping_batches
        else:
            raise ValueError(f"{type(self).__name__}.configure_optimizers() outside a Trainer has no run length for "
                             "its schedule: give OptimConfig(total_steps=...)")
        if self.optim.lr_schedule is not Schedule.constant and not math.isfinite(total):
            raise ValueError(f"optim.lr_schedule={self.optim.lr_schedule.value} decays until the run's last step, "
                             "but the Trainer has no end: give it max_steps or max_epochs, or use "
                             "optim.lr_schedule=constant")
        if not (self._trainer is not None and getattr(self.trainer.strategy, "plan_only", False)):  # no step runs
            _warn_unfinished_warmup(self.optim.warmup_steps, total, self.optim.learning_rate)
        scheduler = warmup_schedule(
            optimizer, self.optim.lr_schedule, self.optim.warmup_steps,
            None if self.optim.lr_schedule is Schedule.constant else max(int(total), 1), self.optim.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def scores_next_token(module: Any) -> bool:
    """Whether ``module`` scores its logits with :meth:`CausalLMModule.loss_from_logits` itself, not a loss of its
    own: what the parallel layouts that compute that cross-entropy themselves (on shards, rows or packed samples)
    can stand in for."""
    return getattr(type(module), "loss_from_logits", None) is CausalLMModule.loss_from_logits


def _warn_unfinished_warmup(warmup_steps: int, total_steps: float, learning_rate: float) -> None:
    """Say once (rank 0) when the run ends inside its warm-up: legitimate in a short smoke run, a surprise otherwise,
    since the learning rate never reaches ``optim.learning_rate``."""
    if math.isfinite(total_steps) and warmup_steps > total_steps:
        steps = int(total_steps)
        rank_zero_warn(f"optim.warmup_steps={warmup_steps} is longer than the run's {steps} optimizer steps: the "
                       f"learning rate never reaches optim.learning_rate={learning_rate} (at most "
                       f"{max(steps - 1, 0) / warmup_steps:.0%} of it); lower optim.warmup_steps or train longer "
                       "(trainer.max_steps)")


def _embedding_parameters(model: nn.Module) -> set[int]:
    """Ids of the parameters Muon leaves to AdamW besides norms and biases, as the Muon recipe prescribes: every
    embedding table (token, position, type), the output head and a classification head (transformers' names for
    them), and a table a module holds as a bare parameter under an embedding's or position's name (``pos_embed``,
    ``position_table``: a learned ``(1, positions, hidden)`` table is no stack of matrices); inside a model split
    into pipeline stages, those of the stages' models."""
    found: set[int] = {id(param) for name, param in model.named_parameters()
                       if _TABLE_NAME.search(name.rpartition(".")[2])}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            found.add(id(module.weight))
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            getter_of = getattr(module, getter, None)
            try:
                layer = getter_of() if callable(getter_of) else None
            except NotImplementedError:  # a transformers module that names no embedding
                continue
            if isinstance(layer, nn.Module):
                found.update(id(param) for param in layer.parameters())
        if callable(getattr(module, "get_input_embeddings", None)):  # a transformers model: its task head
            for head_name in _TASK_HEADS:
                head = getattr(module, head_name, None)
                if isinstance(head, nn.Module):
                    found.update(id(param) for param in head.parameters())
    return found


_TABLE_NAME = re.compile(r"embed|(^|_)(pos|position|positions|positional)(_|$)|^w[pt]e$")
"""The name of a bare parameter that is a table of vectors looked up by index, not a matrix applied to inputs."""

_TASK_HEADS = ("score", "classifier", "qa_outputs")
"""transformers' attribute names of a model's task head (sequence and token classification, question answering)."""


def build_optimizer(optim: OptimConfig, decay: list[nn.Parameter], no_decay: list[nn.Parameter],
                    adamw_only: set[int]) -> torch.optim.Optimizer:
    """The optimizer ``optim`` names over two named parameter groups: matrices (decayed) and the rest; with Muon,
    ``adamw_only`` (ids: embeddings, head, tensors that are no matrices) are stepped by its AdamW part."""
    groups = [{"params": decay, "weight_decay": optim.weight_decay, "name": "matrices"},
              {"params": no_decay, "weight_decay": 0.0, "name": "biases_and_norms"}]
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=optim.learning_rate, momentum=optim.momentum)
    if optim.name == "muon":
        return MuonWithAdamW(groups, lr=optim.learning_rate, momentum=optim.momentum, adamw_only=adamw_only,
                             newton_schulz_dtype=optim.newton_schulz_dtype)
    return torch.optim.AdamW(groups, lr=optim.learning_rate)
