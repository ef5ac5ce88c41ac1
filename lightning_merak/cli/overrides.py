"""``merak-train``'s command line checked against the schemas before Hydra composes it, so the first message a
misspelled key or option gets is the fix.

Hydra answers ``trainer.max_step=5`` with "Could not override ... To append to your config use +" (wrong: the key
is misspelled) and ``model=lama`` with the list of options. :func:`check_overrides` reads every override first: a
key no schema declares gets "did you mean ...?" and a group option the closest option; a key a schema does not
declare but a free-form node takes (``model.config.*``, ``module.*``, the keys of a ``_target_`` node) is added
(Hydra's ``+``) without the user writing it; ``trainer.<any Trainer argument>`` goes to ``trainer.kwargs``;
``data._target_=...`` alone selects ``data=custom``; a path Hydra's grammar cannot read unquoted
(``resume=.../step=10.ckpt``, a checkpoint name merak-train writes) is quoted for it. It returns the overrides
Hydra should compose, which the ranks started early receive again (checking them twice changes nothing). Nothing
here imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import typing
from importlib import resources
from typing import Any, Optional

from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ["MOVED_KEYS", "ConfigError", "check_overrides", "trainer_arguments"]

MOVED_KEYS = {"trainer.learning_rate": "optim.learning_rate", "trainer.weight_decay": "optim.weight_decay",
              "trainer.warmup_steps": "optim.warmup_steps"}
"""Keys that moved, and where to: the optimizer's settings left ``trainer`` for the ``optim`` group."""

SET_BY_MERAK_TRAIN = {"strategy": "strategy=...", "logger": "logger=...", "callbacks": "callbacks=[...]",
                      "plugins": "nothing (merak-train sets its checkpoint IO)", "profiler": "profiler=...",
                      "default_root_dir": "output_dir=...",
                      "check_val_every_n_epoch": "trainer.val_check_interval (null: validate once per epoch)"}
"""``Trainer`` arguments ``merak-train`` sets itself, and the override that sets them instead."""


PATH_KEY_ENDINGS = ("resume", "path", "dir")
"""How the keys whose values are paths end (``resume``, ``data.path``, ``hydra.run.dir``): a value of theirs that
Hydra's grammar cannot read unquoted (the ``=`` of ``step=10.ckpt``, a bracket) is quoted for it."""


class ConfigError(ValueError):
    """A command line ``merak-train`` refuses before composing it; the message names the fix."""


def _typo_distance(first: str, second: str) -> int:
    """Edits from one word to the other, a swap of two neighbouring letters counting as one (the common typo)."""
    previous2: list[int] = []
    previous = list(range(len(second) + 1))
    for i, letter in enumerate(first, 1):
        current = [i]
        for j, other in enumerate(second, 1):
            cost = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (letter != other))
            if i > 1 and j > 1 and letter == second[j - 2] and first[i - 2] == other:
                cost = min(cost, previous2[j - 2] + 1)
            current.append(cost)
        previous2, previous = previous, current
    return previous[-1]


