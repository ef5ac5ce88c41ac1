"""``strategy=merak3d``: the strategy's options, declared once, and the Hydra schema derived from them.

:class:`~lightning_merak.strategies.merak3d.options.Merak3DOptions` (plain Python, no torch) holds every argument of
:class:`~lightning_merak.strategies.merak3d.Merak3DStrategy` with its default;
:class:`~lightning_merak.strategies.merak3d.arguments.Merak3DArguments` extends it with the checks,
and the Hydra schema :class:`Merak3DStrategyConfig` takes its fields with their descriptions (degrees, which may be
``"auto"``, become ``Any`` there). ``conf/strategy/merak3d.yaml`` therefore names no key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from lightning_merak.cli.config import StrategyConfig, register_option
from lightning_merak.cli.options.schema import schema_of
from lightning_merak.strategies.merak3d.options import Merak3DOptions

__all__ = ["Merak3DStrategyConfig", "register"]

_Merak3DFields = schema_of(Merak3DOptions, "_Merak3DFields")


@dataclass
class Merak3DStrategyConfig(_Merak3DFields, StrategyConfig):  # type: ignore[misc,valid-type]
    """``strategy=merak3d``: every argument of :class:`~lightning_merak.strategies.merak3d.Merak3DStrategy`.

    Degrees take an integer or ``auto``; ``pipeline_parallel``, ``tensor_parallel``,
    ``tp_overlap`` or ``recompute`` set to ``auto`` run the layout planner, and
    ``plan_only=true`` prints the planned layout and exits.
    """

    name: str = "merak3d"

    def strategy_kwargs(self) -> dict[str, Any]:
        """Every option as a constructor argument, with ``kwargs`` on top."""
        own = {item.name: getattr(self, item.name) for item in fields(Merak3DOptions)}
        return {**own, **self.kwargs}


def register() -> None:
    """Register ``strategy=merak3d``'s schema (called by the project's config setup)."""
    register_option("strategy", "merak3d", Merak3DStrategyConfig)
