"""Skewed routings for the MoE benchmark: a drifting Zipf and hot sets that rotate every k steps.

A token's first choice is drawn from a Zipf law over the experts in a "hot order"; the
routing decides how that order changes between steps. ``drift`` shifts it by one expert
every ``every`` steps (the hottest expert moves to its neighbour, issue #5's routing);
``rotate`` draws a new random order every ``every`` steps, so the hot set jumps to
other ranks and a plan made from the previous step's counts is wrong on that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Routing", "routing_counts", "routing_inputs"]


@dataclass(frozen=True)
class Routing:
    kind: Literal["drift", "rotate"]
    every: int
    skew: float = 1.2

    @property
    def label(self) -> str:
        return f"{self.kind}{self.every}_zipf{self.skew:g}"


def _hot_order(routing: Routing, experts: int, step: int) -> Any:
    import torch

    period = step // routing.every
    if routing.kind == "drift":
        return torch.roll(torch.arange(experts), period)
    return torch.randperm(experts, generator=torch.Generator().manual_seed(104729 + period))


def _weights(routing: Routing, experts: int) -> Any:
    import torch

    return torch.tensor([1.0 / (i + 1) ** routing.skew for i in range(experts)])


def routing_inputs(routing: Routing, rank: int, step: int, tokens: int, gate_weight: Any) -> Any:
    """Hidden states that a fixed gate routes as the routing says (first choice; top-2 adds a second)."""
    import torch

    experts, hidden = gate_weight.shape
    generator = torch.Generator().manual_seed(7919 * rank + step)
    draws = torch.multinomial(_weights(routing, experts), tokens, replacement=True, generator=generator)
    targets = _hot_order(routing, experts, step)[draws]
    directions = gate_weight / gate_weight.norm(dim=1, keepdim=True)
    noise = torch.randn(tokens, hidden, generator=generator)
    return 0.5 * noise + 4.0 * directions[targets]


def routing_counts(routing: Routing, ranks: int, experts: int, tokens: int, step: int) -> list[list[int]]:
    """Top-2 count matrix (ranks × experts) for the simulation: first choice as above, second uniform."""
    import torch

    order = _hot_order(routing, experts, step)
    weights = _weights(routing, experts)
    counts = []
    for rank in range(ranks):
        generator = torch.Generator().manual_seed(7919 * rank + step)
        first = order[torch.multinomial(weights, tokens, replacement=True, generator=generator)]
        second = (first + torch.randint(1, experts, (tokens,), generator=generator)) % experts
        counts.append(torch.bincount(torch.cat([first, second]), minlength=experts).tolist())
    return counts