def _closest(word: str, candidates: typing.Iterable[str]) -> Optional[str]:
    """The candidate ``word`` most likely misspells: one or two edits away (fewest first, then the same length, as
    a swap of letters keeps it), else difflib's closest."""
    candidates = list(candidates)
    near = [(distance, abs(len(name) - len(word)), index) for index, name in enumerate(candidates)
            if (distance := _typo_distance(word, name)) <= min(2, len(word) // 2)]
    if near:
        return candidates[min(near)[2]]
    matches = difflib.get_close_matches(word, candidates, n=1)
    return matches[0] if matches else None


def _group_options() -> dict[str, list[str]]:
    """Each config group of ``lightning_merak/conf`` and its options (the YAML files' names)."""
    root = resources.files("lightning_merak.conf")
    return {entry.name: sorted(file.name.removesuffix(".yaml") for file in entry.iterdir()
                               if file.name.endswith(".yaml"))
            for entry in root.iterdir() if entry.is_dir() and not entry.name.startswith("_")}


def trainer_arguments() -> list[str]:
    """The keyword arguments of ``lightning.pytorch.Trainer``."""
    import inspect

    from lightning.pytorch import Trainer  # lazy: only for a trainer key no schema field declares

    return [name for name in inspect.signature(Trainer.__init__).parameters if name != "self"]


def _check_option(group: str, value: Any, options: dict[str, list[str]]) -> None:
    for choice in value if isinstance(value, list) else [value]:
        if choice is None or choice in options[group]:
            continue
        close = _closest(str(choice), options[group])
        hint = f"did you mean {group}={close}? " if close else ""
        raise ConfigError(f"{group}={choice} is not an option of {group}; {hint}Options: {', '.join(options[group])}")


def _value_text(override: Override) -> str:
    return override.input_line.split("=", 1)[1]


def _enum_problem(schema: type, name: str, value: Any) -> Optional[str]:
    """Why ``value`` is no member of the enum that ``schema.name`` is typed with, if it is one and ``value`` is not."""
    kind = typing.get_type_hints(schema).get(name)
    if not (isinstance(kind, type) and issubclass(kind, enum.Enum)) or not isinstance(value, str):
        return None
    members = [member.name for member in kind]
    if value in members:
        return None
    close = _closest(value, members)
    return (f"{value!r} is not one of {', '.join(members)}" + (f"; did you mean {close}?" if close else ""))


def _unknown_key(path: str, parent: DictConfig, key: str) -> ConfigError:
    """The refusal of ``path``, whose last part ``key`` the typed node ``parent`` does not declare."""
    if path in MOVED_KEYS:
        return ConfigError(f"{path} moved to {MOVED_KEYS[path]} (the optimizer has its own group: "
                           f"optim=adamw|sgd|muon); write {MOVED_KEYS[path]}=... instead")
    known = [item.name for item in dataclasses.fields(OmegaConf.get_type(parent))]
    prefix = path[: len(path) - len(key)]
    candidates = known + (trainer_arguments() if prefix == "trainer." else [])
    close = _closest(key, candidates)
    hint = f"did you mean {prefix}{close}?" if close else f"known keys: {', '.join(known)}"
    return ConfigError(f"{path} is not a key of {prefix.rstrip('.') or 'the configuration'}; {hint}")


def _normalised(override: Override, config: DictConfig) -> str:
    """``override`` as Hydra should get it: unchanged for a key that exists, added (``+``) in a free-form node (a
    dict value merged into one, new keys included), moved to ``trainer.kwargs`` for a Trainer argument; a key no
    schema declares is refused."""
    path = override.key_or_group
    node: Any = config
    parts = path.split(".")
    for depth, key in enumerate(parts):
        if not isinstance(node, DictConfig) or node._is_missing() or node._is_none():
            return override.input_line  # inside a list or an unset node: Hydra's own checks apply
        schema = OmegaConf.get_type(node)
        typed = schema is not None and dataclasses.is_dataclass(schema)
        if key not in node:
            if typed and path.startswith("trainer.") and depth == 1 and path not in MOVED_KEYS:
                if key in SET_BY_MERAK_TRAIN:
                    raise ConfigError(f"{path}: merak-train sets Trainer's {key} itself; use "
                                      f"{SET_BY_MERAK_TRAIN[key]}")
                if key in trainer_arguments():
                    return f"+trainer.kwargs.{'.'.join(parts[1:])}={_value_text(override)}"
            if typed:
                raise _unknown_key(".".join(parts[: depth + 1]), node, key)
            return f"+{path}={_value_text(override)}"
        if typed and depth == len(parts) - 1:
            problem = _enum_problem(schema, key, override.value())
            if problem is not None:
                raise ConfigError(f"{path}={_value_text(override)}: {problem}")
        node = node._get_node(key)
    if _is_free_form(node) and isinstance(override.value(), dict):
        return f"++{path}={_value_text(override)}"  # merged in, new keys included (Hydra's struct mode refuses them)
    return f"{path}={_value_text(override)}"


def _is_free_form(node: Any) -> bool:
    """Whether ``node`` is a dict of any keys (``model.config``), not a schema's dataclass."""
    return isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict


def _compose(overrides: list[str]) -> DictConfig:
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _quoted_path(argument: str, parser: OverridesParser) -> str:
    """``argument`` with its value quoted if it is a path Hydra's grammar cannot read unquoted (a path merak-train
    names itself, ``resume=<run>/checkpoints/step=10.ckpt``, would otherwise get "mismatched input '='")."""
    key, separator, value = argument.partition("=")
    if not separator or argument.startswith("-") or not key.rsplit(".", 1)[-1].endswith(PATH_KEY_ENDINGS):
        return argument
    try:
        parser.parse_override(argument)
        return argument
    except HydraException:
        quote = next((mark for mark in ("'", '"') if mark not in value), None)
        return argument if quote is None else f"{key}={quote}{value}{quote}"


def _unreadable(overrides: list[str], parser: OverridesParser, error: HydraException) -> str:
    """Why Hydra's grammar cannot read the first of ``overrides`` it refuses, naming it and the quoting."""
    for override in overrides:
        try:
            parser.parse_override(override)
        except HydraException as own:
            key, _, value = override.partition("=")
            reason = str(own).strip().split("\n")[0]
            return (f"{override}: {reason}; a value holding characters of Hydra's grammar (= [ ] {{ }} ( ) # , "
                    f"a quote) goes in quotes: \"{key}='{value}'\" (Hydra's override grammar)")
    return str(error).strip()


def check_overrides(arguments: list[str]) -> list[str]:
    """``arguments`` (``merak-train``'s, flags included) with each override checked and put as Hydra takes it.

    Raises :class:`ConfigError` naming the fix for a misspelled key, group option or enum value, a moved key, or
    an override Hydra cannot compose."""
    from hydra._internal.utils import get_args_parser  # Hydra's own command line, so flags parse as it parses them

    parser = OverridesParser.create()
    arguments = [_quoted_path(argument, parser) for argument in arguments]
    command = get_args_parser().parse_args(arguments)
    if command.config_dir or command.config_name or command.config_path:
        return arguments  # another primary config or search path: only Hydra knows what it declares
    overrides = command.overrides
    try:
        parsed = parser.parse_overrides(overrides)
    except HydraException as error:
        raise ConfigError(_unreadable(overrides, parser, error)) from None
    options = _group_options()
    groups = [override for override in parsed if override.key_or_group in options]
    for override in groups:
        if not override.is_delete() and not override.is_sweep_override():
            _check_option(override.key_or_group, override.value(), options)
    chosen = {override.key_or_group for override in groups}
    lines = ["data=custom"] if "data" not in chosen and any(
        override.key_or_group == "data._target_" for override in parsed) else []
    lines += [override.input_line for override in groups]
    config = _compose(lines)
    for override in parsed:
        first = override.key_or_group.split(".")[0]
        if override.key_or_group in options:
            continue
        if first.split("/")[0] == "hydra" or override.type is OverrideType.DEL or override.is_sweep_override():
            lines.append(override.input_line)
        elif first not in config:
            close = _closest(first, list(config.keys()))
            raise ConfigError(f"{override.key_or_group} is not a key of merak-train's configuration"
                              + (f"; did you mean {close}?" if close else ""))
        else:
            lines.append(_normalised(override, config))
    if not any(override.is_sweep_override() for override in parsed):
        try:
            _compose([line for line in lines if not line.startswith(("hydra.", "hydra/"))])
        except (HydraException, OmegaConfBaseException) as error:
            reason, cause = str(error).strip().split("\n")[0], str(error.__cause__ or "").strip().split("\n")[0]
            raise ConfigError(f"{reason}: {cause}" if cause else reason) from None
    flags, remaining = [], list(overrides)
    for argument in arguments:
        if argument in remaining:
            remaining.remove(argument)
        else:
            flags.append(argument)
    return flags + lines
