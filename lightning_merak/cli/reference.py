"""``merak-train``'s reference, generated from the schemas: ``docs/reference/cli.md`` and ``--help``'s descriptions.

    python -m lightning_merak.cli.reference           # write docs/reference/cli.md
    python -m lightning_merak.cli.reference --check   # exit 1 if the file is stale (a test runs it)

Every option of every config group is composed as ``merak-train <group>=<option>`` composes it; each key shows
its type, its default under that option and its description. The descriptions are the fields' ``metadata["help"]``
in the schema dataclasses (:mod:`lightning_merak.util.fields`) — ``strategy=merak3d``'s come from
:class:`~lightning_merak.strategies.merak3d.options.Merak3DOptions` — searched along the schema's bases, so an
option that redefines a default keeps its base's description. An option's own description is the comment that
opens its YAML file (or its schema's docstring).

``merak-train --help`` prints the composed configuration with the first sentence of each description, through the
``merak.help_groups`` and ``merak.help_config`` resolvers that ``hydra.help.template`` (``conf/config.yaml``)
calls; they list the config groups without Hydra's ``schema/*`` entries. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import yaml
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from lightning_merak.cli.config import GROUPS, register_configs
from lightning_merak.cli.options.schema import DECLARED_TYPE
from lightning_merak.util.fields import HELP, summary

__all__ = ["REFERENCE", "Key", "help_config", "help_groups", "keys_of", "main", "register_help", "render"]

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"
"""The generated page, in a checkout of the repository."""

_COMMAND = "python -m lightning_merak.cli.reference"
_HELP_WIDTH = 118
_HELP_COMMENT_COLUMN = 36


@dataclass(frozen=True)
class Key:
    """One key of a composed option: its dotted path, type, default there and description."""

    path: str
    type: str
    default: str
    help: str


def _metadata(schema: Optional[type], name: str, key: str) -> Any:
    """``metadata[key]`` of ``schema``'s field ``name``, from the first class along its bases that sets it."""
    for klass in getattr(schema, "__mro__", ()):
        item = getattr(klass, "__dataclass_fields__", {}).get(name)
        if item is not None and key in item.metadata:
            return item.metadata[key]
    return None


def _description(schema: Optional[type], name: str) -> str:
    return str(_metadata(schema, name, HELP) or "")


def _type_text(annotation: Any) -> str:
    """A type as a user writes its values: ``int | auto``, ``bool | null``, ``[float, float, float]``."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if origin is typing.Literal:
        return " | ".join(str(argument) for argument in arguments)
    if origin in (typing.Union, types.UnionType):
        ordered = [argument for argument in arguments if argument is not type(None)]
        ordered += [type(None)] if len(ordered) < len(arguments) else []
        return " | ".join(_type_text(argument) for argument in ordered)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(str(member.value) for member in annotation)
    if origin is tuple:
        return "[" + ", ".join(_type_text(argument) for argument in arguments) + "]"
    if origin is list:
        return f"list[{_type_text(arguments[0])}]" if arguments else "list"
    if origin is dict or annotation is dict:
        return "dict"
    if dataclasses.is_dataclass(annotation):
        return "node"
    return getattr(annotation, "__name__", str(annotation))


def _field_type(schema: Optional[type], name: str) -> str:
    declared = _metadata(schema, name, DECLARED_TYPE)
    if declared is not None:
        return _type_text(declared)
    if schema is None or not dataclasses.is_dataclass(schema):
        return "any"
    hints = typing.get_type_hints(schema)
    return _type_text(hints.get(name, Any))


def _inline(value: Any) -> str:
    """``value`` as YAML on one line (``null``, ``auto``, ``'1'``, ``[a, b]``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, allow_unicode=True).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _plain(node: Any) -> Any:
    """A node's value without resolving interpolations (``???`` where it is missing)."""
    if isinstance(node, DictConfig) or OmegaConf.is_list(node):
        return OmegaConf.to_container(node, resolve=False, throw_on_missing=False, enum_to_str=True)
    value = node._value()
    return value.name if isinstance(value, enum.Enum) else value


def _children(node: DictConfig) -> Iterator[tuple[str, Any]]:
    for key in node.keys():
        yield str(key), node._get_node(key)


