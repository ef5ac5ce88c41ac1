"""DELTA-style activation memory management: budget-driven swap and recompute per block.

The core (budget parsing, profiles, the planner, the ledger) is plain Python; the torch
side is saved-tensor hooks and instance-level forward switches; :class:`DeltaMemory`
wires both into Lightning.
"""

from lightning_merak.callbacks.delta.blocks import discover_blocks
from lightning_merak.callbacks.delta.budget import Budget, parse_budget
from lightning_merak.callbacks.delta.callback import DeltaMemory
from lightning_merak.callbacks.delta.planner import (
    Action,
    BlockDecision,
    BlockProfile,
    Plan,
    PlannerSettings,
    StepProfile,
    plan_memory,
    simulate_timeline,
)
from lightning_merak.callbacks.delta.runtime import ManagerOptions, MemoryManager

__all__ = [
    "Action",
    "BlockDecision",
    "BlockProfile",
    "Budget",
    "DeltaMemory",
    "ManagerOptions",
    "MemoryManager",
    "Plan",
    "PlannerSettings",
    "StepProfile",
    "discover_blocks",
    "parse_budget",
    "plan_memory",
    "simulate_timeline",
]
