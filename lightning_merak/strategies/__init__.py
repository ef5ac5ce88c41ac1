"""Lightning strategies shipped by lightning-merak, registered by name.

Each strategy lives in its own module and is listed in :data:`STRATEGIES` with the name
users pass to ``Trainer(strategy=...)``. Only strategies that work are listed. Entries name
their class as ``"module:Class"`` so that registering them imports nothing heavy: the class
is imported when Lightning first builds the strategy.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Union

from lightning_merak.util.lazy import lazy_attributes

__all__ = ["STRATEGIES", "LazyStrategy", "Merak3DStrategy", "StrategyEntry", "register_strategies"]


@dataclass(frozen=True)
class LazyStrategy:
    """A registry constructor that imports ``target`` (``"module:Class"``) on first use."""

    target: str

    def load(self) -> type:
        module_name, class_name = self.target.split(":")
        return getattr(importlib.import_module(module_name), class_name)

    def __call__(self, **kwargs: Any) -> Any:
        return self.load()(**kwargs)


def _describe(constructor: Any) -> str:
    return constructor.target if isinstance(constructor, LazyStrategy) else constructor.__qualname__


@dataclass(frozen=True)
class StrategyEntry:
    """A strategy published under ``name``: a class, or ``"module:Class"`` imported on first use."""

    name: str
    strategy: Union[type, str]
    description: str
    init_params: dict[str, Any] = field(default_factory=dict)

    def constructor(self) -> Any:
        """What the registry calls with ``init_params`` to build the strategy."""
        return LazyStrategy(self.strategy) if isinstance(self.strategy, str) else self.strategy


STRATEGIES: list[StrategyEntry] = [
    StrategyEntry(
        "merak3d",
        "lightning_merak.strategies.merak3d:Merak3DStrategy",
        "Automated data × pipeline × tensor parallelism for unmodified models",
    )
]


def register_strategies(registry: Any = None) -> list[str]:
    """Register every entry of :data:`STRATEGIES` in ``registry`` (Lightning's by default); idempotent.

    Returns the names registered. An entry already registered with the same constructor is
    left alone; a name taken by another class is an error rather than a silent override.
    """
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry as registry
    for entry in STRATEGIES:
        constructor = entry.constructor()
        if entry.name in registry:
            existing = registry[entry.name]["strategy"]
            if existing != constructor:
                raise RuntimeError(
                    f"strategy name {entry.name!r} is already registered for "
                    f"{_describe(existing)}; lightning-merak cannot register {_describe(constructor)} under it"
                )
            continue
        registry.register(entry.name, constructor, description=entry.description, **entry.init_params)
    return [entry.name for entry in STRATEGIES]


__getattr__ = lazy_attributes(__name__, {"Merak3DStrategy": "lightning_merak.strategies.merak3d.strategy"})
