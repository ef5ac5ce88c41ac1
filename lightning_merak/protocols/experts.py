"""What an MoE layer declares, so strategies and checkpoints recognise one without importing the MoE plugin.

The plugin's layer (:class:`lightning_merak.plugins.moe.layer.MoE`) subclasses DeepSpeed's, so importing it
imports DeepSpeed. A feature that must treat MoE layers apart (FSDP2 refuses to shard them, checkpoints renumber
their experts) checks ``isinstance(module, ExpertParallelLayer)`` instead: a model holding such a layer has
imported the plugin already, and one that has not holds none.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["ExpertParallelLayer"]


@runtime_checkable
class ExpertParallelLayer(Protocol):
    """An MoE layer whose experts are spread over ``ep_size`` ranks, ``num_local_experts`` on each.

    Each rank numbers its own experts from 0: their parameters are named
    ``<layer>.<local_experts_key><local number>.<rest of the name>``.
    """

    local_experts_key: str
    """Where the layer's experts are named, relative to the layer (``"deepspeed_moe.experts.deepspeed_experts."``)."""

    ep_size: int
    """Ranks of the layer's expert-parallel group."""

    num_local_experts: int
    """Experts each of them holds."""
