"""Find the repeated blocks (transformer layers, ResNet blocks) of any module.

Discovery only looks at the module it is given, so it works the same on a whole
LightningModule, on a bare ``nn.Module`` and on a pipeline stage a strategy hands over.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence, Union

from torch import nn

__all__ = ["BlockSelector", "describe_blocks", "discover_blocks"]

BlockSelector = Union[None, Sequence[str], type, tuple, Callable[[str, nn.Module], bool]]


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _auto(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The class that fills most parameters among composite modules repeated in containers."""
    by_class: dict[type, list[tuple[str, nn.Module]]] = collections.defaultdict(list)
    for name, container in root.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        for child_name, child in container.named_children():
            if any(True for _ in child.children()) and _param_count(child) > 0:
                qualified = f"{name}.{child_name}" if name else child_name
                by_class[type(child)].append((qualified, child))
    repeated = {cls: found for cls, found in by_class.items() if len(found) >= 2}
    if not repeated:
        return []
    best = max(repeated.values(), key=lambda found: (sum(_param_count(m) for _, m in found), len(found)))
    return best


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(n.startswith(other + ".") for other in names if other != n)]


SELECTOR_FORMS = ("pass blocks=None (every repeated block), qualified names such as ['model.layers.0'], "
                  "a module class or a predicate (name, module) -> bool")
"""The forms ``blocks`` takes, as refusals name them."""


def describe_blocks(root: nn.Module) -> str:
    """How many repeated blocks ``root`` has, and their first and last names: what a refused ``blocks`` could
    have chosen from."""
    found = discover_blocks(root)
    if not found:
        return f"{type(root).__name__} has no repeated blocks"
    names = found[0][0] if len(found) == 1 else f"{found[0][0]} … {found[-1][0]}"
    return f"{type(root).__name__} has {len(found)} repeated blocks ({names})"


def _selector_problem(selector: object) -> str:
    """Why ``selector`` is no block selector; a count gets its own words, as the likeliest slip."""
    if isinstance(selector, int) and not isinstance(selector, bool):
        return f"blocks={selector!r} is a count, but blocks chooses which blocks to manage, not how many"
    return f"blocks={selector!r} is not a block selector"


def discover_blocks(root: nn.Module, selector: BlockSelector = None) -> list[tuple[str, nn.Module]]:
    """Candidate blocks of ``root`` as (qualified name, module), outermost only.

    ``selector``: None finds repeated blocks automatically; a list of qualified names, a
    module class (or tuple of classes), or a predicate ``(name, module) -> bool`` choose them.
    """
    modules = dict(root.named_modules())
    if selector is None:
        found = _auto(root)
    elif isinstance(selector, type) or (
        isinstance(selector, tuple) and selector and all(isinstance(s, type) for s in selector)
    ):
        found = [(n, m) for n, m in modules.items() if n and isinstance(m, selector)]
    elif callable(selector):
        found = [(n, m) for n, m in modules.items() if n and selector(n, m)]
    elif isinstance(selector, (list, tuple)):
        names = list(selector)
        missing = [n for n in names if n not in modules or not n]
        if missing:
            sample = [n for n in modules if n][:12]
            raise ValueError(
                f"blocks {missing} are not submodules: {describe_blocks(root)}; "
                f"qualified names look like {sample}"
            )
        found = [(n, modules[n]) for n in names]
    else:
        raise ValueError(f"{_selector_problem(selector)}; {describe_blocks(root)}; {SELECTOR_FORMS}")
    order = {name: i for i, name in enumerate(modules)}
    found.sort(key=lambda item: order[item[0]])
    return _outermost(found)
