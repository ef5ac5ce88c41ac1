"""Lightning strategies shipped by lightning-merak, registered by name on import.

Each strategy lives in its own module and is listed in :data:`STRATEGIES` with the name
users pass to ``Trainer(strategy=...)``. Only strategies that work are listed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.strategies import Strategy, StrategyRegistry


@dataclass(frozen=True)
class StrategyEntry:
    """A strategy class published under ``name`` with default constructor arguments."""

    name: str
    strategy_class: type[Strategy]
    description: str
    init_params: dict[str, Any] = field(default_factory=dict)


def _entries() -> list[StrategyEntry]:
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    return [
        StrategyEntry(
            "merak3d",
            Merak3DStrategy,
            "Automated data × pipeline × tensor parallelism for unmodified models",
        )
    ]


STRATEGIES: list[StrategyEntry] = _entries()


def register_strategies(registry: dict[str, Any] = StrategyRegistry) -> list[str]:
    """Register every entry of :data:`STRATEGIES` in ``registry``; safe to call repeatedly.

    Returns the names registered. An entry already registered with the same class is
    left alone; a name taken by another class is an error rather than a silent override.
    """
    for entry in STRATEGIES:
        if entry.name in registry:
            existing = registry[entry.name]
            if existing["strategy"] is not entry.strategy_class:
                raise RuntimeError(
                    f"strategy name {entry.name!r} is already registered for "
                    f"{existing['strategy'].__qualname__}; lightning-merak cannot register "
                    f"{entry.strategy_class.__qualname__} under it"
                )
            continue
        registry.register(
            entry.name, entry.strategy_class, description=entry.description, **entry.init_params
        )
    return [entry.name for entry in STRATEGIES]


__all__ = ["STRATEGIES", "StrategyEntry", "register_strategies"]
