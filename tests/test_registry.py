import pytest
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry

import lightning_merak
from lightning_merak import strategies
from lightning_merak.strategies import StrategyEntry, register_strategies
from lightning_merak.strategies.merak3d import Merak3DStrategy


class _ExampleStrategy(DDPStrategy):
    """A real strategy subclass used to exercise the registration mechanism."""


def test_import_registers_every_listed_strategy():
    for entry in strategies.STRATEGIES:
        assert StrategyRegistry[entry.name]["strategy"] == entry.constructor()
    assert isinstance(StrategyRegistry.get("merak3d"), Merak3DStrategy)
    assert lightning_merak.register_strategies() == [entry.name for entry in strategies.STRATEGIES]


def test_registration_is_idempotent(monkeypatch):
    registry = _StrategyRegistry()
    monkeypatch.setattr(
        strategies,
        "STRATEGIES",
        [StrategyEntry("merak_example", _ExampleStrategy, "example", {"find_unused_parameters": True})],
    )
    assert register_strategies(registry) == ["merak_example"]
    assert register_strategies(registry) == ["merak_example"]
    assert registry.available_strategies().count("merak_example") == 1
    built = registry.get("merak_example")
    assert isinstance(built, _ExampleStrategy)
    assert built._ddp_kwargs["find_unused_parameters"] is True


def test_name_taken_by_another_class_is_refused(monkeypatch):
    registry = _StrategyRegistry()
    registry.register("merak_example", SingleDeviceStrategy, description="someone else's")
    monkeypatch.setattr(strategies, "STRATEGIES", [StrategyEntry("merak_example", _ExampleStrategy, "example")])
    with pytest.raises(RuntimeError, match="already registered for SingleDeviceStrategy"):
        register_strategies(registry)
