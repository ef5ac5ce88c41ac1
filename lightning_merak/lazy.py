"""Package attributes imported on first use, so importing a package costs nothing until a name is used."""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable


def lazy_attributes(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` (a module; relative to ``package``
    when it starts with a dot) and returns its attribute ``name``."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(import_module(exports[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
