"""The package's layout holds: imports point one way along the data path, each error type has one import path, and
every module docstring is short.

The order of the stages is the numbered list in the package docstring (``dflash2_lightning/__init__.py``); a
stage may import itself and the stages listed before it, never one listed after it. Every import counts:
module-level, function-local and ``TYPE_CHECKING`` ones alike (a function-local import is a dependency that
waits; it still ties the two stages together). Each failure names the file and line of the import.
"""

from __future__ import annotations

import ast
import builtins
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import dflash2_lightning

PACKAGE = Path(dflash2_lightning.__file__).parent
ROOT = PACKAGE.parent
NAME = PACKAGE.name
#: the modules of the top stage ``cli`` that live beside the core modules
CLI_MODULES = {"cli", "__main__"}
#: other trees whose imports of the package must use the error types' one import path
USERS = ("tests", "benchmarks", "tools", "export")
#: the most lines a module docstring may have: what the module is for, its contract and why; the rest is in docs/
DOCSTRING_LINES = 20
#: the two modules allowed a longer one: the stage list these tests parse, and the objective's step diagram
LONG_DOCSTRINGS = {NAME, f"{NAME}.train.objective"}


def stages() -> list[str]:
    """The stages in order, as the package docstring lists them (``N. name  ...`` lines)."""
    names = re.findall(r"^\s*\d+\.\s+(\w+)\b", dflash2_lightning.__doc__ or "", flags=re.MULTILINE)
    assert names, "the package docstring lists no stages (`1. core ...` lines)"
    return names


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def stage_of(module: str) -> str:
    """``dflash2_lightning.train.module`` -> ``train``; a module beside the stages is ``core`` (``cli`` for
    :data:`CLI_MODULES`)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "core"
    if (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "cli" if parts[1] in CLI_MODULES else "core"


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import of the package in ``path``, wherever it stands; ``module`` is the
    module imported (a submodule named in ``from pkg import sub`` counts as that submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    here = module_name(path) if path.is_relative_to(PACKAGE) else ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == NAME:
                    yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                parts = here.split(".") if path.name == "__init__.py" else here.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if base.split(".")[0] != NAME:
                continue
            names = [a.name for a in node.names]
            submodules = [f"{base}.{n}" for n in names if is_module(f"{base}.{n}")]
            for sub in submodules:
                yield node.lineno, sub, []
            if len(submodules) < len(names):
                yield node.lineno, base, [n for n in names if not is_module(f"{base}.{n}")]


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_docstring_lists_every_stage_once() -> None:
    order = stages()
    found = {stage_of(module_name(p)) for p in package_files()}
    assert len(order) == len(set(order)), f"a stage is listed twice: {order}"
    assert set(order) == found, (
        f"the package docstring's stages {order} are not the package's "
        f"{sorted(found)}: list every stage (and only those) in order"
    )


def test_imports_point_one_way() -> None:
    """No stage imports a stage after it (function-local imports included)."""
    rank = {name: i for i, name in enumerate(stages())}
    upward = []
    for path in package_files():
        source = stage_of(module_name(path))
        for line, module, _ in imports(path):
            target = stage_of(module)
            if rank[target] > rank[source]:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {source} imports {module} ({target}), a later stage")
    assert not upward, "imports that point up the data path:\n" + "\n".join(upward)


def test_no_import_cycle_between_stages() -> None:
    """No cycle between stages (function-local imports included), whatever order the docstring gives."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in package_files():
        source = stage_of(module_name(path))
        for line, module, _ in imports(path):
            target = stage_of(module)
            if target != source:
                edges[source][target].append(f"{path.relative_to(ROOT)}:{line}")
    cycles = [c for c in strongly_connected(edges) if len(c) > 1]
    lines = [
        f"{a} -> {b}: {', '.join(where)}"
        for cycle in cycles
        for a in sorted(cycle)
        for b, where in sorted(edges[a].items())
        if b in cycle
    ]
    assert not cycles, "import cycles between stages:\n" + "\n".join(lines)


def strongly_connected(edges: dict[str, dict[str, list[str]]]) -> list[set[str]]:
    """Tarjan's strongly connected components of the graph ``edges`` (node -> successors)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            found.append(component)

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


def error_types() -> dict[str, str]:
    """Every exception class the package defines -> the module that defines it."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in package_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
                classes[node.name] = (module_name(path), bases)
    errors: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for name, (module, bases) in classes.items():
            if name in errors:
                continue
            builtin = [getattr(builtins, b, None) for b in bases]
            if any(b in errors for b in bases) or any(
                isinstance(b, type) and issubclass(b, BaseException) for b in builtin
            ):
                errors[name] = module
                changed = True
    return errors


def test_each_error_type_has_one_import_path() -> None:
    """An error type is imported from the module that defines it, never through another (a re-export)."""
    errors = error_types()
    assert {"ConfigError", "TargetError", "DataError", "CheckpointError"} <= set(errors)
    paths = package_files() + [p for tree in USERS for p in sorted((ROOT / tree).rglob("*.py"))]
    wrong = []
    for path in paths:
        for line, module, names in imports(path):
            for name in names:
                if name in errors and errors[name] != module:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {name} imported from {module}, not {errors[name]}")
    assert not wrong, "error types imported through another module:\n" + "\n".join(wrong)


def docstring_lines(path: Path) -> int:
    """Lines of the module docstring of ``path`` as written (0 without one)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path)), clean=False)
    return doc.count("\n") + 1 if doc else 0


def test_module_docstrings_are_short() -> None:
    """Every module docstring of the package is at most DOCSTRING_LINES lines, LONG_DOCSTRINGS aside.

    User-facing explanations (how to run, what a report means, measured figures) belong in docs/, derivations beside
    the function they explain or in docs/internals.md.
    """
    modules = {module_name(p): p for p in package_files()}
    assert LONG_DOCSTRINGS <= set(modules), f"LONG_DOCSTRINGS names modules that no longer exist: {LONG_DOCSTRINGS}"
    long = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for name, path in sorted(modules.items())
        if name not in LONG_DOCSTRINGS and (lines := docstring_lines(path)) > DOCSTRING_LINES
    ]
    assert not long, (
        f"module docstrings over {DOCSTRING_LINES} lines (keep what the module is for, its contract and why; move "
        "user-facing text to docs/ and derivations beside their function or to docs/internals.md):\n" + "\n".join(long)
    )
