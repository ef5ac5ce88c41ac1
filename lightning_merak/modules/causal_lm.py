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
from collections.abc import Iterator, MutableMapping
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_merak.checkpoint.names import MODEL_RECORD_KEY, model_record
from lightning_merak.hf.pretrained import load_rank_pretrained
from lightning_merak.modules.config import ModelConfig, OptimConfig, Schedule
from lightning_merak.modules.schedules import warmup_schedule
from lightning_merak.parallel.data.owners import OwnedMatrices
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
        if getattr(self.model.forward, "scores_shards", False):  # context parallel: no rank holds every logit
            return self.model(input_ids=inputs, labels=targets).loss  # the same mean cross-entropy, per shard
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
        """``optim``'s optimizer (no weight decay on biases and norms) and its schedule, stepped every optimizer
        step and ending at the Trainer's last (``estimated_stepping_batches``)."""
        decay, no_decay = [], []
        for param in self.model.parameters():
            if param.requires_grad:
                (decay if param.ndim >= 2 else no_decay).append(param)
        optimizer = _optimizer(self.optim, decay, no_decay, _embedding_parameters(self.model))
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
        scheduler = warmup_schedule(
            optimizer, self.optim.lr_schedule, self.optim.warmup_steps,
            None if self.optim.lr_schedule is Schedule.constant else max(int(total), 1), self.optim.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _embedding_parameters(model: nn.Module) -> set[int]:
    """Ids of the input embedding's and output head's parameters (transformers models name them), which Muon
    leaves to AdamW."""
    found: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        layer = getattr(model, getter, lambda: None)()
        if isinstance(layer, nn.Module):
            found.update(id(param) for param in layer.parameters())
    return found


def _optimizer(optim: OptimConfig, decay: list[nn.Parameter], no_decay: list[nn.Parameter],
               embeddings: set[int]) -> torch.optim.Optimizer:
    """The optimizer ``optim`` names over two named parameter groups: matrices (decayed) and the rest."""
    groups = [{"params": decay, "weight_decay": optim.weight_decay, "name": "matrices"},
              {"params": no_decay, "weight_decay": 0.0, "name": "biases_and_norms"}]
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=optim.learning_rate, momentum=optim.momentum)
    if optim.name == "muon":
        return MuonWithAdamW(groups, lr=optim.learning_rate, momentum=optim.momentum, adamw_only=embeddings)
    return torch.optim.AdamW(groups, lr=optim.learning_rate)


