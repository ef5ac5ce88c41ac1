"""The package's architecture, checked from its source: layers, cycles, lazy exports, probes, file sizes.

Fast and process-free apart from one ``lint-imports`` run: the rest reads the source (``ast``) or grimp's import
graph, which counts imports inside functions and under ``TYPE_CHECKING`` too. The layers, top to bottom, are
``[tool.importlinter]``'s in ``pyproject.toml`` (docs/architecture.md); each folder imports only those below it.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Iterator, Optional

import grimp
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_merak"
SOURCE = ROOT / PACKAGE
MAX_LINES = 600
LAZY_MARK = "# lazy:"


@cache
def _layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    return next(contract["layers"] for contract in contracts if contract["type"] == "layers")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _sources() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {_module_name(path): path for path in sorted(SOURCE.rglob("*.py"))}


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_sources()[module].read_text(), filename=str(_sources()[module]))


def _where(module: str, line: int) -> str:
    return f"{_sources()[module].relative_to(ROOT)}:{line}"


def _layer_of(module: str) -> Optional[str]:
    """The layer folder ``module`` lives in; None for the package's own top-level modules (above every layer)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in _layers() else None


def _may_import(importer: str, imported: str) -> bool:
    """Whether ``importer``'s layer may import ``imported``: the same folder or a lower layer."""
    top, target = _layer_of(importer), _layer_of(imported)
    if top is None:
        return True
    return target is not None and (target == top or _layers().index(target) > _layers().index(top))


def _top_level_names(module: str) -> set[str]:
    """Names ``module`` binds at its top level (definitions, assignments, imports), whatever the branch."""
    names: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for statement in statements:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(statement.name)
            elif isinstance(statement, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).split(".")[0] for alias in statement.names)
            elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                names.update(node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name))
            for field in ("body", "orelse", "finalbody", "handlers"):  # if / try / with / for at the top level
                if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(getattr(statement, field, []))

    visit(_tree(module).body)
    return names


# Layers and cycles --------------------------------------------------------------------------------------------


def test_lint_imports_keeps_the_layers():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    if not lint_imports.exists():
        pytest.skip(f"{lint_imports} is not installed (pip install import-linter)")
    result = subprocess.run([str(lint_imports)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        "lint-imports: a folder imports a folder above it (layers in pyproject.toml [tool.importlinter]); move the "
        "shared piece down a layer, or let the higher side declare what it needs through protocols/.\n"
        + result.stdout[-6000:] + result.stderr[-2000:]
    )


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges.get(successor, ())))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_modules():
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    edges = {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}
    problems = []
    for component in _cycles(edges):
        lines = []
        for importer in component:
            for imported in sorted(edges[importer] & set(component)):
                for detail in graph.get_import_details(importer=importer, imported=imported):
                    lines.append(f"  {_where(importer, detail['line_number'])}: {detail['line_contents']}")
        problems.append(f"cycle between {', '.join(component)}:\n" + "\n".join(lines))
    assert not problems, (
        "modules import each other (imports inside functions and under TYPE_CHECKING count): move what both need "
        "into one module they both import, or have the lower one declare a Protocol the higher one satisfies.\n"
        + "\n".join(problems)
    )


# Lazy exports -------------------------------------------------------------------------------------------------


def _constant(module: str, node: ast.expr) -> object:
    """The value of ``node`` from literals and the module's top-level assignments of literals."""
    if isinstance(node, ast.Name):
        for statement in _tree(module).body:
            if isinstance(statement, ast.Assign) and any(
                    isinstance(target, ast.Name) and target.id == node.id for target in statement.targets):
                return _constant(module, statement.value)
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and statement.target.id == node.id and statement.value is not None):
                return _constant(module, statement.value)
        raise ValueError(f"{node.id} is not a top-level literal of {module}")
    if isinstance(node, ast.Dict):
        return {_constant(module, key): _constant(module, value) for key, value in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _lazy_exports() -> Iterator[tuple[str, int, str, str]]:
    """``(module, line, exported name, target module)`` of every ``lazy_attributes(package, exports)`` call."""
    for module in _sources():
        for node in ast.walk(_tree(module)):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                    == "lazy_attributes"):
                continue
            package_node = node.args[0] if node.args else None
            exports_node = node.args[1] if len(node.args) > 1 else next(
                (keyword.value for keyword in node.keywords if keyword.arg == "exports"), None)
            if exports_node is None or package_node is None:
                continue
            package = module if isinstance(package_node, ast.Name) and package_node.id == "__name__" else (
                _constant(module, package_node))
            for name, target in _constant(module, exports_node).items():
                yield module, node.lineno, name, importlib.util.resolve_name(target, package)


