"""A transformers MoE model's router aux loss across pipeline stages.

With ``config.output_router_logits=True`` the family's ``*ForCausalLM`` forward computes its load-balancing
loss from every layer's router logits, recorded by hooks its ``_can_record_outputs["router_logits"]`` names
(an ``OutputRecorder``: the router class and which of its outputs holds the logits), and adds
``router_aux_loss_coef × aux`` to the loss with labels. Pipeline stages never run that forward to its end,
so here:

* each stage records its own routers' logits during its forward (forward hooks on the routers, per thread,
  as sub-batches run a stage's forward in threads of their own);
* a stage carries them on as one more output, the router logits of every layer so far in layer order,
  ``[batch, routers so far, sequence, experts]`` (batch-first, so sub-batches split and join it like any
  activation); the next stage takes it as its last input and appends its own, so autograd sends the aux
  loss's gradient back to earlier stages' routers through the pipeline's own backward sends;
* the last stage outputs ``(logits, router logits)`` and :class:`RouterAuxLoss` adds the family's own
  ``load_balancing_loss_func`` over them, weighted by ``router_aux_loss_coef``, to each micro-batch's loss.

Each micro-batch's aux loss is over its own tokens, as gradient accumulation over the micro-batches of the
unsplit model computes it (the loss balances experts per forward, so it is not the same as one aux loss over
the whole batch).

:func:`router_aux_of` and :func:`router_aux_loss_problem` decide, before any work, whether a model and a
layout can train the aux loss this way; the rest is plain tensor code.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from lightning_merak.util.model_outputs import router_aux_coefficient

__all__ = ["RouterAux", "RouterAuxLoss", "RouterRecorder", "adds_no_router_aux_loss", "carried_router_logits",
           "router_aux_loss_problem", "router_aux_of", "routers_per_block"]


def router_aux_loss_problem(output_router_logits: Any, pipeline_parallel: Any, *, micro_batching: str = "none",
                            sequence_parallel: bool = False, tensor_parallel: Any = 1,
                            tp_overlap: Any = 1, context_parallel: Any = 1) -> Optional[str]:
    """Why a layout cannot train a transformers MoE model's router aux loss, or ``None``.

    The aux loss balances experts over a forward's tokens, so every router must see all of them: sequence
    parallelism gives a tensor-parallel rank's routers only its share of the sequence (at any pipeline degree),
    and ``tp_overlap`` runs the unsplit model (``pipeline_parallel=1``) once per sub-batch, each call with the aux
    loss of its own rows (with stages the carried logits join whole, and with ``context_parallel>1`` the recorded
    logits of every sub-batch are gathered into one aux loss; across stages each context-parallel rank would carry
    only its shard's logits, so that is refused). Model-independent (checked before launch);
    :func:`router_aux_of` checks the model itself.
    """
    if not output_router_logits:
        return None
    split_tp = isinstance(tensor_parallel, int) and tensor_parallel > 1
    if sequence_parallel and split_tp:
        return ("model.config.output_router_logits=True with sequence_parallel=True: each tensor-parallel rank's "
                "routers see only its share of the sequence, and the aux loss is over all of a forward's tokens; set "
                "sequence_parallel=False or output_router_logits=False")
    if not isinstance(pipeline_parallel, int):
        return None
    if pipeline_parallel == 1:
        if split_tp and isinstance(tp_overlap, int) and tp_overlap > 1 and context_parallel == 1:
            return (f"model.config.output_router_logits=True with tp_overlap={tp_overlap} and pipeline_parallel=1: "
                    "the model runs once per sub-batch, each computing the aux loss over its own rows instead of "
                    "the batch's; set tp_overlap=1 (or output_router_logits=False)")
        return None
    if micro_batching != "none":
        return (f"model.config.output_router_logits=True with micro_batching={micro_batching!r}: each micro-batch's "
                "loss is a token-weighted share of the global batch's, where the router aux loss has no defined "
                "weight; use micro_batching='none' or output_router_logits=False")
    if isinstance(context_parallel, int) and context_parallel > 1:
        return ("a router aux loss across pipeline stages is computed from the router logits the stages carry, each "
                "context-parallel rank's for its shard of the sequence only, not the whole batch's; set the model's "
                "output_router_logits=False, or context_parallel=1 or pipeline_parallel=1")
    return None


def _recorder_of(model: nn.Module) -> tuple[type[nn.Module], int]:
    """The router class and output index of ``model``'s ``_can_record_outputs["router_logits"]``."""
    recordable = getattr(model, "_can_record_outputs", None)
    spec = recordable.get("router_logits") if isinstance(recordable, dict) else None
    if isinstance(spec, list) and len(spec) == 1:
        spec = spec[0]
    if isinstance(spec, type) and issubclass(spec, nn.Module):
        return spec, 1  # transformers' default index for a bare class
    target = getattr(spec, "target_class", None)
    if (isinstance(target, type) and issubclass(target, nn.Module) and getattr(spec, "layer_name", None) is None
            and getattr(spec, "class_name", None) is None and isinstance(getattr(spec, "index", None), int)):
        return target, spec.index
    raise ValueError(
        f"model.config.output_router_logits=True under pipeline stages: {type(model).__name__} names no router "
        "class in _can_record_outputs['router_logits'] (a transformers 5 OutputRecorder with a target class), so "
        "the stages cannot record its router logits; set output_router_logits=False or pipeline_parallel=1")


@dataclass(frozen=True)
class RouterAux:
    """How a model computes its weighted router aux loss: what the stages record and the family's loss."""

    router_class: type[nn.Module]
    output_index: int
    loss_function: Callable[..., torch.Tensor]
    num_experts: int
    top_k: int
    coefficient: float

    def weighted_loss(self, router_logits: torch.Tensor) -> torch.Tensor:
        """``coefficient × loss_function(per-layer logits, num_experts, top_k)`` of carried ``router_logits``
        ``[batch, layers, sequence, experts]``: each layer's rows in the router's own token order, as the
        model's forward passes them."""
        layers = tuple(router_logits[:, layer].reshape(-1, router_logits.shape[-1])
                       for layer in range(router_logits.shape[1]))
        return self.coefficient * self.loss_function(layers, self.num_experts, self.top_k)


def routers_per_block(trunk: nn.ModuleList, router_class: type[nn.Module]) -> list[int]:
    """How many routers each block of ``trunk`` holds (dense blocks none)."""
    return [sum(isinstance(module, router_class) for module in block.modules()) for block in trunk]


def _load_balancing_loss_func(model: nn.Module) -> Any:
    """The ``load_balancing_loss_func`` of the module defining ``model``'s class (transformers' ``modeling_*``), or
    None: every transformers MoE family that adds a router aux loss to its loss computes it with its own copy."""
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def adds_no_router_aux_loss(model: nn.Module) -> bool:
    """Whether ``model`` is of a transformers family whose forward adds no router aux loss to its loss (HunYuan-MoE,
    Cohere2-MoE, DeepSeek-V3, ...: no ``load_balancing_loss_func``). ``output_router_logits=True`` then only returns
    the router logits, which training does not read: it trains as without the flag. False for a model of another
    library, whose loss this cannot tell."""
    return type(model).__module__.startswith("transformers.models.") and not callable(_load_balancing_loss_func(model))


def router_aux_of(model: nn.Module, trunk: nn.ModuleList) -> Optional[RouterAux]:
    """The weighted router aux loss ``model``'s forward computes, found from the model's own class; None where it
    computes none (:func:`adds_no_router_aux_loss`); refused with the reason where something it needs is missing."""
    if adds_no_router_aux_loss(model):
        return None
    router_class, index = _recorder_of(model)
    name = type(model).__name__
    loss_function = _load_balancing_loss_func(model)
    fix = "set output_router_logits=False or pipeline_parallel=1"
    if not callable(loss_function):
        raise ValueError(f"model.config.output_router_logits=True under pipeline stages: {name}'s module "
                         f"({type(model).__module__}) has no load_balancing_loss_func, the aux loss its forward "
                         f"would compute; {fix}")
    num_experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if not isinstance(num_experts, int) or not isinstance(top_k, int):
        raise ValueError(f"model.config.output_router_logits=True under pipeline stages: {name} has no integer "
                         f"num_experts / num_experts_per_tok to pass load_balancing_loss_func; {fix}")
    coefficient = router_aux_coefficient(model)
    if not isinstance(coefficient, (int, float)):
        raise ValueError(f"model.config.output_router_logits=True under pipeline stages: {name} has no "
                         f"router_aux_loss_coef to weight its aux loss; {fix}")
    in_trunk = sum(routers_per_block(trunk, router_class))
    in_model = sum(isinstance(module, router_class) for module in model.modules())
    if in_trunk == 0 or in_trunk != in_model:
        raise ValueError(f"model.config.output_router_logits=True under pipeline stages: {name} holds "
                         f"{in_model} {router_class.__name__} routers, {in_trunk} of them in its blocks; the stages "
                         f"record routers inside blocks only; {fix}")
    return RouterAux(router_class, index, loss_function, num_experts, top_k, float(coefficient))


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient. The carried logits' gradient is a slice of the
    concatenation's (not contiguous); the pipeline receives it into a buffer of the layout it had when the shapes
    were inferred, and point-to-point receives need contiguous buffers."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def carried_router_logits(carried: Optional[torch.Tensor], recorded: list[torch.Tensor], batch: int,
                          sequence: int) -> Optional[torch.Tensor]:
    """``carried`` ``[batch, layers, sequence, experts]`` (or ``None``) with this stage's ``recorded`` router
    outputs appended in call order, each viewed as ``[batch, 1, sequence, experts]``."""
    pieces = [] if carried is None else [_ContiguousGradient.apply(carried)]
    for logits in recorded:
        if logits.ndim < 2 or logits.numel() != batch * sequence * logits.shape[-1]:
            raise ValueError(f"router logits of shape {tuple(logits.shape)} do not hold one row per token of a "
                             f"[{batch}, {sequence}] micro-batch; the pipeline carries one row per token and layer")
        pieces.append(logits.reshape(batch, 1, sequence, logits.shape[-1]))
    # a new tensor even from one piece: pipeline schedules detach stage outputs in place, which views refuse
    return torch.cat(pieces, dim=1) if pieces else None