class _PartsState(MutableMapping):
    """Per-parameter optimizer state kept by the part that steps the parameter, read and written as one mapping."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self._parts = parts
        self._by_param = {id(param): part for part in parts for group in part.param_groups
                          for param in group["params"]}

    def _part(self, param: Any) -> torch.optim.Optimizer:
        part = self._by_param.get(id(param))
        if part is None:
            raise KeyError(param)
        return part

    def __getitem__(self, param: Any) -> dict[str, Any]:
        return self._part(param).state[param]

    def __setitem__(self, param: Any, value: dict[str, Any]) -> None:
        self._part(param).state[param] = value

    def __delitem__(self, param: Any) -> None:
        del self._part(param).state[param]

    def __contains__(self, param: object) -> bool:
        return any(param in part.state for part in self._parts)

    def __iter__(self) -> Iterator[Any]:
        return (param for part in self._parts for param in part.state)

    def __len__(self) -> int:
        return sum(len(part.state) for part in self._parts)


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the 2-D hidden matrices of ``groups``, AdamW on every other parameter (the
    embeddings and head, whose ids ``adamw_only`` holds, as the Muon recipe prescribes), as one optimizer.

    Why one: Lightning's automatic optimization steps one optimizer per module, and Muon orthogonalises 2-D
    updates only (norms, biases and fused 3-D expert tensors need another rule). Muon scales its step to match
    AdamW's update size (``adjust_lr_fn="match_rms_adamw"``), so both share the learning rate and weight decay.
    Its groups are the two optimizers' own (named ``muon/<group>`` and ``adamw/<group>``), so a learning-rate
    schedule moves both.

    Under replicated data parallelism, :meth:`spread_over` gives each matrix one owner rank
    (:class:`~lightning_merak.parallel.data.owners.OwnedMatrices`): the owner alone keeps its momentum and
    orthogonalises it, and broadcasts the new value, so the Newton–Schulz work and the momentum divide over the
    replicas instead of repeating on each; the result is the same. merak3d does this by itself at
    ``data_parallel_sharding="none"``; ``state_dict`` still holds every matrix's momentum.
    """

    def __init__(self, groups: list[dict[str, Any]], lr: float, momentum: float,
                 adamw_only: frozenset[int] | set[int] = frozenset()) -> None:
        muon_groups, adamw_groups = [], []
        for group in groups:
            params = list(group["params"])
            hidden = [param for param in params if param.ndim == 2 and id(param) not in adamw_only]
            hidden_ids = {id(param) for param in hidden}
            name = group.get("name", "params")
            muon_groups.append({**group, "params": hidden, "name": f"muon/{name}"})
            adamw_groups.append({**group, "params": [param for param in params if id(param) not in hidden_ids],
                                 "name": f"adamw/{name}"})
        self.parts = [torch.optim.Muon([group for group in muon_groups if group["params"]], lr=lr, momentum=momentum,
                                       adjust_lr_fn="match_rms_adamw"),
                      torch.optim.AdamW([group for group in adamw_groups if group["params"]], lr=lr)]
        super().__init__([param for group in groups for param in group["params"]], {"lr": lr})
        self.param_groups = [group for part in self.parts for group in part.param_groups]
        self.state = _PartsState(self.parts)  # what checkpointers read and write per parameter: the parts' own
        self.owners: Optional[OwnedMatrices] = None

    @property
    def matrices(self) -> list[nn.Parameter]:
        """The parameters Muon steps."""
        return [param for group in self.parts[0].param_groups for param in group["params"]]

    def spread_over(self, group: Any, replicated: Optional[set[int]] = None) -> None:
        """Step each Muon matrix on one rank of ``group`` and broadcast it; ``replicated``: ids of the matrices
        every rank of ``group`` holds with equal values and gradients (default: all; others, such as
        expert-parallel weights, step on their own rank). A collective-free call every rank of ``group`` makes."""
        matrices = [param for param in self.matrices if replicated is None or id(param) in replicated]
        self.owners = OwnedMatrices(matrices, group)
        self.owners.drop_state(self.parts[0].state)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon, *others = self.parts
        if self.owners is None:
            muon.step()
        else:  # only owned matrices have a gradient while Muon steps; then the owners send the new values
            others_grads = {param: param.grad for param in self.owners.params if not self.owners.owns(param)}
            for param in others_grads:
                param.grad = None
            try:
                muon.step()
            finally:
                for param, grad in others_grads.items():
                    param.grad = grad
            self.owners.broadcast_values()
        for part in others:
            part.step()
        return loss

    def _split(self, flat: dict[str, Any]) -> list[dict[str, Any]]:
        """torch's state dict over all the parts' groups, cut into one per part (indices made the part's own)."""
        parts, first_group, first_index = [], 0, 0
        for part in self.parts:
            groups = flat["param_groups"][first_group:first_group + len(part.param_groups)]
            count = sum(len(group["params"]) for group in part.param_groups)
            state = {index - first_index: value for index, value in flat["state"].items()
                     if first_index <= index < first_index + count}
            parts.append({"state": state, "param_groups": [
                {**group, "params": [index - first_index for index in group["params"]]} for group in groups]})
            first_group, first_index = first_group + len(part.param_groups), first_index + count
        return parts

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Every part's state; spread over replicas, every matrix's momentum gathered from its owner (a collective
        then: every rank of the group calls it)."""
        received = [] if self.owners is None else self.owners.gather_state(self.parts[0].state, "momentum_buffer")
        try:
            return {"parts": [part.state_dict() for part in self.parts]}
        finally:
            if self.owners is not None:
                self.owners.drop_state(self.parts[0].state, received)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this optimizer's own format, or torch's over :attr:`param_groups` (the parts' groups in order, as a
        checkpointer writing ``state[param]`` per parameter builds it)."""
        parts = state_dict["parts"] if "parts" in state_dict else self._split(state_dict)
        for part, state in zip(self.parts, parts):
            part.load_state_dict(state)
        if self.owners is not None:
            self.owners.drop_state(self.parts[0].state)
