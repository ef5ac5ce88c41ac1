"""The ``_target_`` nodes of ``merak-train`` (``module``, ``data``, ``logger.*``, ``callbacks``): checked, then made.

Hydra's ``instantiate`` fails late and deep (an unknown keyword is a ``TypeError`` inside the user's
``__init__``, a wrong class trains nothing until Lightning rejects it). :func:`instantiate_checked` refuses first,
naming the fix: a target that does not import, one that is not the kind of object its key expects, one that
leaves a member Lightning needs to train as its base class's stub, a keyword the target does not take (with the
closest one it does) and a required one left out.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any, Callable

from lightning_merak.cli.overrides import ConfigError

__all__ = ["RESERVED_KEYS", "instantiate_checked", "refuse_unknown_keywords", "target_class"]

RESERVED_KEYS = ("_target_", "_args_", "_partial_", "_convert_", "_recursive_")
"""Hydra's own keys of a ``_target_`` node, which are not keyword arguments of the target."""


def target_class(node: Mapping[str, Any], path: str, base: type, required: tuple[str, ...] = ()) -> type:
    """The class ``node["_target_"]`` names, refused unless it imports, subclasses ``base`` and defines each member
    of ``required`` itself (``base``'s own is a stub, which Lightning refuses only once the ranks run)."""
    name = node.get("_target_")
    if not isinstance(name, str) or "." not in name:
        raise ConfigError(f"{path}._target_={name} is not an import path; set {path}._target_=package.module.Class")
    module_name, _, attribute = name.rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"{path}._target_={name} does not import ({type(error).__name__}: {error}); give the full "
                          "import path of a class on the Python path (the current directory is on it only with "
                          "PYTHONPATH=.)") from None
    if not (isinstance(target, type) and issubclass(target, base)):
        raise ConfigError(f"{path}._target_={name} is not a {base.__module__}.{base.__qualname__} subclass; point "
                          f"it at one")
    for member in required:
        if getattr(target, member, None) is getattr(base, member):
            raise ConfigError(f"{path}._target_={name} does not define {member}(), which Lightning needs to train "
                              f"(the {base.__qualname__} base class's is a stub); define {member} in "
                              f"{target.__qualname__}")
    _check_keywords(target, node, path)
    return target


def _tensorboard_writer() -> Callable[..., Any]:
    """The ``SummaryWriter`` Lightning's ``TensorBoardLogger`` hands its extra keywords to."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # lazy: needs the tensorboard package
    except ImportError:
        from tensorboardX import SummaryWriter  # lazy: Lightning's other writer
    return SummaryWriter


_KEYWORDS_PASSED_ON: dict[str, Callable[[], Callable[..., Any]]] = {
    "lightning.pytorch.loggers.wandb.WandbLogger": lambda: importlib.import_module("wandb").init,
    "lightning.pytorch.loggers.tensorboard.TensorBoardLogger": _tensorboard_writer,
    "lightning.pytorch.strategies.ddp.DDPStrategy":
        lambda: importlib.import_module("torch.nn.parallel").DistributedDataParallel.__init__,
}
"""Targets whose ``**kwargs`` go on to another call (a logger's writer, DDP's module wrapper), checked against that
call's arguments."""


def _parameters(target: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    parameters = {name: parameter for name, parameter in inspect.signature(target).parameters.items()
                  if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.POSITIONAL_ONLY)}
    onward = _KEYWORDS_PASSED_ON.get(f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}")
    if onward is not None and any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters.values()):
        try:
            receiver = onward()
        except ImportError:
            return parameters  # the target itself will say what is missing
        passed_on = {name: parameter.replace(default=None) if parameter.default is parameter.empty else parameter
                     for name, parameter in _parameters(receiver).items() if name not in ("self", "cls")}
        parameters = {name: parameter for name, parameter in parameters.items()
                      if parameter.kind is not parameter.VAR_KEYWORD}
        parameters.update({name: parameter for name, parameter in passed_on.items() if name not in parameters})
    return parameters


def refuse_unknown_keywords(target: Any, keys: Iterable[str], path: str) -> None:
    """Refuse a key of ``keys`` that ``target``'s constructor does not take (one taking ``**kwargs`` takes any; the
    loggers of :data:`_KEYWORDS_PASSED_ON`, what their ``**kwargs`` go to), naming the closest it takes."""
    parameters = _parameters(target)
    if any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters.values()):
        return
    for key in keys:
        if key not in parameters:
            close = difflib.get_close_matches(key, list(parameters), n=1)
            hint = f"did you mean {path}.{close[0]}?" if close else f"it takes {', '.join(parameters) or 'none'}"
            raise ConfigError(f"{path}.{key}: {target.__qualname__} takes no argument {key!r}; {hint}")


def _check_keywords(target: type, node: Mapping[str, Any], path: str) -> None:
    """Refuse keys ``target``'s constructor does not take (or the call its ``**kwargs`` go to, for the loggers of
    :data:`_KEYWORDS_PASSED_ON`), and required arguments ``node`` leaves out."""
    parameters = _parameters(target)
    given = [key for key in node if key not in RESERVED_KEYS]
    refuse_unknown_keywords(target, given, path)
    for name, parameter in parameters.items():
        if parameter.default is parameter.empty and parameter.kind is not parameter.VAR_KEYWORD and name not in given:
            raise ConfigError(f"{path}: {target.__qualname__} needs the argument {name!r}; add {path}.{name}=...")


def instantiate_checked(node: Mapping[str, Any], path: str, base: type, required: tuple[str, ...] = ()) -> Any:
    """``node``'s target made with ``node``'s keywords, after :func:`target_class` has checked them (and the
    ``required`` members)."""
    from hydra.utils import instantiate

    target_class(node, path, base, required)
    return instantiate(dict(node), _convert_="all")
