"""Expert parallelism (``moe.experts=merak_ep``) in the planner: each MoE layer's all-to-all, the experts a rank keeps.

Under merak3d a stage's experts are spread over ``ep`` of its data-parallel ranks. Each MoE layer then gathers
the ``[ep, E]`` route counts once and exchanges token copies twice in its forward (dispatch to the experts'
owners, combine back) and twice in its backward (the gradients of both). With ``T`` tokens on a rank, ``k``
routes per token, hidden size ``h`` and ``b`` bytes per element, one direction moves ``T·k·h·b·(ep − 1)/ep``
bytes per rank over the expert group's link (routes spread evenly over the owners; a rank's own share stays
local). A rank keeps ``E/ep`` of each layer's experts; their gradients skip the bucketed data-parallel
reduction and are summed over the ``dp/ep`` ranks holding the same experts after the backward
(:mod:`lightning_merak.parallel.experts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["ExpertLayers", "StageExperts", "stage_experts"]

_COUNT_BYTES = 8
"""One route count (int64) of the all-gathered ``[ep, E]`` count matrix."""


class Link(Protocol):
    """The link an exchange crosses: a :class:`~.profile.CollectiveCost` (whose ``ModelProfile`` holds these layers)."""

    def send_s(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` point to point."""


@dataclass(frozen=True)
class ExpertLayers:
    """A model's MoE layers as ``merak_ep`` runs them.

    ``moe_blocks`` of the profile's blocks hold an MoE layer: those at ``block_indices`` (trunk positions, as a
    profiler reads them from the model; a family may keep its first blocks dense), or, without them, spread evenly
    over the stages (a stage's share is its blocks' fraction). ``expert_parameter_bytes`` are one layer's ``E``
    experts, as the profile's block parameter bytes count them (tensor parallelism does not cut the fused expert
    tensors).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    tokens_per_sample: int
    moe_blocks: int
    expert_parameter_bytes: int
    dtype_bytes: int = 4
    block_indices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_size", "tokens_per_sample", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ExpertLayers.{name} must be >= 1, got {getattr(self, name)}")
        if self.moe_blocks < 0 or self.expert_parameter_bytes < 0:
            raise ValueError("ExpertLayers.moe_blocks and expert_parameter_bytes must be >= 0")
        if self.top_k > self.num_experts:
            raise ValueError(f"ExpertLayers.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.block_indices is not None and (len(set(self.block_indices)) != self.moe_blocks
                                               or min(self.block_indices, default=0) < 0):
            raise ValueError(f"ExpertLayers.block_indices={self.block_indices} must name moe_blocks={self.moe_blocks} "
                             "distinct trunk positions >= 0")

    def check_ep(self, ep: int) -> None:
        """Refuse an expert-parallel size that does not split the experts evenly (as the runtime does)."""
        if ep < 1 or self.num_experts % ep:
            raise ValueError(f"ep={ep} does not divide the {self.num_experts} experts; choose a divisor of them")

    def all_to_all_bytes(self, samples: int, ep: int) -> float:
        """Bytes one rank sends in one direction of one token exchange of ``samples`` samples."""
        tokens = samples * self.tokens_per_sample
        return tokens * self.top_k * self.hidden_size * self.dtype_bytes * (ep - 1) / ep

    def layer_exchange_s(self, samples: int, ep: int, link: Link) -> tuple[float, float]:
        """``(forward_s, backward_s)`` of one MoE layer's exchanges for ``samples`` samples over ``link``: the
        counts all-gather plus dispatch and combine forward, their two gradients backward."""
        if ep == 1:
            return 0.0, 0.0
        direction_s = link.send_s(self.all_to_all_bytes(samples, ep))
        counts_s = link.send_s((ep - 1) * self.num_experts * _COUNT_BYTES)
        return counts_s + 2 * direction_s, 2 * direction_s

    def stage_layers(self, first_block: int, stage_blocks: int, num_blocks: int) -> float:
        """MoE layers on a stage holding blocks ``first_block`` to ``first_block + stage_blocks - 1`` of the model's
        ``num_blocks``: those of :attr:`block_indices` there, else the stage's share of an even spread."""
        if self.block_indices is None:
            return stage_blocks * self.moe_blocks / num_blocks
        return sum(first_block <= index < first_block + stage_blocks for index in self.block_indices)

    def kept_bytes(self, ep: int) -> float:
        """One MoE layer's expert bytes a rank keeps: ``E/ep`` of its experts."""
        return self.expert_parameter_bytes / ep


class Network(Protocol):
    """Where the expert groups' links come from: a :class:`~.profile.NetworkProfile`."""

    def all_to_all_link(self, ranks: int) -> Link:
        """The link of an all-to-all among ``ranks`` ranks."""


@dataclass(frozen=True)
class StageExperts:
    """A stage's MoE layers on one rank: exchange time per micro-batch, expert bytes kept and not kept."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    kept_bytes: float = 0.0
    dropped_bytes: float = 0.0


def stage_experts(experts: ExpertLayers | None, ep: int, overlap: int, network: Network, first_block: int,
                  stage_blocks: int, num_blocks: int, samples: int) -> StageExperts:
    """The expert exchange of each MoE layer of a stage holding ``stage_blocks`` of the ``num_blocks`` blocks from
    trunk position ``first_block`` (per sub-batch of ``samples // overlap``, over the expert group's link), and the
    ``E/ep`` experts of each a rank keeps; nothing without MoE layers (``experts`` None)."""
    if experts is None:
        return StageExperts()
    experts.check_ep(ep)
    layers = experts.stage_layers(first_block, stage_blocks, num_blocks)
    forward_s = backward_s = 0.0
    if ep > 1:
        forward_s, backward_s = experts.layer_exchange_s(samples // overlap, ep, network.all_to_all_link(ep))
    kept = experts.kept_bytes(ep)
    return StageExperts(layers * overlap * forward_s, layers * overlap * backward_s,
                        layers * kept, layers * (experts.expert_parameter_bytes - kept))
