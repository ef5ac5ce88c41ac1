"""Gating a batch that runs as sub-batches, with the decisions of the whole batch.

Under block-scope Lancet a batch runs as sub-batches, but DeepSpeed's capacity gate
decides on all tokens at once (capacity from the total token count, positions in token
order). The routing (expert indices, capacity locations, dropped routes) is therefore
computed once on the concatenated logits and sliced per sub-batch; it is not
differentiable. What is differentiable stays in each sub-batch's own graph: the gate
weight of each route (a softmax of the token's own logits) and the sub-batch's share of
the auxiliary loss. ``l_aux = E · Σ_e me_e · ce_e`` is linear in ``me_e`` (the mean gate
probability of expert ``e``) while ``ce_e`` (the share of tokens whose first choice is
``e``) carries no gradient, so the shares ``E · Σ_e (Σ_{t∈sub-batch} p_te / N) · ce_e``
sum to the whole batch's ``l_aux`` and give the same gradients. Pure torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["compact_routes", "first_choice_fraction", "sub_batch_gates"]


def compact_routes(
    indices: torch.Tensor, locations: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Renumber a sub-batch's kept routes ``[k, n]`` per expert from 0, in joint-location order.

    Returns the new locations (0 for dropped routes, index −1) and the kept routes per
    expert, so the sub-batch's exchange carries its own routes only, without padding.
    """
    kept = indices >= 0
    experts = indices.long().clamp(min=0)[kept]
    joint = locations.long()[kept]
    counts = torch.bincount(experts, minlength=num_experts)
    span = int(joint.max()) + 1 if joint.numel() else 1
    order = torch.argsort(experts * span + joint, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    starts = torch.cumsum(counts, 0) - counts
    compact = torch.zeros_like(indices, dtype=torch.long)
    compact[kept] = rank - starts[experts]
    return compact, counts


def first_choice_fraction(logits: torch.Tensor) -> torch.Tensor:
    """``ce_e`` of top-2 gating: the share of tokens whose most probable expert is ``e``."""
    probabilities = F.softmax(logits, dim=1)
    first = F.one_hot(torch.argmax(probabilities, dim=1), num_classes=logits.size(1))
    return torch.mean(first.float(), dim=0)


def sub_batch_gates(
    logits: torch.Tensor, indices: torch.Tensor, first_fraction: torch.Tensor, total_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate weights ``[k, n]`` of a sub-batch's routes and its share of the auxiliary loss.

    ``logits`` ``[n, E]`` are the sub-batch's (fp32, with their graph); ``indices`` its
    slice of the joint routing (−1 where dropped); ``first_fraction`` the joint ``ce``;
    ``total_tokens`` the token count of the whole batch. Top-2 weights are renormalised
    over the kept routes, as DeepSpeed's ``top2gating`` does.
    """
    probabilities = F.softmax(logits, dim=1)
    kept = indices >= 0
    chosen = probabilities.gather(1, indices.long().clamp(min=0).t()).t() * kept
    if indices.size(0) == 2:
        chosen = chosen / torch.clamp(chosen.sum(0), min=torch.finfo(chosen.dtype).eps)
    num_experts = logits.size(1)
    share = torch.sum(probabilities.sum(0) / total_tokens * first_fraction) * num_experts
    return chosen, share
