"""lightning-merak: systems techniques for training large models with PyTorch Lightning.

Importing the package registers its strategies in Lightning's ``StrategyRegistry`` — at once
when ``lightning.pytorch`` is already imported, otherwise right after it is — so that
``import lightning_merak`` itself stays light (``merak-train --help`` imports no torch).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Optional, Sequence

from lightning_merak.strategies import register_strategies
from lightning_merak.util.lazy import lazy_attributes

__version__ = "0.2.0"

__all__ = ["Merak3DStrategy", "__version__", "register_strategies"]

__getattr__ = lazy_attributes(__name__, {"Merak3DStrategy": "lightning_merak.strategies.merak3d.strategy"})


class _RegisterAfterLightningImport(importlib.abc.MetaPathFinder):
    """Runs :func:`register_strategies` once ``lightning.pytorch`` has finished importing."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if fullname != "lightning.pytorch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def execute_then_register(module: Any) -> None:
            execute(module)
            register_strategies()

        spec.loader.exec_module = execute_then_register  # type: ignore[method-assign]
        return spec


if "lightning.pytorch" in sys.modules:  # probed, not imported: `import lightning_merak` must not import Lightning
    register_strategies()
else:
    sys.meta_path.insert(0, _RegisterAfterLightningImport())