class RouterRecorder:
    """Forward hooks on one stage's routers keeping their logits while :meth:`recording` is open in a thread.

    A router called anywhere else (a recomputation during backward, another thread) is not recorded.
    """

    def __init__(self, routers: list[nn.Module], output_index: int) -> None:
        self.count = len(routers)
        self._index = output_index
        self._active: dict[int, list[torch.Tensor]] = {}
        for router in routers:
            router.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: tuple, output: Any) -> None:
        recorded = self._active.get(threading.get_ident())
        if recorded is not None:
            recorded.append(output[self._index] if isinstance(output, (tuple, list)) else output)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """The list this thread's router calls append to meanwhile; checked to hold one entry per router."""
        thread = threading.get_ident()
        self._active[thread] = recorded = []
        try:
            yield recorded
        finally:
            del self._active[thread]
        if len(recorded) != self.count:
            raise RuntimeError(f"{len(recorded)} router calls recorded in a stage holding {self.count} routers; the "
                               "router aux loss needs every router called once per forward")


class RouterAuxLoss:
    """The pipeline's loss on the last stage's ``(logits, router logits)``: ``loss_fn(logits, targets)`` plus the
    weighted aux loss; :attr:`values` keeps each micro-batch's weighted aux loss (detached) for logging."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], aux: RouterAux) -> None:
        self.loss_fn = loss_fn
        self.aux = aux
        self.values: list[torch.Tensor] = []

    def __call__(self, output: tuple[Any, torch.Tensor], targets: Any, **kwargs: Any) -> torch.Tensor:
        logits, router_logits = output
        weighted = self.aux.weighted_loss(router_logits)
        self.values.append(weighted.detach().float())
        return self.loss_fn(logits, targets, **kwargs) + weighted