def _is_section(child: Any) -> bool:
    """A nested node listed key by key (a free-form dict with entries, or a typed node)."""
    return (isinstance(child, DictConfig) and not child._is_missing() and not child._is_none()
            and (len(child) > 0 or dataclasses.is_dataclass(OmegaConf.get_type(child))))


def keys_of(node: DictConfig, prefix: str = "") -> list[Key]:
    """Every key under ``node`` (typed nodes flattened, free-form dicts shown whole), with ``prefix`` in its path."""
    schema = OmegaConf.get_type(node)
    keys = []
    for name, child in _children(node):
        typed = isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child))
        if typed and _is_section(child):
            keys += keys_of(child, f"{prefix}{name}.")
            continue
        keys.append(Key(f"{prefix}{name}", _field_type(schema, name), _inline(_plain(child)),
                        _description(schema, name)))
    return keys


# merak-train --help --------------------------------------------------------------------------------------------

def _escape(text: str) -> str:
    """Hydra fills ``hydra.help.template`` in with ``string.Template`` after OmegaConf resolved it."""
    return text.replace("$", "$$")


def _comment_lines(line: str, comment: str, column: int) -> list[str]:
    if not comment:
        return [line]
    start = max(column, len(line) + 2)
    wrapped = textwrap.wrap(comment, max(40, _HELP_WIDTH - start - 2), break_on_hyphens=False) or [""]
    return [f"{line.ljust(start)}# {wrapped[0]}", *[f"{' ' * start}# {more}" for more in wrapped[1:]]]


def _help_lines(node: DictConfig, indent: str = "") -> list[str]:
    schema = OmegaConf.get_type(node)
    lines = []
    for name, child in _children(node):
        if not indent and name == "hydra":
            continue
        comment = summary(_description(schema, name))
        if _is_section(child) and len(child) > 0:
            lines += _comment_lines(f"{indent}{name}:", comment, _HELP_COMMENT_COLUMN)
            lines += _help_lines(child, indent + "  ")
        else:
            lines += _comment_lines(f"{indent}{name}: {_inline(_plain(child))}", comment, _HELP_COMMENT_COLUMN)
    return lines


def help_config(*, _root_: DictConfig) -> str:
    """The composed configuration as YAML, each key followed by the first sentence of its description."""
    return _escape("\n".join(_help_lines(_root_)))


def _group_options() -> dict[str, list[str]]:
    """Hydra's config groups (not ``hydra/*`` or ``schema/*``) and their options, the project's groups first."""
    loader = GlobalHydra.instance().config_loader()
    groups = [group for group in loader.list_groups("") if group not in ("hydra", "schema")]
    ordered = [group for group in GROUPS if group in groups] + sorted(set(groups) - set(GROUPS))
    return {group: sorted(loader.get_group_options(group)) for group in ordered}


def _chosen(root: DictConfig, group: str) -> list[str]:
    """The options of ``group`` composed now: Hydra records one choice per group; a list of them (``logger=[csv,
    wandb]``) it does not, and each such option keeps its keys under its own name."""
    choice = root.hydra.runtime.choices.get(group)
    if choice is not None:
        return [choice]
    node = root.get(group)
    return [str(key) for key in node.keys()] if isinstance(node, DictConfig) else []


def help_groups(*, _root_: DictConfig) -> str:
    """``group: option, [chosen], option`` for every config group."""
    lines = []
    for group, options in _group_options().items():
        chosen = _chosen(_root_, group)
        lines.append(f"{group}: " + ", ".join(f"[{option}]" if option in chosen else option for option in options))
    return _escape("\n".join(lines))


def register_help() -> None:
    """Register the resolvers ``hydra.help.template`` calls (idempotent)."""
    for name, resolver in (("merak.help_groups", help_groups), ("merak.help_config", help_config)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


# docs/reference/cli.md -------------------------------------------------------------------------------------------

def _markdown(text: str) -> str:
    """A docstring's reStructuredText roles and literals as Markdown."""
    text = re.sub(r":\w+:`~?([^`]+)`", lambda match: f"`{match.group(1)}`", text)
    return text.replace("``", "`")


def _option_text(group: str, option: str, schema: Optional[type]) -> str:
    """What an option is: the comment opening its YAML file (indented lines as a code block), else its docstring."""
    comments = []
    source = resources.files("lightning_merak.conf").joinpath(group, f"{option}.yaml").read_text()
    for line in source.splitlines():
        if not line.startswith("#"):
            break
        comments.append(line[1:].removeprefix(" "))
    if not comments:
        doc = (schema.__doc__ or "") if schema is not None else ""
        return _markdown(" ".join(doc.split("\n\n")[0].split()))
    blocks: list[tuple[bool, list[str]]] = []  # (is code, lines), in the comment's order
    for line in comments:
        code = line.startswith("  ")
        if not blocks or blocks[-1][0] != code:
            blocks.append((code, []))
        blocks[-1][1].append(line.strip())
    return "\n\n".join("```bash\n" + "\n".join(lines) + "\n```" if code else " ".join(lines)
                       for code, lines in blocks)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(keys: Sequence[Key]) -> list[str]:
    rows = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    rows += [f"| `{key.path}` | {_cell(key.type)} | `{_cell(key.default)}` | {_cell(key.help)} |" for key in keys]
    return rows


def _compose(*overrides: str, hydra: bool = False) -> DictConfig:
    return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)


