"""Every transformers-5 MoE family, expert parallel, any top-k: dropless grouped experts in transformers' registry.

``grouped`` and ``exchange`` are the pure cores (grouped expert MLP over fused 3D tensors; expert
ownership and the dropless exchange plan); ``parallel`` registers ``merak_ep`` / ``merak_grouped`` in
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``; ``enable`` checks a model's family, slices
its experts and switches it. Names are imported on first use (transformers is heavy).
"""

from lightning_merak.util.lazy import lazy_attributes

_EXPORTS = {
    "EXACT_FAMILIES": ".enable", "REFUSED_FAMILIES": ".enable", "ExpertParallelReport": ".enable",
    "enable_expert_parallel": ".enable", "enable_grouped_experts": ".enable", "expert_load": ".enable",
    "expert_split_problem": ".enable", "experts_modules": ".enable", "family_support": ".enable",
    "plan_replicas": ".enable",
    "set_replica_plans": ".enable",
    "DroplessExchange": ".exchange", "local_expert_range": ".exchange",
    "grouped_experts_forward": ".grouped", "grouped_linear": ".grouped", "grouped_mm_applies": ".grouped",
    "expert_mlp": ".grouped", "sort_routes": ".grouped", "EXPERT_TENSORS": ".grouped",
    "ExpertShard": ".parallel", "SHARD_ATTRIBUTE": ".parallel", "expert_parallel_forward": ".parallel",
    "register": ".parallel",
    "FAMILY_CONFIGS": ".families", "FAMILY_ROUTING": ".families", "ROUTINGS": ".families",
    "family_widths": ".families", "tiny_moe_model": ".families",
    "ExpertParallelLancet": ".lancet", "expert_parallel_lancet": ".lancet",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
