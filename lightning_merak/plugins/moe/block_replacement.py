"""Swap the sparse-MoE blocks of a transformers-v5 Mixtral model for our ``MoE``.

The model is not edited: each ``MixtralSparseMoeBlock`` (a router with ``weight [E, H]`` and
fused experts ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``) is replaced by a
:class:`SwappedSparseBlock` computing the same function (Mixtral's renormalised top-2
equals DeepSpeed's top-2 gate without second-expert sampling; its top-1 weight, renormalised
to 1, is what the layer's ``top1_weight_one`` gives; with ``drop_tokens`` False nothing is
dropped). Other families' ``*SparseMoeBlock`` route otherwise (shared experts, ``norm_topk_prob``)
and are refused: ``moe.experts=merak_ep`` keeps their own routers. The swap runs before processes
exist, so each block keeps the original expert weights until it knows its EP rank, then keeps only its own.
The experts are built in the block's dtype and on its device; the gate computes in float32 (DeepSpeed's), where
Mixtral's router computes in the model's dtype. Routes of exactly tied probabilities go to the lowest expert index
(DeepSpeed's argmax), where ``torch.topk`` in Mixtral's router may pick others.

The model's loss stays the language-model loss; the router's load-balancing gradient, ``aux_loss_coef × l_aux``'s,
is given in backward, scaled as the training loss is (:mod:`.aux_gradient`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from lightning_merak.plugins.moe.aux_gradient import AuxLossGradient, scale_aux_gradients_by_loss
from lightning_merak.plugins.moe.core.placement_cost_model import CostModel
from lightning_merak.plugins.moe.executor import TransferScheduler
from lightning_merak.plugins.moe.layer import MoE, MoEOptions
from lightning_merak.plugins.moe.options import (
    check_count,
    check_flag,
    check_layer_arguments,
    check_number,
    option_key,
)

__all__ = ["SwappedSparseBlock", "SwiGLUExpert", "swap_sparse_moe_blocks"]


class SwiGLUExpert(nn.Module):
    """One Mixtral expert: ``down(act(gate(x)) * up(x))`` with a fused gate/up projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = ACT2FN[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class SwappedSparseBlock(nn.Module):
    """Drop-in for a ``*SparseMoeBlock``: ``forward(hidden [B, T, H]) -> hidden``."""

    def __init__(self, moe: MoE, original_experts: dict[str, torch.Tensor], aux_loss_coef: float) -> None:
        super().__init__()
        self.moe = moe
        self.aux_loss_coef = aux_loss_coef
        self._original_experts: dict[str, torch.Tensor] | None = original_experts

    def materialize(self) -> None:
        """Attach EP groups (collective) and keep only this rank's experts' original weights."""
        if self._original_experts is None:
            return
        layer = self.moe.deepspeed_moe
        layer._attach()
        first = layer.ep_rank * layer.num_local_experts
        with torch.no_grad():
            for j, expert in enumerate(layer.experts.deepspeed_experts):
                expert.gate_up.weight.copy_(self._original_experts["gate_up_proj"][first + j])
                expert.down.weight.copy_(self._original_experts["down_proj"][first + j])
        self._original_experts = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.materialize()
        output, aux_loss, _ = self.moe(hidden_states)
        if self.training and self.aux_loss_coef > 0 and torch.is_grad_enabled():
            output = AuxLossGradient.apply(output, aux_loss * self.aux_loss_coef)
        return output


def _mixtral_blocks(model: nn.Module) -> list[tuple[str, MixtralSparseMoeBlock]]:
    """Mixtral's sparse blocks, named; any block the swap would not reproduce exactly is refused."""
    blocks = []
    for name, module in model.named_modules():
        if isinstance(module, MixtralSparseMoeBlock):
            if module.jitter_noise > 0:
                raise ValueError(
                    f"{name}: model.config.router_jitter_noise={module.jitter_noise} scales Mixtral's block input by "
                    "noise in training, which the DeepSpeed-MoE swap does not do; set "
                    "model.config.router_jitter_noise=0, or use moe.experts=merak_ep (keeps the block as it is)")
            blocks.append((name, module))
        elif type(module).__name__.endswith("SparseMoeBlock"):
            raise ValueError(
                f"{name}: {type(module).__name__} cannot be swapped onto DeepSpeed-MoE, which reproduces only "
                "Mixtral's router (softmax top-k renormalised, no shared expert); use moe.experts=merak_ep, which "
                "keeps every transformers MoE family's own router, shared experts and norm_topk_prob")
    return blocks


def swap_sparse_moe_blocks(
    model: nn.Module,
    ep_size: int,
    options: MoEOptions,
    *,
    capacity_factor: float = 1.0,
    drop_tokens: bool = False,
    min_capacity: int = 0,
    aux_loss_coef: float = 0.01,
    cost_model: CostModel | None = None,
) -> list[SwappedSparseBlock]:
    """Replace every Mixtral sparse block of ``model`` in place; return the new blocks.

    Every argument and every block is checked before the first block is replaced, so a refusal leaves the model
    as it was.
    """
    if not isinstance(options, MoEOptions):
        raise ValueError(f"options={options!r} must be a MoEOptions; pass MoEOptions(...)")
    check_count("ep_size", ep_size, 1, "pass the ranks each layer's experts are spread over (1: no expert parallelism)")
    check_number("capacity_factor", capacity_factor,
                 "pass e.g. 1.0 (DeepSpeed's default: an expert takes up to factor x tokens / num_experts)", above=0)
    check_count("min_capacity", min_capacity, 0, "pass the fewest tokens an expert always takes (0: no floor)")
    check_flag("drop_tokens", drop_tokens)
    check_number("aux_loss_coef", aux_loss_coef, "pass the router's load-balancing loss weight (0: none)", at_least=0)
    options.validate(drop_tokens, ep_size)
    config = getattr(model, "config", None)
    targets = _mixtral_blocks(model)
    if not targets:
        raise ValueError(
            f"{type(model).__name__} has no Mixtral-style sparse MoE block (a MixtralSparseMoeBlock); build it with "
            "model=mixtral_tiny or a Mixtral config, or use moe.experts=merak_ep for another MoE family"
        )
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            "model.config.output_router_logits=True asks for the load-balancing loss of Mixtral's routers, which the "
            "DeepSpeed-MoE swap replaces: the swapped layers add their own load-balancing loss (weighted by "
            f"{option_key('aux_loss_coef')}); drop model.config.output_router_logits, or use moe.experts=merak_ep, "
            "which keeps the model's routers and their aux loss (model.config.router_aux_loss_coef)")
    for name, block in targets:
        num_experts, hidden = block.experts.down_proj.shape[0], block.experts.down_proj.shape[1]
        try:
            check_layer_arguments(hidden, num_experts, ep_size, int(block.top_k), capacity_factor, capacity_factor,
                                  min_capacity, None, drop_tokens=drop_tokens)
        except ValueError as refusal:
            raise ValueError(f"{name}: {refusal}") from None
    scheduler = TransferScheduler()
    swapped = []
    for name, block in targets:
        num_experts, intermediate, hidden = block.experts.down_proj.shape[0], block.experts.down_proj.shape[2], \
            block.experts.down_proj.shape[1]
        k = int(block.top_k)
        activation = getattr(config, "hidden_act", "silu")
        moe = MoE(
            hidden, SwiGLUExpert(hidden, intermediate, activation), num_experts=num_experts, ep_size=ep_size, k=k,
            capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor, min_capacity=min_capacity,
            drop_tokens=drop_tokens, use_rts=False, top2_2nd_expert_sampling=False, options=options,
            cost_model=cost_model, scheduler=scheduler,
        )
        moe.deepspeed_moe.top1_weight_one = True  # Mixtral renormalises its top-1 probability to 1
        weights = block.experts.down_proj
        moe.to(device=weights.device)  # the gate stays float32, as DeepSpeed's gate computes
        moe.deepspeed_moe.experts.to(dtype=weights.dtype)  # the experts as the model's (bf16 from_pretrained)
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight.copy_(block.gate.weight)
        original = {
            "gate_up_proj": block.experts.gate_up_proj.detach().clone(),
            "down_proj": block.experts.down_proj.detach().clone(),
        }
        new_block = SwappedSparseBlock(moe, original, aux_loss_coef)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new_block)
        swapped.append(new_block)
    if swapped and aux_loss_coef > 0:
        model.register_forward_hook(_scale_aux_gradients_by_model_loss)
    return swapped


def _scale_aux_gradients_by_model_loss(model: nn.Module, inputs: Any, output: Any) -> None:
    """The model's own loss (called with labels) scales the swapped blocks' aux gradients, whoever scales it."""
    scale_aux_gradients_by_loss(getattr(output, "loss", None))