def _options(group: str) -> list[str]:
    folder = resources.files("lightning_merak.conf").joinpath(group)
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def render() -> str:
    """The Markdown of ``docs/reference/cli.md``."""
    register_configs()
    lines = [
        "# `merak-train` configuration reference",
        "",
        f"<!-- Generated by `{_COMMAND}` from the config schemas; edit the descriptions there (each field's "
        "`metadata[\"help\"]`, `lightning_merak.util.fields`) and the YAML files' opening comments, then "
        f"rerun it. `{_COMMAND} --check` fails when this file is stale. -->",
        "",
        "`merak-train group=option key=value ...` composes its configuration with Hydra: each config group below "
        "has options (YAML files in `lightning_merak/conf/<group>/` over typed schemas, so a misspelled key or a "
        "value of the wrong type fails before anything starts). Each option's table lists its keys with their "
        "type, their default under that option and what they do. `merak-train --help` shows the composed "
        "configuration with the first sentence of each description; `merak-train ... --cfg job` prints it.",
        "",
        "Your own pieces come in by `_target_`: `module._target_=pkg.MyModule` trains your LightningModule instead "
        "of the causal LM of `model` and `optim`, `data._target_=pkg.MyData` your LightningDataModule (which, with "
        "the built-in module, gives the model its `vocab_size`), each made with the keys beside `_target_` as "
        "keyword arguments (`module.width=256`); `callbacks=[{_target_: ..., ...}]` adds callbacks and "
        "`logger=[csv,wandb]` picks several loggers (`logger=[]`: none). Any other `lightning.Trainer` argument is "
        "taken as `trainer.<name>=value` (`trainer.fast_dev_run=true`, `trainer.limit_train_batches=5`). All of it is "
        "checked before anything starts: a misspelled key, option or keyword argument, a target that does not "
        "import or is not a LightningModule / LightningDataModule, and what the strategy needs of your module are "
        "refused with the fix (\"did you mean ...?\") as the first line, without a traceback, exit status 2.",
        "",
    ]
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        root = _compose(hydra=True)
        root_schema = OmegaConf.get_type(root)
        defaults = {group: _chosen(root, group) for group in GROUPS}
        lines += ["## Groups", "", "| Group | Options | Default | Description |", "|---|---|---|---|"]
        lines += [f"| [`{group}`](#{group}) | {', '.join(f'`{option}`' for option in _options(group))} | "
                  f"{', '.join(f'`{option}`' for option in defaults[group])} | "
                  f"{_cell(_description(root_schema, group))} |" for group in GROUPS]
        lines += ["", "## Top-level keys", "",
                  *_table([key for key in keys_of(root) if key.path.split(".")[0] not in (*GROUPS, "hydra")]), ""]
        for group in GROUPS:
            lines += [f"## {group}", "", _description(root_schema, group), ""]
            for option in _options(group):
                # the default option's node is the one just composed; another option is composed as chosen
                node = root[group] if defaults[group] == [option] else _compose(f"{group}={option}")[group]
                default = " (default)" if option in defaults[group] else ""
                lines += [f"### `{group}={option}`{default}", "",
                          _option_text(group, option, OmegaConf.get_type(node)), "",
                          *_table(keys_of(node, f"{group}.")), ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=_COMMAND, description="Render merak-train's configuration reference.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be written")
    parser.add_argument("--output", type=Path, default=REFERENCE, help=f"the page (default: {REFERENCE})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run `{_COMMAND}` and commit the result", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
