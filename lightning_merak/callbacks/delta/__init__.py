"""DELTA-style activation memory management: budget-driven swap and recompute per block.

The core (budget parsing, profiles, the planner, the ledger) is plain Python; the torch
side is saved-tensor hooks and instance-level forward switches; :class:`DeltaMemory`
wires both into Lightning.

Names are imported on first use, so the pure budget parser can be read by the Hydra options
without importing torch.
"""

from lightning_merak.util.lazy import lazy_attributes

_EXPORTS = {
    "discover_blocks": ".blocks",
    "Budget": ".budget",
    "parse_budget": ".budget",
    "DeltaMemory": ".callback",
    "Action": ".memory_planner",
    "BlockDecision": ".memory_planner",
    "BlockProfile": ".memory_planner",
    "Plan": ".memory_planner",
    "PlannerSettings": ".memory_planner",
    "StepProfile": ".memory_planner",
    "plan_memory": ".memory_planner",
    "simulate_timeline": ".memory_planner",
    "ManagerOptions": ".runtime",
    "MemoryManager": ".runtime",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_attributes(__name__, _EXPORTS)
