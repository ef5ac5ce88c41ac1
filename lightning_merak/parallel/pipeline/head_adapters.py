"""LoRA on the LM head split by vocabulary rows over the pipeline ranks (``vocab_stages``).

A LoRA head computes ``y = W x + b + s · B (A x')``, ``x'`` the adapter's dropout of ``x``, with ``A`` of shape
``[r, h]`` and ``B`` of shape ``[V, r]``. Splitting the vocabulary splits ``B`` by rows exactly as ``W``: each rank
keeps its rows of ``B`` (a DTensor sharded like the base's rows, so a checkpoint holds the unsplit factor) and
computes its logits ``W_r x + b_r + s · B_r u`` from the projection ``u = A x'``. ``A`` stays on the last stage,
whole: it computes ``u`` (``r`` columns) once per micro-batch and sends it with the hidden state, so every rank
uses the same dropout mask. In the backward each rank's share of ``∂u`` (``s · ∂logits_r B_r``) is summed onto the
last stage with the hidden state's gradient, where it gives ``A``'s gradient and the LoRA path's term of the hidden
state's. The module keeps PEFT's layout (``base_layer``, ``lora_A.<adapter>``, ``lora_B.<adapter>``), so the
checkpoint and ``merak-export`` see PEFT's names.

Plain LoRA only: a variant (DoRA), a bias adapter, several adapters, another tuner (Q-BaRA, QA-HiRA) or a quantised
base are refused before launch (:func:`head_adapter_problem`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lightning_merak.parallel.data.gather_waits import ReadsOutsideForward

__all__ = ["HeadLoRA", "LoRAHeadRows", "head_adapter_problem", "head_lora", "head_lora_layout_problem"]

HEAD_ADAPTER_FIX = "set vocab_stages='off' or leave the LM head out of the adapter's target_modules"


@dataclass(frozen=True)
class HeadLoRA:
    """The head's LoRA as every rank needs it before the last stage sends the factors: the PEFT adapter's name, its
    rank, its scaling ``s``, whether it trains and its dropout probability."""

    adapter: str
    rank: int
    scaling: float
    trainable: bool = True
    dropout: float = 0.0


def _is_tuner_layer(module: nn.Module) -> bool:
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # not imported: no model holds tuner layers
    return tuners is not None and isinstance(module, tuners.BaseTunerLayer)


def head_adapter_problem(head: Optional[nn.Module]) -> Optional[str]:
    """Why ``head`` (``get_output_embeddings()``) cannot be split by vocabulary rows, or None: an ``nn.Linear`` or
    plain LoRA on one splits."""
    if type(head) is nn.Linear:
        return None
    if head is None or not _is_tuner_layer(head):
        return (f"vocab_stages splits an nn.Linear LM head (get_output_embeddings()), the model has "
                f"{type(head).__name__}; set vocab_stages='off'")
    from peft.tuners.lora import Linear as LoRALinear  # lazy: a tuner layer means PEFT is imported

    base = head.get_base_layer()
    if type(head) is not LoRALinear:
        return (f"vocab_stages splits plain LoRA on the LM head, not {type(head).__name__}; {HEAD_ADAPTER_FIX}")
    if type(base) is not nn.Linear:
        return (f"vocab_stages splits a float nn.Linear LM head under LoRA, not a quantised {type(base).__name__}; "
                f"{HEAD_ADAPTER_FIX}")
    adapters = list(head.lora_A)
    if len(adapters) != 1:
        return f"vocab_stages splits one LoRA adapter on the LM head, it has {adapters}; {HEAD_ADAPTER_FIX}"
    adapter = adapters[0]
    if head.use_dora.get(adapter, False) or adapter in getattr(head, "lora_variant", {}):
        return f"vocab_stages splits plain LoRA on the LM head, not a LoRA variant (DoRA); {HEAD_ADAPTER_FIX}"
    if getattr(head, "lora_bias", {}).get(adapter, False):
        return f"vocab_stages splits plain LoRA on the LM head, without lora_bias; {HEAD_ADAPTER_FIX}"
    if getattr(head, "fan_in_fan_out", False):
        return f"vocab_stages splits LoRA on an nn.Linear head, not with fan_in_fan_out; {HEAD_ADAPTER_FIX}"
    return None


def head_lora(head: nn.Module) -> Optional[HeadLoRA]:
    """The LoRA of a head :func:`head_adapter_problem` accepts, or None for a plain ``nn.Linear``."""
    if type(head) is nn.Linear:
        return None
    adapter = next(iter(head.lora_A))
    factor_b = head.lora_B[adapter].weight
    dropout = head.lora_dropout[adapter]
    return HeadLoRA(adapter, head.lora_A[adapter].weight.shape[0], float(head.scaling[adapter]),
                    factor_b.requires_grad, float(getattr(dropout, "p", 0.0)))


def head_lora_layout_problem(lora: Optional[HeadLoRA], tensor_parallel: int) -> Optional[str]:
    """Why the head's LoRA cannot split in a layout of ``tensor_parallel`` ranks a stage, or None: every
    tensor-parallel rank of the last stage computes ``A``'s gradient from its own dropout mask, which differ."""
    if lora is not None and lora.dropout > 0 and tensor_parallel > 1:
        return (f"vocab_stages splits LoRA on the LM head with dropout at tensor_parallel=1 only (dropout "
                f"{lora.dropout} at tensor_parallel={tensor_parallel}); set the adapter's dropout to 0, "
                f"{HEAD_ADAPTER_FIX}")