def _strategy_exports() -> Iterator[tuple[str, int, str, str]]:
    module = f"{PACKAGE}.strategies"
    from lightning_merak.strategies import STRATEGIES

    for entry in STRATEGIES:
        if isinstance(entry.strategy, str):
            target, _, name = entry.strategy.partition(":")
            line = next((node.lineno for node in ast.walk(_tree(module))
                         if isinstance(node, ast.Constant) and node.value == entry.strategy), 1)
            yield module, line, name, target


def test_lazy_exports_name_a_module_of_the_same_or_a_lower_layer():
    exports = [*_lazy_exports(), *_strategy_exports()]
    assert len(exports) > 10, "found too few lazy exports: has lazy_attributes been renamed?"
    lazy_names: dict[str, set[str]] = {}  # a package may export a name its subpackage exports lazily in turn
    for module, _, name, _ in exports:
        lazy_names.setdefault(module, set()).add(name)
    problems = []
    for module, line, name, target in exports:
        where = f"{_where(module, line)}: {name!r} -> {target!r}"
        if target not in _sources():
            problems.append(f"{where}: no such module (fix the path: it raises only when {name} is first used)")
        elif not _may_import(module, target):
            problems.append(f"{where}: {_layer_of(target) or 'the package top'} is above {_layer_of(module)} in "
                            "pyproject.toml's layers; export it from that layer instead")
        elif name not in _top_level_names(target) | lazy_names.get(target, set()):
            problems.append(f"{where}: {target} defines no {name} (fix the export or the module)")
    assert not problems, "lazy exports that would fail or point up the layers:\n" + "\n".join(problems)


# Probes -------------------------------------------------------------------------------------------------------


def _names_our_module(node: ast.expr) -> bool:
    """Whether ``node`` spells a module name of the package (a literal, or one built from ``__name__`` or
    ``__package__``)."""
    for child in ast.walk(node):
        if isinstance(child, ast.Constant) and isinstance(child.value, str) and child.value.startswith(PACKAGE):
            return True
        if isinstance(child, ast.Name) and child.id in ("__name__", "__package__"):
            return True
    return False


def _is_sys_modules(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def test_no_sys_modules_lookup_of_the_packages_own_modules():
    problems = []
    for module in _sources():
        for node in ast.walk(_tree(module)):
            key = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_modules(node.func.value):
                key = node.args[0] if node.args else None  # sys.modules.get(...), .pop(...), .__contains__(...)
            elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value):
                key = node.slice
            elif (isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
                  and any(_is_sys_modules(right) for right in node.comparators)):
                key = node.left
            if key is not None and _names_our_module(key):
                problems.append(f"{_where(module, node.lineno)}: {ast.unparse(node)}")
    assert not problems, (
        "sys.modules probes of the package's own modules: import the module, or (to stay clear of a heavy optional "
        "dependency it imports) have what you look for declare itself through a runtime-checkable Protocol in "
        "lightning_merak/protocols/ (e.g. protocols.experts.ExpertParallelLayer) and check isinstance.\n"
        + "\n".join(problems)
    )


# Sizes and lazy imports ---------------------------------------------------------------------------------------


def test_no_file_is_longer_than_the_limit():
    problems = [f"{path.relative_to(ROOT)}: {count} lines" for path in _sources().values()
                if (count := len(path.read_text().splitlines())) > MAX_LINES]
    assert not problems, (
        f"files over {MAX_LINES} lines: split each by concern into modules of its folder (the folder's layer "
        "stays the same).\n" + "\n".join(problems)
    )


def _imports_in_functions(module: str) -> Iterator[tuple[ast.stmt, str]]:
    """Each import of a module of the package inside a function of ``module``, with the module it names."""
    package = module if _sources()[module].name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.stmt, str]]:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.ImportFrom):
                target = ("." * child.level + (child.module or "")) if child.level else (child.module or "")
                resolved = importlib.util.resolve_name(target, package) if child.level else target
                if resolved.split(".")[0] == PACKAGE:
                    yield child, resolved
            elif in_function and isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == PACKAGE:
                        yield child, alias.name
                        break
            yield from visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    yield from visit(_tree(module), False)


def test_imports_inside_functions_say_what_they_defer():
    problems = []
    for module in _sources():
        lines = _sources()[module].read_text().splitlines()
        for node, imported in _imports_in_functions(module):
            statement = lines[node.lineno - 1:node.end_lineno]
            if not any(LAZY_MARK in line for line in statement):
                problems.append(f"{_where(module, node.lineno)} ({imported}): {lines[node.lineno - 1].strip()}")
    assert not problems, (
        "imports of the package's modules inside functions: move each to the top of its module, or, where the "
        "imported module pulls in a heavy optional dependency at import time (torch from cli/, DeepSpeed, PEFT, "
        f"transformers, bitsandbytes, ...), keep it and end its first line with '{LAZY_MARK} <what it defers>'.\n"
        + "\n".join(problems)
    )
