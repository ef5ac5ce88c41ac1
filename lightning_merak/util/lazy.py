"""Package attributes imported on first use, so importing a package costs nothing until a name is used.

The one helper behind every package's lazy exports, and behind the modules kept for old import paths
(``moved_to``: a :class:`FutureWarning` names the new home of each name used).
"""

from __future__ import annotations

import warnings
from importlib import import_module
from typing import Any, Callable, Optional


def lazy_attributes(package: str, exports: dict[str, str], moved_to: Optional[str] = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` (a module; relative to ``package``
    when it starts with a dot) and returns its attribute ``name``.

    With ``moved_to`` (a sentence naming the release that drops the old path), ``package`` is an old import path
    kept for compatibility: each use warns with the name's new module.
    """

    def __getattr__(name: str) -> Any:
        if name in exports:
            module = import_module(exports[name], package)
            if moved_to is not None:
                warnings.warn(f"{package}.{name} moved to {module.__name__}.{name}; {moved_to}",
                              FutureWarning, stacklevel=2)
            return getattr(module, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