class _Factor(nn.Module):
    """One LoRA factor under PEFT's name (``lora_A.<adapter>.weight``); never called."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class LoRAHeadRows(ReadsOutsideForward):
    """This rank's part of a LoRA head: ``base_layer`` (its rows of ``W``, ``b``: a ``VocabularySlice``),
    ``lora_B.<adapter>`` (its rows of ``B``, a DTensor sharded like the base's) and, on the last stage,
    ``lora_A.<adapter>`` (the whole ``A``) and the adapter's dropout."""

    def __init__(self, base_layer: nn.Module, lora: HeadLoRA, factor_b: nn.Parameter,
                 factor_a: Optional[nn.Parameter], dropout: Optional[nn.Module]) -> None:
        super().__init__()
        self.base_layer, self.lora = base_layer, lora
        self.lora_A = nn.ModuleDict({lora.adapter: _Factor(factor_a)} if factor_a is not None else {})
        self.lora_B = nn.ModuleDict({lora.adapter: _Factor(factor_b)})
        self.lora_dropout = nn.ModuleDict({lora.adapter: dropout} if dropout is not None else {})

    @property
    def factor_a(self) -> Optional[nn.Parameter]:
        """``A`` (held by the last stage only)."""
        factor = self.lora_A[self.lora.adapter] if self.lora.adapter in self.lora_A else None
        return factor.weight if factor is not None else None

    @property
    def factor_b(self) -> nn.Parameter:
        """This rank's rows of ``B`` (a DTensor)."""
        return self.lora_B[self.lora.adapter].weight

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(u, x', x)`` on the last stage: ``u = A x'``, ``x'`` the adapter's dropout of ``x``, ``x`` ``hidden``
        made a leaf the dropout's backward starts from (:meth:`project_backward`)."""
        leaf = hidden.detach().requires_grad_(self.training and self.lora.adapter in self.lora_dropout)
        with torch.enable_grad():
            dropped = self.lora_dropout[self.lora.adapter](leaf) if leaf.requires_grad else leaf
        assert self.factor_a is not None, "the last stage holds lora_A"
        return torch.nn.functional.linear(dropped.detach(), self.factor_a), dropped, leaf

    def project_backward(self, grad_u: torch.Tensor, dropped: torch.Tensor, leaf: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(∂A, ∂x)`` of ``u = A x'`` given ``∂u`` (summed over the ranks)."""
        assert self.factor_a is not None, "the last stage holds lora_A"
        grad_a = grad_u.reshape(-1, grad_u.shape[-1]).t() @ dropped.detach().reshape(-1, dropped.shape[-1])
        grad_dropped = grad_u @ self.factor_a
        if dropped is leaf:
            return grad_a, grad_dropped
        (grad_x,) = torch.autograd.grad(dropped, leaf, grad_dropped)
        return grad_a, grad_x

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the pipeline scores the split LM head through its VocabularyExchange, not by calling it")
