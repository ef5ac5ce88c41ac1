"""DELTA-style activation memory management: budget-driven swap and recompute per block.

The core (budget parsing, profiles, the planner, the ledger) is plain Python; the torch
side is saved-tensor hooks and instance-level forward switches; :class:`DeltaMemory`
wires both into Lightning.

Names are imported on first use, so the pure budget parser can be read by the Hydra options
without importing torch.
"""

from lightning_merak.lazy import lazy_attributes

_EXPORTS = {
    "discover_blocks": ".blocks",
    "Budget": ".budget",
    "parse_budget": ".budget",
    "DeltaMemory": ".callback",
    "Action": ".planner",
    "BlockDecision": ".planner",
    "BlockProfile": ".planner",
    "Plan": ".planner",
    "PlannerSettings": ".planner",
    "StepProfile": ".planner",
    "plan_memory": ".planner",
    "simulate_timeline": ".planner",
    "ManagerOptions": ".runtime",
    "MemoryManager": ".runtime",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_attributes(__name__, _EXPORTS)
